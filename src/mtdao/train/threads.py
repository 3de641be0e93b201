"""One torch thread when the machine is already busy (``mtdao train`` without OMP_NUM_THREADS):
when every core already has a job, a second intra-op thread mostly waits (docs/training.md, "Time
per step, and threads")."""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def one_thread_if_busy() -> str | None:
    """Use one torch thread when the 1-minute load average is at least the number of cores and
    the user set no thread count; returns the line that says so, or None."""
    if os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads() == 1:
        return None
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None
    cores = available_cores()
    if load < cores:
        return None
    torch.set_num_threads(1)
    return (
        f"the machine is busy (load {load:.1f} on {cores} cores): training with 1 thread, "
        "faster there; set OMP_NUM_THREADS to choose"
    )
