"""What crosses the link: the dtype of each kind of tensor in a round (:mod:`.compression`), the
blockwise codecs behind each dtype (:mod:`.quantize`, :mod:`.lowbit`, :mod:`.topk`) and their C++
CPU kernels (:mod:`.native_codecs`). Codecs know nothing of rounds or policies; the engine hands
them blocks of float32 values."""
