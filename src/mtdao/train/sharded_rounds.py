"""The sync engine's per-shard state in a sharded checkpoint: rounds in flight, error-feedback
residuals and the bytes each process sent.

Each process of a sharded worker holds its own shard of a delayed round (what it sent, its
snapshots, the averages) and of every error-feedback residual, so these go to DCP like the
parameters: as DTensors under the worker's key, named by the tensor they belong to. DCP records
their global shapes, so they reshard exactly on a resume with another number of shards (each value
is element-wise, whatever block it was quantized in). The worker file keeps the rest of each
round (its steps and byte counts) and which parameters have residuals, so that the same DTensors
can be laid out again before DCP reads into them.

Bytes sent per process (``Traffic.process_bytes``) differ between a worker's processes only by
their shards' sizes; the worker file keeps every process's count. A run resumed with another number
of shards counts each process's earlier bytes as its share of the worker's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.sync.dtensors import local_shard, shard_like
from mtdao.sync.engine import LocalUpdateSync
from mtdao.sync.rounds import SyncRound

ROUND_TENSORS = ("sent", "snapshots", "averages")


def split(sync: LocalUpdateSync, engine: dict[str, Any]) -> dict[str, Any]:
    """Move the per-shard tensors out of ``engine`` (the engine's state dict, changed in place:
    what stays is for the worker file); returns them as DTensors, for DCP."""
    sharded: dict[str, Any] = {}
    rounds = zip(sync.pending.rounds, engine["pending"], strict=True)
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
    residuals = (engine.get("pseudo_gradients") or {}).get("residuals")
    if residuals is not None:
        names = [sync.param_names[id(p)] for p in sync.params]
        sharded["residuals"] = {
            names[int(i)]: shard_like(sync.params[int(i)], r) for i, r in residuals.items()
        }
        engine["pseudo_gradients"] = {"residuals_of": sorted(int(i) for i in residuals)}
    return sharded


def layout(sync: LocalUpdateSync, engine: dict[str, Any]) -> dict[str, Any]:
    """DTensors shaped as :func:`split` saved them, from the worker file's ``engine``, for DCP
    to read into (sharded as this run shards)."""
    sharded: dict[str, Any] = {}
    for index, saved in enumerate(engine.get("pending", [])):
        due = sync.plan.collect(saved["step"])
        sharded.setdefault("rounds", {})[str(index)] = {
            "sent": _named(due, _blank(due), saved["own_sent"]),
            "snapshots": _named(due, _blank(due)),
            "averages": _named(due, _blank(due)),
        }
    residuals_of = (engine.get("pseudo_gradients") or {}).get("residuals_of")
    if residuals_of is not None:
        names = [sync.param_names[id(p)] for p in sync.params]
        sharded["residuals"] = {
            names[i]: shard_like(sync.params[i], torch.zeros_like(local_shard(sync.params[i])))
            for i in residuals_of
        }
    return sharded


def join(sync: LocalUpdateSync, engine: dict[str, Any], sharded: dict[str, Any]) -> None:
    """Put the tensors DCP read (``sharded``, laid out by :func:`layout`) back into ``engine``,
    as the engine's ``load_state_dict`` takes them (local shards)."""
    for index, saved in enumerate(engine.get("pending", [])):
        names = sync.plan.collect(saved["step"]).names
        tensors = sharded["rounds"][str(index)]
        snapshots = [local_shard(tensors["snapshots"][n]) for n in names]
        saved["snapshots"] = snapshots
        saved["averages"] = [local_shard(tensors["averages"][n]) for n in names]
        own = set(saved.pop("own_sent"))
        saved["sent"] = [
            local_shard(tensors["sent"][n]) if j in own else snapshots[j]
            for j, n in enumerate(names)
        ]
    residuals_of = (engine.get("pseudo_gradients") or {}).get("residuals_of")
    if residuals_of is not None:
        names = [sync.param_names[id(p)] for p in sync.params]
        residuals = sharded["residuals"]
        engine["pseudo_gradients"] = {
            "residuals": {str(i): local_shard(residuals[names[i]]) for i in residuals_of}
        }


def _blank(due: SyncRound) -> list[Tensor]:
    """A tensor to read into for each of the round's tensors (its local shard's shape)."""
    return [torch.zeros_like(local_shard(t)) for t in due.tensors]


def _named(due: SyncRound, values: list[Tensor], positions: list[int] | None = None) -> dict:
    """{name of the round's tensor j: values[j] as a DTensor sharded like it}."""
    chosen = range(len(values)) if positions is None else positions
    return {due.names[j]: shard_like(due.tensors[j], values[j]) for j in chosen}


# -- bytes per process ----------------------------------------------------------------------------


def gather_process_bytes(sync: LocalUpdateSync) -> list[int | None]:
    """Every process of this worker's ``Traffic.process_bytes`` (a collective over the worker's
    shard group)."""
    layout = sync.layout
    device = local_shard(sync.params[0]).device if sync.params else torch.device("cpu")
    mine = sync.traffic.process_bytes
    value = torch.tensor([-1 if mine is None else mine], dtype=torch.int64, device=device)
    gathered = torch.empty(layout.num_shards, dtype=torch.int64, device=device)
    # all_gather_into_tensor warns (FutureWarning) in this torch; its successor where it exists
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, value, group=layout.shard_group)
    return [None if b < 0 else int(b) for b in gathered.tolist()]


def process_bytes_of(saved: list[int | None] | None, worker_bytes: int, layout, share: float):
    """This process's bytes from the counts :func:`gather_process_bytes` saved: its own; with
    another number of shards (or none saved: an older checkpoint), its ``share`` of the worker's
    ``worker_bytes``."""
    if saved is not None and len(saved) == layout.num_shards:
        return saved[layout.shard_rank]
    if saved is not None and None in saved:
        return None
    return round(worker_bytes * share)
