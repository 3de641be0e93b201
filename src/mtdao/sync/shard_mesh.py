"""Workers bigger than one process: the ``workers x shards`` device mesh whose ``"shard"``
dimension FSDP2 shards a worker's model over, and whose ``"replicate"`` dimension the engine
averages each local shard over (:mod:`mtdao.sync.sharded_layout`)."""

from __future__ import annotations

import math

import torch
from torch import nn

MESH_DIMENSIONS = ("replicate", "shard")


def check_shardable(model: nn.Module, shards: int) -> None:
    """Refuse a model that does not shard over ``shards`` processes: FSDP2 cuts each parameter's
    dim 0 into chunks of ceil(rows / S) rows, so a parameter with too few rows (or none: a scalar)
    would leave a process of every worker holding none of it."""
    for name, param in model.named_parameters():
        rows = param.shape[0] if param.dim() > 0 else 0
        chunk = math.ceil(rows / shards)
        if rows == 0 or chunk * (shards - 1) >= rows:
            raise ValueError(
                f"`shards` {shards}: the model does not shard: parameter {name} "
                f"{tuple(param.shape)} has {rows} rows along dim 0, which leaves process "
                f"{shards - 1} of every worker none of it; use fewer shards"
            )


def build_mesh(device: torch.device, workers: int, shards: int):
    """The (replicate, shard) device mesh of all processes: row w holds worker w's processes."""
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        torch.cuda.set_device(device)
    return init_device_mesh(device.type, (workers, shards), mesh_dim_names=MESH_DIMENSIONS)
