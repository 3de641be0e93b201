"""``mtdao wan-drill``: fault-tolerant replicas across emulated WAN sites that fail, checked."""
