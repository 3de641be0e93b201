"""Process-group setup for real workers launched by ``torchrun`` (one process per worker), and the
one-line errors of a collective that fails because a peer is frozen or gone."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

DEFAULT_COLLECTIVE_TIMEOUT_S = 180.0


class CollectiveError(RuntimeError):
    """A collective with the other workers failed: one of them is frozen, too slow, or gone."""


@dataclass(frozen=True)
class ProcessInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_process_group(
    device: torch.device, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
) -> ProcessInfo:
    """Join the torchrun job (NCCL on GPU, gloo on CPU); a no-op when not launched by torchrun.

    ``timeout_s`` bounds every collective (and the rendezvous): a peer that stops answering makes
    the others fail after that long instead of hanging (see :func:`collective_errors`).
    """
    if not launched_by_torchrun():
        return ProcessInfo()
    if not dist.is_initialized():
        if device.type == "cuda":  # NCCL's barrier and object collectives use the current device
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = restart_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
    return ProcessInfo(rank=dist.get_rank(), world_size=dist.get_world_size())


def restart_store(timeout: datetime.timedelta):
    """The store to join through under torchrun, with keys of this attempt only; None when
    torchrun does not share its own store with the workers.

    torchrun lends its rendezvous store to the workers, and a worker group restarted by
    ``--max-restarts`` finds there the keys its previous attempt wrote: the new processes read
    the addresses of dead peers (gloo then fails to connect, NCCL reads an old unique id). Keys
    prefixed with the restart count keep the attempts apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"mtdao/attempt-{attempt}", shared)


def leave_process_group() -> None:
    """Destroy the process group if this process joined one (clean exit under torchrun)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def joins_process_groups(argv: list[str]) -> bool:
    """Whether a process with these ``mtdao`` arguments joins process groups: launched by
    torchrun, or a replica of a fault-tolerant run (see :func:`end_worker_process`)."""
    return launched_by_torchrun() or "--fault-tolerant" in argv


def end_worker_process(exit_code: int) -> NoReturn:
    """End a process that joined process groups without tearing the interpreter down.

    A gloo worker thread lets go of its last collective a moment after the collective completes;
    the tensors it held then hand their Python objects back, which takes the GIL. If the main
    thread has finished by then and the interpreter is finalizing, the worker thread cannot take
    the GIL and the process aborts (SIGABRT, "terminate called without an active exception")
    after a run that succeeded. The process group has been left and every file the run writes is
    closed at this point: flush what is buffered and leave.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(exit_code)


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# -- failed collectives -------------------------------------------------------------------------

_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_GONE = re.compile(
    r"connection (reset|closed|refused)|broken pipe|end of file|peer|socket closed", re.IGNORECASE
)


def explain_collective_failure(error: BaseException, timeout_s: float) -> CollectiveError | None:
    """A one-line :class:`CollectiveError` for an error a collective raised (gloo raises a plain
    RuntimeError, NCCL a DistBackendError); None when ``error`` is something else."""
    distributed_error = isinstance(error, dist.DistError) if dist.is_available() else False
    if not (distributed_error or type(error) is RuntimeError):
        return None
    text = str(error)
    if _TIMED_OUT.search(text):
        return CollectiveError(
            f"no answer from another worker within {timeout_s:g} s "
            f"(--collective-timeout {timeout_s:g}): a peer is frozen, stalled or lost; raise "
            "--collective-timeout if the workers are only slow"
        )
    if _PEER_GONE.search(text):
        first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        where = re.sub(r"^\[[^\]]*\]\s*", "", first_line).split(". ")[0]  # no source location
        return CollectiveError(
            f"another worker ended or lost its connection during a collective ({where}); "
            "resume with --resume (torchrun --max-restarts does it with the same command line)"
        )
    return None


@contextlib.contextmanager
def collective_errors(info: ProcessInfo, timeout_s: float) -> Iterator[None]:
    """Turn a failed collective of a distributed run into one line naming what to do."""
    try:
        yield
    except RuntimeError as error:
        explained = explain_collective_failure(error, timeout_s) if info.distributed else None
        if explained is None:
            raise
        raise explained from None
