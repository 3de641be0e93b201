"""``mtdao wan-drill``: fault-tolerant replicas across emulated WAN sites that fail, checked;
and the wall-clock model calibrated on such drills (``python -m mtdao.experiments.wan_drill.beyond``)."""
