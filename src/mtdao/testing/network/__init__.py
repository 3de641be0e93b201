"""Emulated networks on one machine: slow links between worker processes (:mod:`.netem`,
:mod:`.relay_link`) and WAN sites in network namespaces (:mod:`.sites`) with a userspace switch
(:mod:`.relay`), stragglers (:mod:`.straggler`) and the drills' scenarios (:mod:`.scenario`)."""
