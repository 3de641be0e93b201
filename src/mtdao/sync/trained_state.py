"""What training has made of a worker, and the sync engine's state, plain and sharded.

:class:`TrainedState` is one definition for everyone who copies a worker: its parameters, every
optimizer state and the engine's state. A checkpoint saves it (with the run's progress, see
:mod:`mtdao.train.checkpoint.run_state`), and a fault-tolerant replica that heals receives it
from a live peer (:mod:`mtdao.ft.healing`, which adds how it travels).

The engine's state is what its rounds leave (:class:`~mtdao.sync.round_driver.RoundDriver`):
the step, the anchors and outer momentum, the traffic account, the record of every round and the
rounds in flight. Its plain form (:func:`engine_state_dict`) holds them as they are; its sharded
form (:class:`ShardedEngineState`) gives DCP every element-wise tensor as a DTensor named by the
tensor it belongs to (anchors, outer momentum, each delayed round's tensors, every error-feedback
residual, the radial-directional momenta's anchors), so they reshard exactly on a resume with
another number of shards. The rest (step, traffic, record, each round's steps and byte counts,
which parameters have residuals and which states radial anchors, a round's radial-directional
norms) is plain, for the worker's own file; it says how to lay the DTensors out again for DCP.
Bytes sent per process (``Traffic.process_bytes``) differ between a worker's processes only by
their shards' sizes; the plain part keeps every process's count, and a run resumed with another
number of shards counts each process's earlier bytes as its share of the worker's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from mtdao.sync.communicator import RoundNotCommitted
from mtdao.sync.dtensors import local_shard, process_share, shard_like
from mtdao.sync.rounds import RoundsInFlight, SyncEvent, SyncRound

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from mtdao.sync.round_driver import RoundDriver


class Engine(Protocol):
    """What a trained state reads of its engine (:class:`~mtdao.sync.engine.LocalUpdateSync`)."""

    optimizer: Optimizer
    params: list[Tensor]
    param_names: dict[int, str]
    rounds: RoundDriver

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def engine_state_dict(rounds: RoundDriver) -> dict[str, Any]:
    """Everything the engine carries between steps: the step, the anchors and the outer
    momentum (global tensors), the traffic account and the record of every round."""
    plan = rounds.plan
    return {
        "step": rounds.step,
        "anchors": [a.clone() for a in rounds.anchors],
        "outer": rounds.outer.state_dict() if rounds.outer else None,
        "traffic": rounds.traffic.state_dict(),
        "events": [asdict(event) for event in rounds.events],
        "skipped_rounds": list(rounds.skipped_rounds),
        "alignment": list(rounds.alignment),
        "pending": _rounds_in_flight(rounds),
        "in_sync": [[kind, index, step] for (kind, index), step in rounds.in_sync.items()],
        "pseudo_gradients": plan.pseudo_gradients.state_dict() if plan.pseudo_gradients else None,
        "radial": plan.radial.state_dict() if plan.radial.groups else None,
    }


def _rounds_in_flight(rounds: RoundDriver) -> list[dict[str, Any]]:
    """Each round in flight with its averages; one whose transport failed meanwhile is
    discarded (undone) and left out, as it would be when it lands."""
    saved = []
    for in_flight in list(rounds.pending.rounds):
        try:
            saved.append(in_flight.state_dict())
        except RoundNotCommitted:
            rounds.discard(in_flight)
    return saved


def load_engine_state_dict(rounds: RoundDriver, state: dict[str, Any]) -> None:
    """Put back what :func:`engine_state_dict` gave."""
    plan = rounds.plan
    rounds.step = int(state["step"])
    for anchor, saved in zip(rounds.anchors, state["anchors"], strict=True):
        anchor.copy_(saved)
    if rounds.outer is not None:
        rounds.outer.load_state_dict(state["outer"])
    rounds.traffic.load_state_dict(state["traffic"])
    rounds.events = [SyncEvent(**event) for event in state["events"]]
    rounds.skipped_rounds = list(state["skipped_rounds"])
    rounds.alignment = list(state["alignment"])
    rounds.in_sync = {
        (kind, int(index)): int(step) for kind, index, step in state.get("in_sync", [])
    }
    if plan.radial.groups and state.get("radial"):
        plan.radial.load_state_dict(state["radial"])
    rounds.pending = RoundsInFlight()
    for saved in state.get("pending", []):
        restored = plan.restore(saved)
        kinds = list(dict.fromkeys(restored.due.kinds))
        restored.event = SyncEvent(restored.step, kinds, saved["bytes"], saved["collectives"])
        if "committed" not in saved:  # saved when rounds were recorded as they opened
            restored.recorded = True
        elif saved["committed"]:  # settled early (one round at a time): only to apply
            restored.restore_committed()
            checked = restored.checked
            checked.averages = plan.decoded(restored, checked.averages, rounds.anchors)
        rounds.pending.add(restored)
    if plan.pseudo_gradients is not None and state.get("pseudo_gradients"):
        plan.pseudo_gradients.load_state_dict(state["pseudo_gradients"])


ROUND_TENSORS = ("sent", "snapshots", "averages")
GLOBAL_TENSORS = ("anchors", "outer")
"""The keys of the engine's ``state_dict`` that DCP holds whole, sharded like the parameters."""


class ShardedEngineState:
    """The sharded form of the state of one engine's ``rounds`` (see the module docstring)."""

    def __init__(self, rounds: RoundDriver) -> None:
        self.rounds, self.plan, self.workers = rounds, rounds.plan, rounds.layout
        self.params, self.names = rounds.params, rounds.plan.names

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the engine's sharded tensors as DTensors, for DCP; the rest of its state, plain,
        for the worker's file). A collective over the worker's shard group (every process of
        the worker calls it): the plain part holds every process's bytes sent."""
        plain = engine_state_dict(self.rounds)  # (first: a round that failed leaves the rounds)
        for key in GLOBAL_TENSORS:
            plain.pop(key)
        sharded = self._global_tensors()
        sharded.update(self._split_rounds_and_residuals(plain))
        plain["traffic"]["process_bytes"] = self._gather_process_bytes(
            plain["traffic"]["process_bytes"]
        )
        return sharded, plain

    def layout(self, plain: dict[str, Any] | None = None) -> dict[str, Any]:
        """DTensors shaped as :meth:`state_dict` saved them, sharded as this engine shards, for
        DCP to read into: the anchors and outer momentum (the engine's own tensors), and, from
        ``plain`` (that call's plain part, as the worker file holds it), the rounds in flight
        and the residuals. Without ``plain``: the tensors every such engine holds."""
        sharded = self._global_tensors()
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

    def load_state_dict(self, sharded: dict[str, Any], plain: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave: ``sharded``, the DTensors DCP read into (laid
        out by :meth:`layout` of ``plain``), and ``plain`` (left unchanged)."""
        state = copy.deepcopy(plain)
        self._join_rounds_and_residuals(state, sharded)
        traffic = state["traffic"]
        traffic["process_bytes"] = _process_bytes_of(
            traffic.get("process_bytes"), traffic["bytes"], self.workers, process_share(self.params)
        )
        state["anchors"] = [local_shard(sharded["anchors"][n]) for n in self.names]
        state["outer"] = None
        if self.rounds.outer is not None:
            momentum = sharded["outer_momentum"]
            state["outer"] = {"momentum_buffers": [local_shard(momentum[n]) for n in self.names]}
        load_engine_state_dict(self.rounds, state)

    # -- the parts ----------------------------------------------------------------------------

    def _global_tensors(self) -> dict[str, Any]:
        """The anchors and the outer momentum: the engine's own tensors, as DTensors by name."""
        names, anchors, outer = self.names, self.rounds.anchors, self.rounds.outer
        sharded: dict[str, Any] = {
            "anchors": {n: shard_like(p, a) for n, p, a in zip(names, self.params, anchors)}
        }
        if outer is not None:
            buffers = outer.momentum_buffers
            sharded["outer_momentum"] = {
                n: shard_like(p, b) for n, p, b in zip(names, self.params, buffers)
            }
        return sharded

    def _split_rounds_and_residuals(self, plain: dict[str, Any]) -> dict[str, Any]:
        """Move the per-shard tensors out of ``plain`` (changed in place: what stays is for the
        worker file); returns them as DTensors, for DCP."""
        sharded: dict[str, Any] = {}
        rounds = zip(self.rounds.pending.rounds, plain["pending"], strict=True)
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
        layout = self.workers
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


class TrainedState:
    """The trained part of a worker: ``named_params`` (default: the engine's parameters under
    their optimizer names), ``sync.optimizer`` and ``sync``; ``module`` (for the sharded form
    only) is the model the parameters belong to."""

    def __init__(
        self,
        sync: Engine,
        named_params: list[tuple[str, Tensor]] | None = None,
        module: nn.Module | None = None,
    ) -> None:
        self.sync = sync
        if named_params is None:
            named_params = [(sync.param_names[id(p)], p) for p in sync.params]
        names = [name for name, _ in named_params]
        shared = sorted({name for name in names if names.count(name) > 1})
        if shared:  # keyed by name, one would overwrite the other
            raise ValueError(f"parameters share the name {shared[0]!r}: name each one apart")
        self.named_params = named_params
        self.module = module

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's shape, as this process holds it (its local shard)."""
        return {name: tuple(local_shard(p).shape) for name, p in self.named_params}

    def state_dict(self) -> dict[str, Any]:
        """The parameters by name (this process's shards), the optimizer's and the engine's
        ``state_dict``: tensors are the live ones or the engine's copies, not snapshots."""
        return {
            "params": {name: local_shard(p).detach() for name, p in self.named_params},
            "optimizer": self.sync.optimizer.state_dict(),
            "sync": self.sync.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = state["params"]
        for name, p in self.named_params:
            local_shard(p).copy_(params[name])
        self.sync.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(state["sync"])

    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the DCP state dict: ``model``, ``optimizer`` and the engine's DTensors; the engine's
        plain rest). A collective over the worker's shard group."""
        engine, plain = ShardedEngineState(self.sync.rounds).state_dict()
        model, optimizer = self._model_and_optimizer()
        return {"model": model, "optimizer": optimizer, "engine": engine}, plain

    def sharded_layout(self, plain: dict[str, Any] | None = None) -> dict[str, Any]:
        """DTensors for DCP to read into, laid out as :meth:`sharded_state_dict` saved them
        (``plain``: its plain part; without it, the tensors every such worker holds). Makes the
        optimizer's states if it has none yet (DCP's ``get_state_dict`` does)."""
        model, optimizer = self._model_and_optimizer()  # (first: the rounds' layout needs states)
        engine = ShardedEngineState(self.sync.rounds).layout(plain)
        return {"model": model, "optimizer": optimizer, "engine": engine}

    @torch.no_grad()
    def load_sharded_state_dict(self, sharded: dict[str, Any], plain: dict[str, Any]) -> None:
        """Load what DCP read into :meth:`sharded_layout`'s tensors, with its plain part."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self._module(),
            self.sync.optimizer,
            model_state_dict=sharded["model"],
            optim_state_dict=sharded["optimizer"],
        )
        ShardedEngineState(self.sync.rounds).load_state_dict(sharded["engine"], plain)

    def _model_and_optimizer(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self._module(), self.sync.optimizer)

    def _module(self) -> nn.Module:
        if self.module is None:
            raise ValueError("the sharded form of a trained state needs the module it trains")
        return self.module
