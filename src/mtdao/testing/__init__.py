"""Tools for rehearsing what can go wrong: :mod:`.fault_drill` steers the replicas of a
fault-tolerant run from outside (pauses, kills, held rounds) and records their state
(:mod:`.digests`); :mod:`.network` emulates the links and sites they run across; :mod:`.ports`
finds free ports."""
