"""Process-group setup for real workers launched by ``torchrun`` (one process per worker)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_process_group(device: torch.device, timeout_s: float = 600.0) -> ProcessInfo:
    """Join the torchrun job (NCCL on GPU, gloo on CPU); a no-op when not launched by torchrun."""
    if not launched_by_torchrun():
        return ProcessInfo()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return ProcessInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def barrier(info: ProcessInfo) -> None:
    if info.distributed:
        dist.barrier()


def leave_process_group() -> None:
    """Destroy the process group if this process joined one (clean exit under torchrun)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
