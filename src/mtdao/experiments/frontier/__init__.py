"""``mtdao frontier``: final loss against traffic for every method, codec and K."""
