"""Test doubles for code built on the sync engine: communicators that record and that follow a script.

They stand for one worker (world size 1) unless :class:`RecordingCommunicator` wraps a real
communicator, and count traffic as a real communicator would (what one worker would send), so a
test can pin which tensors travel at which step, and what that costs, without a process group::

    communicator = RecordingCommunicator()
    sync = LocalUpdateSync(optimizer, unified(4), communicator)
    ...
    assert communicator.average_kinds() == [["params", "exp_avg_0", "exp_avg_sq"], ...]

    scripted = ScriptedCommunicator([[x0 - d]])       # the first average returns x0 - d
    failing = ScriptedCommunicator(fail_at=3)         # the third average raises (a peer died)
    discarding = ScriptedCommunicator(discard_at=2)   # the second round is not committed
    flaky = ScriptedCommunicator(discard_at=(2, 3))   # nor the second and third

:func:`run_on_gloo` runs a function in real processes joined in a gloo group, for comparing a
real run with a simulated one.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.collectives import dtype_buckets
from mtdao.sync.communicator import Averages, Communicator, RoundNotCommitted, codec_groups
from mtdao.sync.exchange import BlockLayout
from mtdao.sync.layout import WorkerLayout


@dataclass
class Call:
    """One call to a communicator: which method, and the kinds and shapes of its tensors."""

    method: str
    """``average``, ``assign``, ``broadcast_from_first`` or ``commit``."""
    shapes: list[tuple[int, ...]]
    kinds: list[str] = field(default_factory=list)
    """The kinds of the tensors averaged (``average`` only)."""
    excluded: list[int] = field(default_factory=list)
    codecs: list[str] = field(default_factory=list)
    """Each averaged tensor's codec name, ``fp32`` when sent as it is (``average`` only)."""


class PeerFailure(RuntimeError):
    """Raised by :class:`ScriptedCommunicator` at its scripted round."""


class RecordingCommunicator(Communicator):
    """Logs every call in ``calls``; forwards it to ``inner`` when given.

    Without ``inner`` it is one worker whose averages are copies of its tensors, and whose traffic
    account counts what a real worker would send (one collective per dtype and device).
    """

    def __init__(self, inner: Communicator | None = None) -> None:
        super().__init__(inner.layout if inner is not None else WorkerLayout())
        self.inner = inner
        if inner is not None:
            self.traffic, self.transport = inner.traffic, inner.transport
        self.calls: list[Call] = []

    def average(
        self,
        tensors: Sequence[Tensor],
        kinds: Sequence[str],
        excluded: Sequence[int] = (),
        codecs: Sequence[Codec | None] | None = None,
    ) -> Averages:
        self.calls.append(_average_call(tensors, kinds, excluded, codecs))
        if self.inner is not None:
            return self.inner.average(tensors, kinds, excluded, codecs)
        return self._averages([t.clone() for t in tensors], tensors, kinds, codecs)

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        self.calls.append(Call("assign", _shapes(tensors)))
        (self.inner or super()).assign(tensors, values)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        self.calls.append(Call("broadcast_from_first", _shapes(tensors)))
        if self.inner is not None:
            self.inner.broadcast_from_first(tensors)

    def commit(self) -> None:
        self.calls.append(Call("commit", []))
        if self.inner is not None:
            self.inner.commit()

    def average_kinds(self) -> list[list[str]]:
        """The kinds of the tensors of every ``average`` call, in order."""
        return [call.kinds for call in self.calls if call.method == "average"]

    def _averages(
        self, values: list[Tensor], tensors: Sequence[Tensor], kinds: Sequence[str], codecs
    ):
        sizes, collectives = [], 0
        for codec, indices in codec_groups(len(tensors), codecs):
            group = [tensors[i] for i in indices]
            if codec is None:
                sizes += [(kinds[i], self.layout.worker_bytes(tensors[i])) for i in indices]
                collectives += len(dtype_buckets(group))
            else:
                layout = BlockLayout(tuple(t.numel() for t in group), codec.block, 1)
                sizes += layout.kind_bytes([kinds[i] for i in indices], codec)
                collectives += 1 if codec.gathered else 2
        num_bytes, collectives = self._account_sizes(sizes, collectives)
        return Averages(values, num_bytes, collectives)


Script = Sequence[Tensor] | Callable[[Sequence[Tensor]], Sequence[Tensor]]


class ScriptedCommunicator(RecordingCommunicator):
    """One worker whose averages follow a script, for pinning what the engine does with them.

    ``averages[i]`` is what the (i+1)-th ``average`` call returns: a list of tensors, or a function
    of the input tensors. Past the end of the script an average is a copy of the inputs.
    ``fail_at`` (1-based) makes that call raise ``error`` (default :class:`PeerFailure`) before it
    returns anything, as a collective does when a peer dies mid-round. ``discard_at`` (1-based,
    one number or several) makes those rounds' :meth:`commit` raise :class:`RoundNotCommitted`,
    as a fault-tolerant communicator does when the round's averages arrived but a peer failed
    before it committed.
    """

    def __init__(
        self,
        averages: Sequence[Script] = (),
        *,
        fail_at: int | None = None,
        error: BaseException | None = None,
        discard_at: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.script = list(averages)
        self.fail_at = fail_at
        self.error = error
        self.discard_at = {discard_at} if isinstance(discard_at, int) else set(discard_at or ())

    def commit(self) -> None:
        self.calls.append(Call("commit", []))
        number = sum(call.method == "commit" for call in self.calls)
        if number in self.discard_at:
            raise RoundNotCommitted(f"scripted discard of round {number}")

    def average(
        self,
        tensors: Sequence[Tensor],
        kinds: Sequence[str],
        excluded: Sequence[int] = (),
        codecs: Sequence[Codec | None] | None = None,
    ) -> Averages:
        self.calls.append(_average_call(tensors, kinds, excluded, codecs))
        number = len(self.average_kinds())
        if number == self.fail_at:
            raise self.error or PeerFailure(f"scripted failure of average call {number}")
        if number <= len(self.script):
            entry = self.script[number - 1]
            values = entry(tensors) if callable(entry) else entry
            return self._averages([v.clone() for v in values], tensors, kinds, codecs)
        return self._averages([t.clone() for t in tensors], tensors, kinds, codecs)


def _average_call(tensors, kinds, excluded, codecs) -> Call:
    names = ["fp32" if codec is None else codec.name for codec in codecs or [None] * len(tensors)]
    return Call("average", _shapes(tensors), list(kinds), list(excluded), names)


def _shapes(tensors: Sequence[Tensor]) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tensors]


# -- real processes ---------------------------------------------------------------------------------


def run_on_gloo(
    work: Callable[[], Any],
    world_size: int,
    root: str | Path,
    *,
    preload: Sequence[str] = (),
    timeout_s: float = 120.0,
) -> list[Any]:
    """``work()`` in ``world_size`` fresh processes joined in a gloo group (one torch thread
    each); returns what each rank's call returned, in rank order.

    ``work`` must be a module-level function (it is pickled by name). A fork server imports
    torch, ``torch._dynamo`` (which torch.optim otherwise imports lazily in every process) and
    the modules in ``preload`` once for all ranks. A rank that fails or hangs past ``timeout_s``
    raises RuntimeError with the ranks' tracebacks, and no process is left behind.
    """
    root = Path(root)
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["torch._dynamo", *preload])
    else:
        context = mp.get_context("spawn")
    processes = [
        context.Process(target=_gloo_rank, args=(rank, world_size, str(root), work))
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    errors = "\n".join(p.read_text() for p in sorted(root.glob("rank*.err")))
    if hung:
        raise RuntimeError(f"ranks {hung} still running after {timeout_s:.0f} s\n{errors}")
    if any(process.exitcode != 0 for process in processes):
        raise RuntimeError(errors or "a worker process failed")
    return [torch.load(root / f"rank{rank}.pt") for rank in range(world_size)]


def _gloo_rank(rank: int, world_size: int, root: str, work: Callable[[], Any]) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{root}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        torch.save(work(), Path(root) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(root) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
