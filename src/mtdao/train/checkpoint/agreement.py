"""How the processes of one run agree on a checkpoint (every one saved it, or none uses it).

What may go into a checkpoint and how its files are read back is :mod:`mtdao.state_files`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Collective(Protocol):
    """How the processes of one run agree; every process calls every method in the same order."""

    def all_true(self, flag: bool) -> bool:
        """True on every process when ``flag`` is True on every process (also a barrier)."""
        ...


class SingleProcess:
    """The collective of a run with one process."""

    def all_true(self, flag: bool) -> bool:
        return flag


class BarrierOnly:
    """Only a barrier is known: every process keeps its own verdict (older callers)."""

    def __init__(self, barrier) -> None:
        self.barrier = barrier

    def all_true(self, flag: bool) -> bool:
        self.barrier()
        return flag


class ProcessGroupCollective:
    """``torch.distributed``: a MIN all-reduce of one integer over ``group`` (the default group
    when None); on an NCCL group the integer lives on this process's current GPU."""

    def __init__(self, group=None, device: torch.device | None = None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        self.device = device or torch.device("cpu")

    def all_true(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        self.dist.all_reduce(value, op=self.dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())
