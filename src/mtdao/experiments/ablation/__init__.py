"""``mtdao ablation``: how much each method loses against DDP as the sync period K grows."""
