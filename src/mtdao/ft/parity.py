"""Bit parity after every committed round (docs/fault-tolerance.md, "Bit parity after every
round"): each member hashes what the round assigned; the digests travel in the exchange that opens
the next round, and a deviant is named and sits that round out. The final round compares at once.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import xxhash
from torch import Tensor

from mtdao.ft.lines import first_line, to_stderr
from mtdao.ft.shards import ReplicaProcesses
from mtdao.sync.dtensors import local_shard

if TYPE_CHECKING:
    from mtdao.ft.quorum import Quorum
    from mtdao.sync.engine import LocalUpdateSync


def tensor_digest(tensor: Tensor) -> int:
    """xxh3-64 of the tensor's bytes (of a sharded tensor, this process's shard), as an int64."""
    data = local_shard(tensor).detach().cpu().contiguous()  # no copy of a CPU, contiguous one
    try:  # hashed in place (a round's tensors are hashed every round: no copy, few calls)
        array = data.numpy()
    except TypeError:  # a dtype numpy lacks (bfloat16): its bytes
        array = data.reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(xxhash.xxh3_64_digest(array), "big", signed=True)


def combined_digest(digests: Sequence[int]) -> int:
    """One int64 for a list of tensor digests (their order counts)."""
    packed = torch.tensor(list(digests), dtype=torch.int64).numpy().tobytes()
    return int.from_bytes(xxhash.xxh3_64_digest(packed), "big", signed=True)


@dataclass
class Mismatch:
    """Replicas that held something else than the majority after a committed round."""

    step: int
    deviants: list[int]  # replica ids (all of those that differ, when there is no majority)
    majority: list[int]  # replica ids holding the majority's values (empty: no majority)
    tensor: str  # the first tensor of the round that differs
    final: bool = False
    deviant_ranks: list[int] = field(default_factory=list)  # their quorum ranks (ids may repeat)

    def line(self) -> str:
        who = ", ".join(map(str, self.deviants))
        which = "the final round" if self.final else f"the round at step {self.step}"
        if not self.majority:
            return (
                f"parity: after {which} replicas {who} hold different values of {self.tensor} "
                "and no majority agrees: each keeps its own"
            )
        then = (
            "its model is not theirs"
            if self.final
            else "it sits the next round out and heals from them"
        )
        return (
            f"parity: after {which} replica {who} holds another {self.tensor} than replicas "
            f"{', '.join(map(str, self.majority))}; {then}"
        )


@dataclass
class Assigned:
    """What this replica holds after the assignments of one committed round."""

    step: int
    tensors: list[Tensor]
    digests: list[int]
    final: bool


MAX_TENSORS = 1 << 16  # a round's tensors (parameters and states): more is no honest count

Sum = Callable[[Tensor], Tensor]
"""A flat int64 table summed over the round's members (each writes its own row)."""


def summed_rows(sum_over: Sum, rank: int, rows: int, row: Sequence[int]) -> list[list[int]]:
    """Every member's ``row`` (this one's at ``rank``) from one sum over the ``rows`` members."""
    table = torch.zeros(rows, len(row), dtype=torch.int64)
    table[rank] = torch.tensor(list(row), dtype=torch.int64)
    return sum_over(table.reshape(-1)).reshape(rows, len(row)).tolist()


def sum_in_group(quorum: Quorum) -> Sum:
    """Sums over the round's group after its commit (no manager call), the wait watched."""

    def summed(table: Tensor) -> Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        work = quorum.group.allreduce([table], options)
        quorum.wait_for(work)
        return table

    return summed


class ParityCheck:
    """A replica's side of the check: :meth:`assigned` after each assignment of a committed round,
    :meth:`position` and :meth:`judge` in the exchange that opens the next."""

    def __init__(self, say: Callable[[str], None] = to_stderr) -> None:
        self.say = say
        self.sync: LocalUpdateSync | None = None
        self.final_sum: Callable[[Quorum], Sum] = sum_in_group  # a test double replaces it
        self.last: Assigned | None = None
        self.processes: ReplicaProcesses = ReplicaProcesses()  # the last round's
        self.seconds = 0.0  # spent hashing and comparing, over the whole run
        self.mismatches: list[Mismatch] = []

    def assigned(self, tensors: Sequence[Tensor], quorum: Quorum, final: bool) -> None:
        """Hash ``tensors``, just assigned by a committed round (parameters and states in two
        calls); the final round, with every member in it, compares now."""
        started = time.perf_counter()
        step = self.sync.step_count if self.sync is not None else -1
        self.processes = quorum.processes
        if self.last is None or self.last.step != step or self.last.final != final:
            self.last = Assigned(step, [], [], final)
        self.last.tensors += tensors
        self.last.digests += [tensor_digest(t) for t in tensors]
        self.seconds += time.perf_counter() - started
        if final and len(quorum.members) > 1:
            self._compare_final(quorum)

    def position(self) -> list[int]:
        """This replica's columns in the exchange that opens a round: the last round's step + 1,
        its combined digest and its tensor count (zeros: none)."""
        if self.last is None:
            return [0, 0, 0]
        # a sharded replica: one digest over its processes' shards, so that they all judge alike
        combined = self.processes.sum(combined_digest(self.last.digests))
        return [self.last.step + 1, combined, len(self.last.digests)]

    def judge(self, positions: list[list[int]], members: list[int], rank: int, sum_over: Sum):
        """{quorum rank: why it sits the round out} for the members that held other values than
        the majority after the last round they all assigned."""
        started = time.perf_counter()
        try:
            mismatch = self._mismatch(positions, members, rank, sum_over)
        finally:
            self.seconds += time.perf_counter() - started
        if mismatch is None or not mismatch.majority:
            return {}
        reason = f"its values after the round at step {mismatch.step} differ from the majority's"
        return {r: reason for r in mismatch.deviant_ranks}

    def _compare_final(self, quorum: Quorum) -> None:
        started = time.perf_counter()
        sum_over = self.final_sum(quorum)
        try:
            positions = summed_rows(sum_over, quorum.rank, len(quorum.members), self.position())
            self._mismatch(positions, quorum.members, quorum.rank, sum_over)
        except Exception as error:  # the round stands
            self.say(f"parity: the final round is unchecked: {first_line(error)}")
        finally:
            self.seconds += time.perf_counter() - started

    def _mismatch(self, positions, members, rank, sum_over: Sum) -> Mismatch | None:
        recorded = Counter(p[0] for p in positions if p[0] > 0)
        if not recorded:
            return None
        reference = max(recorded, key=lambda at: (recorded[at], at))  # a tie: the later round
        at = [r for r, p in enumerate(positions) if p[0] == reference]
        combined = [positions[r][1] for r in at]
        if len(at) < 2 or len(set(combined)) == 1:
            return None
        common, count = Counter(combined).most_common(1)[0]
        majority = [r for r in at if positions[r][1] == common] if count * 2 > len(at) else []
        deviants = [r for r in at if r not in majority]
        counts = {positions[r][2] for r in at}
        tensor = "set of tensors"  # rounds of another structure: no tensor to compare
        if len(counts) == 1 and 0 < next(iter(counts)) <= MAX_TENSORS:
            width = counts.pop()
            tensor = self._first_differing(
                len(positions), at, majority, rank, width, reference, sum_over
            )
        final = self.last is not None and self.last.final
        mismatch = Mismatch(
            reference - 1, [members[r] for r in deviants], [members[r] for r in majority],
            tensor, final, deviants,
        )  # fmt: skip
        self.mismatches.append(mismatch)
        self.say(mismatch.line())
        return mismatch

    def _first_differing(self, rows, at, majority, rank, count, reference, sum_over: Sum) -> str:
        """The first tensor whose digest differs among the members ``at`` the reference round
        (all ``rows`` members take part in the sum; those elsewhere add zeros)."""
        own = self.last if self.last is not None and self.last.step + 1 == reference else None
        row = own.digests if own is not None and len(own.digests) == count else [0] * count
        table = summed_rows(sum_over, rank, rows, row)
        reference = table[(majority or at)[0]]
        differs = (i for i in range(count) if any(table[r][i] != reference[i] for r in at))
        index = next(differs, 0)
        if own is not None and len(own.tensors) == count:
            return self._name(own.tensors[index], index)
        return f"tensor {index} of the round"

    def _name(self, tensor: Tensor, index: int) -> str:
        names = tensor_names(self.sync) if self.sync is not None else {}
        return names.get(id(tensor), f"tensor {index} of the round {tuple(tensor.shape)}")


def tensor_names(sync: LocalUpdateSync) -> dict[int, str]:
    """id -> name of every parameter, gradient and optimizer state a round may assign."""
    names: dict[int, str] = {}
    for param in sync.params:
        name = sync.param_names[id(param)]
        names[id(param)] = f"parameter {name!r}"
        if param.grad is not None:
            names[id(param.grad)] = f"gradient of {name!r}"
        for key, value in sync.optimizer.state.get(param, {}).items():
            if isinstance(value, Tensor):
                names[id(value)] = f"state {key!r} of {name!r}"
    return names
