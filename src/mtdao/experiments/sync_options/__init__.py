"""``mtdao sync-options``: the loss and traffic of overlapped, fragmented and quantized rounds."""
