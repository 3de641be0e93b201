"""Running out of memory: one line naming the flags that size the run, not an allocator trace. (A
process the kernel's OOM killer ends cannot say anything: keep a run inside its memory.)"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

from mtdao.train.config import TrainConfig

_CPU_ALLOCATOR = ("can't allocate memory", "not enough memory", "DefaultCPUAllocator")
_TRIED = re.compile(r"(?:tried to allocate|Tried to allocate) ([0-9.]+ ?[KMGT]?i?B|\d+ bytes)")


class OutOfMemory(RuntimeError):
    """The run needs more memory than its device has; the message is one line."""


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _CPU_ALLOCATOR)


def explain(
    error: BaseException, config: TrainConfig, device: torch.device, simulated: bool
) -> str:
    tried = _TRIED.search(str(error))
    what = f" (it tried to allocate {tried.group(1)})" if tried else ""
    per_step = config.text.batch_size * config.text.seq_len
    others = ["a smaller --model"]
    if simulated and config.parallel.workers > 1:
        others.append(
            f"fewer --workers (all {config.parallel.workers} are simulated in this process)"
        )
    if not simulated:
        others.append("more --shards per worker")
    return (
        f"out of memory on {device}{what}: lower --batch-size (now {config.text.batch_size} "
        f"sequences of --seq-len {config.text.seq_len}, {per_step:,} tokens per worker per step), "
        f"or use {' or '.join(others)}"
    )


@contextlib.contextmanager
def out_of_memory_errors(
    config: TrainConfig, device: torch.device, simulated: bool
) -> Iterator[None]:
    """Turn an allocation failure inside the block into :class:`OutOfMemory`."""
    try:
        yield
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        raise OutOfMemory(explain(error, config, device, simulated)) from None
