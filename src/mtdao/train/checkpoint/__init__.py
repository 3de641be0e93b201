"""Checkpoints of a run: the store (atomic, verified, kept newest-first), what a run saves
(plain and sharded), and how files are read back safely."""
