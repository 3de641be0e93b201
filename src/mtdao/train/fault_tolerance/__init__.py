"""Fault-tolerant runs: one replica's driver (:mod:`.replica`) and the lighthouse."""
