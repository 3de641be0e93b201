"""Bit parity after every committed round: the replicas compare what the round made identical.

A committed round assigns the same averages to every member: the parameters and states of a
blocking round, the gradients of a DDP one. Right after the assignment each member hashes what it
now holds (xxh3-64 per tensor, combined into one number) and the members exchange these in one
small all-reduce on the round's group, each writing its own row. When one differs from the
majority's, every member says so in one line, naming the replica and the first tensor that
differs (a second exchange, of the per-tensor digests, runs only then), and the deviant gives up
the round's commit: at the next quorum it is behind on commits, and is healed from a member at the
top count, one of the majority (as a member that sits a round out is, :mod:`.round_identity`).
With no majority (two members that differ) both are named and each keeps its own state.

Not checked: a delayed round merged into each member's local progress (each then holds its own
values by design; the final round of such a run is blocking, and checked). An exchange that fails
(a peer lost right after the commit) leaves the round unchecked, said in one line: the round
stands, and the next quorum goes on without the lost peer.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import xxhash
from torch import Tensor

from mtdao.sync.dtensors import local_shard
from mtdao.sync.torchft.plumbing import first_line

if TYPE_CHECKING:
    from mtdao.sync.engine import LocalUpdateSync
    from mtdao.sync.torchft.quorum import Quorum

INT64_SPAN = 1 << 64


def tensor_digest(tensor: Tensor) -> int:
    """xxh3-64 of the tensor's bytes (of a sharded tensor, this process's shard), as an int64."""
    shard = local_shard(tensor).detach()
    data = shard.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return _signed(xxhash.xxh3_64_intdigest(data))


def combined_digest(digests: Sequence[int]) -> int:
    """One int64 for a list of tensor digests (their order counts)."""
    packed = torch.tensor(list(digests), dtype=torch.int64).numpy().tobytes()
    return _signed(xxhash.xxh3_64_intdigest(packed))


def _signed(value: int) -> int:
    return value - INT64_SPAN if value >= INT64_SPAN // 2 else value


@dataclass
class Mismatch:
    """Replicas that held something else than the majority after a committed round."""

    step: int
    deviants: list[int]
    """Replica ids (all of those that differ, when there is no majority)."""
    majority: list[int]
    """Replica ids holding the majority's values (empty: no majority)."""
    tensor: str
    """The first tensor of the round that differs."""

    def line(self) -> str:
        who = ", ".join(map(str, self.deviants))
        if not self.majority:
            return (
                f"parity: after the round at step {self.step} replicas {who} hold different "
                f"values of {self.tensor} and no majority agrees: each keeps its own"
            )
        return (
            f"parity: after the round at step {self.step} replica {who} holds another "
            f"{self.tensor} than replicas {', '.join(map(str, self.majority))}; it heals from "
            "them at the next quorum"
        )


def sum_in_group(quorum: Quorum, table: Tensor) -> Tensor:
    """``table`` summed over the round's group (its commit is behind it: no manager call),
    the wait watched as a round's collectives are."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    work = quorum.group.allreduce([table], options)
    quorum.wait_for(work)
    return table


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ParityCheck:
    """The check a replica runs after each assignment of a committed round (see the module
    docstring). ``sync`` (set when the engine attaches) names the tensors and the step."""

    def __init__(self, say: Callable[[str], None] = _to_stderr) -> None:
        self.say = say
        self.sync: LocalUpdateSync | None = None
        self.exchange: Callable[[Any, Tensor], Tensor] = sum_in_group
        """How a table is summed over the round's members (a test double replaces it)."""
        self.checks = 0
        self.seconds = 0.0
        """Spent hashing and exchanging, over every check."""
        self.mismatches: list[Mismatch] = []
        self._unchecked_at: int | None = None  # the step whose round's exchange failed

    def check(self, tensors: Sequence[Tensor], quorum: Quorum) -> Mismatch | None:
        """Compare ``tensors`` (just assigned, the round committed) with the other members'; a
        replica that deviates from the majority gives up the round's commit (it heals next)."""
        if len(quorum.members) < 2 or not tensors or self._unchecked_at == self._step():
            return None  # (the round's other tensors go unchecked too once its group broke)
        started = time.perf_counter()
        try:
            mismatch = self._compare(tensors, quorum)
        except Exception as error:  # the round stands; a lost peer leaves the next quorum
            self.say(f"parity: the round at step {self._step()} is unchecked: {first_line(error)}")
            mismatch, self._unchecked_at = None, self._step()
        finally:
            self.seconds += time.perf_counter() - started
        self.checks += 1
        deviant = mismatch is not None and quorum.members[quorum.rank] in mismatch.deviants
        # every process of a sharded replica heals with it, whichever of its shards differed
        if quorum.processes.sum(int(deviant and bool(mismatch.majority))):
            give_up_a_commit(quorum.manager)
        return mismatch

    def _compare(self, tensors: Sequence[Tensor], quorum: Quorum) -> Mismatch | None:
        members, rank = quorum.members, quorum.rank
        digests = [tensor_digest(t) for t in tensors]
        table = torch.zeros(len(members), 2, dtype=torch.int64)
        table[rank, 0], table[rank, 1] = combined_digest(digests), len(digests)
        rows = self.exchange(quorum, table.reshape(-1)).reshape(len(members), 2).tolist()
        combined = [digest for digest, _ in rows]
        if len(set(combined)) == 1:
            return None
        common, count = Counter(combined).most_common(1)[0]
        has_majority = count * 2 > len(members)
        majority = [m for m, d in zip(members, combined) if d == common] if has_majority else []
        deviants = [m for m in members if m not in majority]
        if len({n for _, n in rows}) > 1:  # another structure of round: no tensor to compare
            tensor = "set of tensors"
        else:
            tensor = self._first_differing(tensors, digests, quorum, combined, common)
        mismatch = Mismatch(self._step(), deviants, majority, tensor)
        self.mismatches.append(mismatch)
        self.say(mismatch.line())
        return mismatch

    def _first_differing(self, tensors, digests, quorum, combined, common) -> str:
        """The name of the first tensor whose digest is not the same on every member."""
        members, rank = len(quorum.members), quorum.rank
        table = torch.zeros(members, len(digests), dtype=torch.int64)
        table[rank] = torch.tensor(digests, dtype=torch.int64)
        table = self.exchange(quorum, table.reshape(-1)).reshape(members, len(digests))
        reference = table[combined.index(common)]
        differs = (table != reference).any(dim=0).nonzero()
        index = int(differs[0]) if len(differs) else 0
        return self._name(tensors[index], index)

    def _name(self, tensor: Tensor, index: int) -> str:
        if self.sync is not None:
            names = tensor_names(self.sync)
            if id(tensor) in names:
                return names[id(tensor)]
        return f"tensor {index} of the round {tuple(tensor.shape)}"

    def _step(self) -> int:
        return self.sync.step_count if self.sync is not None else -1


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


def give_up_a_commit(manager) -> None:
    """Count one commit less: at the next quorum this replica is behind, and heals from a
    member at the top count."""
    state = manager.state_dict()
    manager.load_state_dict({**state, "step": max(0, state["step"] - 1)})
