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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from mtdao.sync.collectives import dtype_buckets
from mtdao.sync.communicator import Averages, Communicator, RoundNotCommitted
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
            self.traffic = inner.traffic
        self.calls: list[Call] = []

    def average(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> Averages:
        self.calls.append(Call("average", _shapes(tensors), list(kinds), list(excluded)))
        if self.inner is not None:
            return self.inner.average(tensors, kinds, excluded)
        return self._averages([t.clone() for t in tensors], tensors, kinds)

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

    def _averages(self, values: list[Tensor], tensors: Sequence[Tensor], kinds: Sequence[str]):
        num_bytes, collectives = self._account(tensors, kinds, len(dtype_buckets(tensors)))
        return Averages(values, num_bytes, collectives)


Script = Sequence[Tensor] | Callable[[Sequence[Tensor]], Sequence[Tensor]]


class ScriptedCommunicator(RecordingCommunicator):
    """One worker whose averages follow a script, for pinning what the engine does with them.

    ``averages[i]`` is what the (i+1)-th ``average`` call returns: a list of tensors, or a function
    of the input tensors. Past the end of the script an average is a copy of the inputs.
    ``fail_at`` (1-based) makes that call raise ``error`` (default :class:`PeerFailure`) before it
    returns anything, as a collective does when a peer dies mid-round. ``discard_at`` (1-based)
    makes that round's :meth:`commit` raise :class:`RoundNotCommitted`, as a fault-tolerant
    communicator does when the round's averages arrived but a peer failed before it committed.
    """

    def __init__(
        self,
        averages: Sequence[Script] = (),
        *,
        fail_at: int | None = None,
        error: BaseException | None = None,
        discard_at: int | None = None,
    ) -> None:
        super().__init__()
        self.script = list(averages)
        self.fail_at = fail_at
        self.error = error
        self.discard_at = discard_at

    def commit(self) -> None:
        self.calls.append(Call("commit", []))
        number = sum(call.method == "commit" for call in self.calls)
        if number == self.discard_at:
            raise RoundNotCommitted(f"scripted discard of round {number}")

    def average(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> Averages:
        self.calls.append(Call("average", _shapes(tensors), list(kinds), list(excluded)))
        number = len(self.average_kinds())
        if number == self.fail_at:
            raise self.error or PeerFailure(f"scripted failure of average call {number}")
        if number <= len(self.script):
            entry = self.script[number - 1]
            values = entry(tensors) if callable(entry) else entry
            return self._averages([v.clone() for v in values], tensors, kinds)
        return self._averages([t.clone() for t in tensors], tensors, kinds)


def _shapes(tensors: Sequence[Tensor]) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tensors]
