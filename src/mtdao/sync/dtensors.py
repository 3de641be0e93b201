"""Sharded tensors (``DTensor``, as FSDP2 makes parameters) seen from the sync engine.

The engine averages a sharded worker's tensors shard by shard: each process holds a slice of every
parameter and optimizer state, and the process holding the same slice in every other worker is its
partner in the average. Everything element-wise (averaging, the outer step, the optimizer update)
therefore runs on the local shard; only sums over a whole worker (norms, finiteness) need the
other shards, through the worker's shard group.

``torch.distributed.tensor`` is looked up in ``sys.modules`` rather than imported: no DTensor can
exist unless the program imported it, and importing it here would add a second to every start-up.
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch import Tensor


def _dtensor_class():
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else None


def local_shard(tensor: Tensor) -> Tensor:
    """This process's shard of a DTensor (a view sharing its storage); any other tensor itself."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor.to_local()
    return tensor


def shard_group_ranks(tensor: Tensor) -> list[int] | None:
    """The global ranks over which ``tensor`` is sharded; None when it is not sharded (a plain
    tensor, a replicated DTensor, or one sharded over a single process)."""
    dtensor = _dtensor_class()
    if dtensor is None or not isinstance(tensor, dtensor):
        return None
    mesh = tensor.device_mesh
    sharded = [dim for dim, placement in enumerate(tensor.placements) if placement.is_shard()]
    sharded = [dim for dim in sharded if mesh.size(dim) > 1]
    if not sharded:
        return None
    if len(sharded) > 1:
        raise ValueError(
            f"a tensor sharded over {len(sharded)} mesh dimensions ({tensor.placements}); the sync "
            "engine averages tensors sharded over one (FSDP2's shard dimension)"
        )
    return dist.get_process_group_ranks(mesh.get_group(sharded[0]))


def shard_numels(tensor: Tensor, num_shards: int) -> list[int]:
    """Elements each of a worker's ``num_shards`` processes holds of ``tensor``: a sharded tensor
    is cut along its one sharded dimension as ``torch.chunk`` cuts it (FSDP2's rule: chunks of
    ceil(n / S) rows, the last ones shorter or empty); one that is not sharded is held whole by
    every process."""
    if shard_group_ranks(tensor) is None:
        return [tensor.numel()] * num_shards
    mesh = tensor.device_mesh  # one mesh dimension shards it (shard_group_ranks checked)
    placements = enumerate(tensor.placements)
    dim = next(p.dim for d, p in placements if p.is_shard() and mesh.size(d) > 1)
    rows = tensor.shape[dim]
    chunk = -(-rows // num_shards)
    per_row = tensor.numel() // rows if rows else 0
    return [max(0, min(chunk, rows - s * chunk)) * per_row for s in range(num_shards)]


def shard_like(param: Tensor, shard: Tensor) -> Tensor:
    """``shard``, this process's part of a tensor shaped and sharded like ``param``, as a DTensor
    sharing its storage (a state received as local shards, made like its parameter again); when
    ``param`` is not a DTensor, ``shard`` itself."""
    dtensor = _dtensor_class()
    if dtensor is None or not isinstance(param, dtensor):
        return shard
    return dtensor.from_local(
        shard,
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


def process_share(params: list[Tensor]) -> float:
    """The fraction of each averaged tensor this process holds and sends: its shard's bytes over
    the whole parameters' (1 unsharded; 1/S when the rows divide evenly). Every state is sharded
    like its parameter and every round carries a kind for all parameters, so the fraction of the
    parameters is the fraction of every round."""
    whole = sum(p.numel() * p.element_size() for p in params)
    mine = sum(local_shard(p).numel() * local_shard(p).element_size() for p in params)
    return mine / whole if whole else 1.0
