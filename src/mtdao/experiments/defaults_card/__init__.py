"""The defaults card (``mtdao compare --preset defaults-card``): every method at its own
defaults, across run lengths, sync periods and corpora."""
