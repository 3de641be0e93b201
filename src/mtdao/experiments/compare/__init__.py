"""``mtdao compare``: every method on the same budget and seeds (and ``--preset``, whole
comparisons in one flag, the defaults card among them)."""
