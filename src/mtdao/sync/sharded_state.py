"""The sync engine's state as a sharded worker checkpoints it: DTensors for DCP, the rest plain.

A process of a sharded worker holds its own shard of everything element-wise the engine keeps:
the anchors and the outer momentum, each delayed round's tensors (what it sent, its snapshots,
the averages) and every error-feedback residual. These go to DCP like the parameters, as DTensors
named by the tensor they belong to: DCP records their global shapes, so they reshard exactly on a
resume with another number of shards (each value is element-wise, whatever block it was quantized
in). The rest (the step, the traffic account, the record of rounds, each round's steps and byte
counts, which parameters have residuals) is plain and goes to the worker's own file; it says how
to lay the same DTensors out again before DCP reads into them.

Bytes sent per process (``Traffic.process_bytes``) differ between a worker's processes only by
their shards' sizes; the plain part keeps every process's count. A run resumed with another number
of shards counts each process's earlier bytes as its share of the worker's.

The engine (:class:`~mtdao.sync.engine.LocalUpdateSync`) takes these methods from
:class:`ShardedEngineState`, so that whoever checkpoints it asks the engine for its state and never
walks its rounds, plan or residuals.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.sync.dtensors import local_shard, process_share, shard_like
from mtdao.sync.rounds import SyncRound

ROUND_TENSORS = ("sent", "snapshots", "averages")
GLOBAL_TENSORS = ("anchors", "outer")
"""The keys of the engine's ``state_dict`` that DCP holds whole, sharded like the parameters."""


class ShardedEngineState:
    """The sharded form of the engine's state (a mixin of ``LocalUpdateSync``: it uses the
    engine's parameters, names, anchors, outer step, plan, rounds in flight and layout)."""

    params: list[Tensor]
    param_names: dict[int, str]
    anchors: list[Tensor]
    outer: Any
    plan: Any
    pending: Any
    layout: Any
    traffic: Any

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the engine's sharded tensors as DTensors, for DCP; the rest of its ``state_dict``,
        plain, for the worker's file). A collective over the worker's shard group (every process
        of the worker calls it): the plain part holds every process's bytes sent."""
        plain = self.state_dict()
        for key in GLOBAL_TENSORS:
            plain.pop(key)
        sharded = self._global_tensors()
        sharded.update(self._split_rounds_and_residuals(plain))
        plain["traffic"]["process_bytes"] = self._gather_process_bytes()
        return sharded, plain

    def sharded_layout(self, plain: dict[str, Any] | None = None) -> dict[str, Any]:
        """DTensors shaped as :meth:`sharded_state_dict` saved them, sharded as this engine
        shards, for DCP to read into: the anchors and outer momentum (this engine's own tensors),
        and, from ``plain`` (that call's plain part, as the worker file holds it), the rounds in
        flight and the residuals. Without ``plain``: the tensors every such engine holds."""
        names = self._names()
        sharded = self._global_tensors()
        for index, saved in enumerate((plain or {}).get("pending", [])):
            due = self.plan.collect(saved["step"])
            sharded.setdefault("rounds", {})[str(index)] = {
                "sent": _named(due, _blank(due), saved["own_sent"]),
                "snapshots": _named(due, _blank(due)),
                "averages": _named(due, _blank(due)),
            }
        residuals_of = ((plain or {}).get("pseudo_gradients") or {}).get("residuals_of")
        if residuals_of is not None:
            sharded["residuals"] = {
                names[i]: shard_like(self.params[i], torch.zeros_like(local_shard(self.params[i])))
                for i in residuals_of
            }
        return sharded

    def load_sharded_state_dict(self, sharded: dict[str, Any], plain: dict[str, Any]) -> None:
        """Load the state :meth:`sharded_state_dict` gave: ``sharded``, the DTensors DCP read into
        (laid out by :meth:`sharded_layout` of ``plain``), and ``plain`` (left unchanged)."""
        state = copy.deepcopy(plain)
        self._join_rounds_and_residuals(state, sharded)
        traffic = state["traffic"]
        traffic["process_bytes"] = _process_bytes_of(
            traffic.get("process_bytes"), traffic["bytes"], self.layout, process_share(self.params)
        )
        names = self._names()
        state["anchors"] = [local_shard(sharded["anchors"][n]) for n in names]
        state["outer"] = None
        if self.outer is not None:
            momentum = sharded["outer_momentum"]
            state["outer"] = {"momentum_buffers": [local_shard(momentum[n]) for n in names]}
        self.load_state_dict(state)

    # -- the parts ----------------------------------------------------------------------------

    def _names(self) -> list[str]:
        return [self.param_names[id(p)] for p in self.params]

    def _global_tensors(self) -> dict[str, Any]:
        """The anchors and the outer momentum: this engine's own tensors, as DTensors by name."""
        names = self._names()
        sharded: dict[str, Any] = {
            "anchors": {n: shard_like(p, a) for n, p, a in zip(names, self.params, self.anchors)}
        }
        if self.outer is not None:
            buffers = self.outer.momentum_buffers
            sharded["outer_momentum"] = {
                n: shard_like(p, b) for n, p, b in zip(names, self.params, buffers)
            }
        return sharded

    def _split_rounds_and_residuals(self, plain: dict[str, Any]) -> dict[str, Any]:
        """Move the per-shard tensors out of ``plain`` (changed in place: what stays is for the
        worker file); returns them as DTensors, for DCP."""
        sharded: dict[str, Any] = {}
        rounds = zip(self.pending.rounds, plain["pending"], strict=True)
        for index, (pending, saved) in enumerate(rounds):
            # what a state sent is its snapshot: saved once
            pairs = zip(saved["sent"], saved["snapshots"])
            own_sent = [j for j, (sent, snapshot) in enumerate(pairs) if sent is not snapshot]
            due = pending.due
            sharded.setdefault("rounds", {})[str(index)] = {
                "sent": _named(due, saved["sent"], own_sent),
                "snapshots": _named(due, saved["snapshots"]),
                "averages": _named(due, saved["averages"]),
            }
            for key in ROUND_TENSORS:
                saved.pop(key)
            saved["own_sent"] = own_sent
        residuals = (plain.get("pseudo_gradients") or {}).get("residuals")
        if residuals is not None:
            names = self._names()
            sharded["residuals"] = {
                names[int(i)]: shard_like(self.params[int(i)], r) for i, r in residuals.items()
            }
            plain["pseudo_gradients"] = {"residuals_of": sorted(int(i) for i in residuals)}
        return sharded

    def _join_rounds_and_residuals(self, state: dict[str, Any], sharded: dict[str, Any]) -> None:
        """Put the tensors DCP read back into ``state`` as ``load_state_dict`` takes them (local
        shards)."""
        for index, saved in enumerate(state.get("pending", [])):
            names = self.plan.collect(saved["step"]).names
            tensors = sharded["rounds"][str(index)]
            snapshots = [local_shard(tensors["snapshots"][n]) for n in names]
            saved["snapshots"] = snapshots
            saved["averages"] = [local_shard(tensors["averages"][n]) for n in names]
            own = set(saved.pop("own_sent"))
            saved["sent"] = [
                local_shard(tensors["sent"][n]) if j in own else snapshots[j]
                for j, n in enumerate(names)
            ]
        residuals_of = (state.get("pseudo_gradients") or {}).get("residuals_of")
        if residuals_of is not None:
            names = self._names()
            residuals = sharded["residuals"]
            state["pseudo_gradients"] = {
                "residuals": {str(i): local_shard(residuals[names[i]]) for i in residuals_of}
            }

    def _gather_process_bytes(self) -> list[int | None]:
        """Every process of this worker's ``Traffic.process_bytes`` (a collective over the
        worker's shard group)."""
        layout, mine = self.layout, self.traffic.process_bytes
        if layout.num_shards == 1:  # a worker of one process: nothing to gather
            return [mine]
        device = local_shard(self.params[0]).device if self.params else torch.device("cpu")
        value = torch.tensor([-1 if mine is None else mine], dtype=torch.int64, device=device)
        gathered = torch.empty(layout.num_shards, dtype=torch.int64, device=device)
        # all_gather_into_tensor warns (FutureWarning) in this torch; its successor where it exists
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, value, group=layout.shard_group)
        return [None if b < 0 else int(b) for b in gathered.tolist()]


def _process_bytes_of(saved: list[int | None] | None, worker_bytes: int, layout, share: float):
    """This process's bytes from the counts the plain part saved: its own; with another number
    of shards (or none saved: an older checkpoint), its ``share`` of the worker's
    ``worker_bytes``."""
    if saved is not None and len(saved) == layout.num_shards:
        return saved[layout.shard_rank]
    if saved is not None and None in saved:
        return None
    return round(worker_bytes * share)


def _blank(due: SyncRound) -> list[Tensor]:
    """A tensor to read into for each of the round's tensors (its local shard's shape)."""
    return [torch.zeros_like(local_shard(t)) for t in due.tensors]


def _named(due: SyncRound, values: list[Tensor], positions: list[int] | None = None) -> dict:
    """{name of the round's tensor j: values[j] as a DTensor sharded like it}."""
    chosen = range(len(values)) if positions is None else positions
    return {due.names[j]: shard_like(due.tensors[j], values[j]) for j in chosen}
