"""The sync engine's state as a sharded worker checkpoints it: DTensors for DCP, the rest plain.

A process of a sharded worker holds its own shard of everything element-wise the engine keeps:
the anchors and the outer momentum, each delayed round's tensors (what it sent, its snapshots,
the averages), every error-feedback residual and the radial-directional momenta's anchors. These go to DCP like the parameters, as DTensors
named by the tensor they belong to: DCP records their global shapes, so they reshard exactly on a
resume with another number of shards (each value is element-wise, whatever block it was quantized
in). The rest (the step, the traffic account, the record of rounds, each round's steps and byte
counts, which parameters have residuals, which states have radial anchors, and a round's
radial-directional norms: a few scalars per tensor, the same in every process of a worker, kept
as numbers) is plain and goes to the worker's own file; it says how to lay the same DTensors out
again before DCP reads into them.

Bytes sent per process (``Traffic.process_bytes``) differ between a worker's processes only by
their shards' sizes; the plain part keeps every process's count. A run resumed with another number
of shards counts each process's earlier bytes as its share of the worker's.

The engine (:class:`~mtdao.sync.engine.LocalUpdateSync`) owns a :class:`ShardedEngineState` and
hands it its state, its anchors, outer step and rounds in flight
(``sharded_state_dict``, ``sharded_layout``, ``load_sharded_state_dict``), so that whoever
checkpoints the engine asks it for its state and never walks its rounds, plan or residuals.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mtdao.sync.dtensors import local_shard, process_share, shard_like
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.outer import NesterovOuterStep
from mtdao.sync.rounds import Round, SyncRound

if TYPE_CHECKING:
    from mtdao.sync.round_plan import RoundPlan

ROUND_TENSORS = ("sent", "snapshots", "averages")
GLOBAL_TENSORS = ("anchors", "outer")
"""The keys of the engine's ``state_dict`` that DCP holds whole, sharded like the parameters."""


class ShardedEngineState:
    """The sharded form of one engine's state: ``params`` named by ``names``, the rounds that
    ``plan`` forms, each process's shards as ``layout`` lays them out."""

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        plan: RoundPlan,
        layout: WorkerLayout,
    ) -> None:
        self.params, self.names = list(params), list(names)
        self.plan, self.layout = plan, layout

    def split(
        self,
        plain: dict[str, Any],
        rounds: Sequence[Round],
        anchors: Sequence[Tensor],
        outer: NesterovOuterStep | None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the engine's sharded tensors as DTensors, for DCP; the rest of its ``state_dict``
        ``plain`` (taken over), for the worker's file) given its ``rounds`` in flight (those of
        ``plain``), ``anchors`` and ``outer`` step. A collective over the worker's shard group
        (every process of the worker calls it): the plain part holds every process's bytes
        sent."""
        for key in GLOBAL_TENSORS:
            plain.pop(key)
        sharded = self._global_tensors(anchors, outer)
        sharded.update(self._split_rounds_and_residuals(plain, rounds))
        plain["traffic"]["process_bytes"] = self._gather_process_bytes(
            plain["traffic"]["process_bytes"]
        )
        return sharded, plain

    def layout_of(
        self,
        anchors: Sequence[Tensor],
        outer: NesterovOuterStep | None,
        plain: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """DTensors shaped as :meth:`split` saved them, sharded as this engine shards, for DCP
        to read into: the ``anchors`` and ``outer`` momentum (the engine's own tensors), and,
        from ``plain`` (that call's plain part, as the worker file holds it), the rounds in
        flight and the residuals. Without ``plain``: the tensors every such engine holds."""
        sharded = self._global_tensors(anchors, outer)
        for index, saved in enumerate((plain or {}).get("pending", [])):
            due = self.plan.collect(saved["step"])
            sharded.setdefault("rounds", {})[str(index)] = {
                "sent": _named(due, _blank(due), saved["own_sent"]),
                "snapshots": _named(due, _blank(due)),
                "averages": _named(due, _blank(due)),
            }
        for key, owner in ((plain or {}).get("radial") or {}).get("anchors_of", []):
            blank = shard_like(
                self.params[owner], torch.zeros_like(local_shard(self.params[owner]))
            )
            sharded.setdefault("radial_anchors", {})[f"{key} of {self.names[owner]}"] = blank
        residuals_of = ((plain or {}).get("pseudo_gradients") or {}).get("residuals_of")
        if residuals_of is not None:
            sharded["residuals"] = {
                self.names[i]: shard_like(
                    self.params[i], torch.zeros_like(local_shard(self.params[i]))
                )
                for i in residuals_of
            }
        return sharded

    def join(
        self, sharded: dict[str, Any], plain: dict[str, Any], has_outer: bool
    ) -> dict[str, Any]:
        """The engine's ``state_dict`` from what :meth:`split` gave: ``sharded``, the DTensors
        DCP read into (laid out by :meth:`layout_of` of ``plain``), and ``plain`` (left
        unchanged); ``has_outer``: whether the engine has an outer step."""
        state = copy.deepcopy(plain)
        self._join_rounds_and_residuals(state, sharded)
        traffic = state["traffic"]
        traffic["process_bytes"] = _process_bytes_of(
            traffic.get("process_bytes"), traffic["bytes"], self.layout, process_share(self.params)
        )
        state["anchors"] = [local_shard(sharded["anchors"][n]) for n in self.names]
        state["outer"] = None
        if has_outer:
            momentum = sharded["outer_momentum"]
            state["outer"] = {"momentum_buffers": [local_shard(momentum[n]) for n in self.names]}
        return state

    # -- the parts ----------------------------------------------------------------------------

    def _global_tensors(
        self, anchors: Sequence[Tensor], outer: NesterovOuterStep | None
    ) -> dict[str, Any]:
        """The anchors and the outer momentum: the engine's own tensors, as DTensors by name."""
        names = self.names
        sharded: dict[str, Any] = {
            "anchors": {n: shard_like(p, a) for n, p, a in zip(names, self.params, anchors)}
        }
        if outer is not None:
            buffers = outer.momentum_buffers
            sharded["outer_momentum"] = {
                n: shard_like(p, b) for n, p, b in zip(names, self.params, buffers)
            }
        return sharded

    def _split_rounds_and_residuals(
        self, plain: dict[str, Any], rounds: Sequence[Round]
    ) -> dict[str, Any]:
        """Move the per-shard tensors out of ``plain`` (changed in place: what stays is for the
        worker file); returns them as DTensors, for DCP."""
        sharded: dict[str, Any] = {}
        rounds = zip(rounds, plain["pending"], strict=True)
        for index, (pending, saved) in enumerate(rounds):
            # what a state sent is its snapshot: saved once
            pairs = zip(saved["sent"], saved["snapshots"])
            own_sent = [j for j, (sent, snapshot) in enumerate(pairs) if sent is not snapshot]
            due = pending.due
            count = len(due.tensors)  # radial-directional norms follow the round's tensors
            if len(saved["averages"]) > count:
                saved["norms"] = {key: _numbers(saved[key][count:]) for key in ("sent", "averages")}
            sharded.setdefault("rounds", {})[str(index)] = {
                "sent": _named(due, saved["sent"], own_sent),
                "snapshots": _named(due, saved["snapshots"]),
                "averages": _named(due, saved["averages"][:count]),
            }
            for key in ROUND_TENSORS:
                saved.pop(key)
            saved["own_sent"] = own_sent
        residuals = (plain.get("pseudo_gradients") or {}).get("residuals")
        if residuals is not None:
            names = self.names
            sharded["residuals"] = {
                names[int(i)]: shard_like(self.params[int(i)], r) for i, r in residuals.items()
            }
            plain["pseudo_gradients"] = {"residuals_of": sorted(int(i) for i in residuals)}
        radial_anchors = (plain.get("radial") or {}).get("state_anchors")
        if radial_anchors:
            sharded["radial_anchors"] = {
                f"{key} of {self.names[owner]}": shard_like(self.params[owner], anchor)
                for key, owner, anchor in radial_anchors
            }
            plain["radial"] = {"anchors_of": [[key, owner] for key, owner, _ in radial_anchors]}
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
            norms = saved.pop("norms", {})
            device = snapshots[0].device
            for key in ("sent", "averages"):
                saved[key] += [_tensor(numbers, device) for numbers in norms.get(key, [])]
        anchors_of = (state.get("radial") or {}).get("anchors_of")
        if anchors_of is not None:
            anchors = sharded["radial_anchors"]
            state["radial"] = {
                "state_anchors": [
                    [key, owner, local_shard(anchors[f"{key} of {self.names[owner]}"])]
                    for key, owner in anchors_of
                ]
            }
        residuals_of = (state.get("pseudo_gradients") or {}).get("residuals_of")
        if residuals_of is not None:
            names = self.names
            residuals = sharded["residuals"]
            state["pseudo_gradients"] = {
                "residuals": {str(i): local_shard(residuals[names[i]]) for i in residuals_of}
            }

    def _gather_process_bytes(self, mine: int | None) -> list[int | None]:
        """Every process of this worker's ``Traffic.process_bytes`` (``mine`` here; a
        collective over the worker's shard group)."""
        layout = self.layout
        if layout.num_shards == 1:  # a worker of one process: nothing to gather
            return [mine]
        device = local_shard(self.params[0]).device if self.params else torch.device("cpu")
        value = torch.tensor([-1 if mine is None else mine], dtype=torch.int64, device=device)
        gathered = layout.gather_over_shards(value).reshape(-1)
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


def _numbers(tensors: Sequence[Tensor]) -> list[dict[str, Any]]:
    """Small tensors as plain numbers (exact: a float64 holds any float32 or float64)."""
    return [{"dtype": str(t.dtype).removeprefix("torch."), "values": t.tolist()} for t in tensors]


def _tensor(numbers: dict[str, Any], device: torch.device) -> Tensor:
    return torch.tensor(numbers["values"], dtype=getattr(torch, numbers["dtype"]), device=device)


def _blank(due: SyncRound) -> list[Tensor]:
    """A tensor to read into for each of the round's tensors (its local shard's shape)."""
    return [torch.zeros_like(local_shard(t)) for t in due.tensors]


def _named(due: SyncRound, values: list[Tensor], positions: list[int] | None = None) -> dict:
    """{name of the round's tensor j: values[j] as a DTensor sharded like it}."""
    chosen = range(len(values)) if positions is None else positions
    return {due.names[j]: shard_like(due.tensors[j], values[j]) for j in chosen}
