"""Workers bigger than one process for a transformers model: the ``--shards`` layout of the
harness (a ``workers x shards`` mesh, FSDP2 over ``"shard"``, the engine over ``"replicate"``),
with the model's own block classes (``_no_split_modules``) as the FSDP2 units."""

from __future__ import annotations

from torch import nn

from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.sync.shard_mesh import build_mesh, check_shardable


def shard_workers(model: nn.Module, workers: int, shards: int) -> ProcessGroupWorkers:
    """The communicator over the replicate groups; shards ``model`` in place: each block of a
    class named in ``model._no_split_modules``, then the rest (embeddings, tied output layer,
    final norm) as one unit."""
    from torch.distributed.fsdp import fully_shard

    check_shardable(model, shards)
    device = next(model.parameters()).device
    mesh = build_mesh(device, workers, shards)
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in block_classes:
            fully_shard(module, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return ProcessGroupWorkers(mesh.get_group("replicate"), shard_group=mesh.get_group("shard"))


def reshard(model: nn.Module) -> None:
    """Free the parameters FSDP2 modules keep gathered after a forward pass (the root module
    does; a training step frees them in its backward). Left gathered after an evaluation, they
    would hold the average the next training step computes with."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
