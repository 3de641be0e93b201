"""Digests of a replica's state after a round, which a fault drill compares across replicas: of
everything they must agree on (:func:`state_digest`), and of what they share even while delayed
rounds leave each its own local progress (:func:`global_digest`)."""

from __future__ import annotations


def state_digest(run) -> str:
    """A checksum of everything replicas must agree on after a round: the parameters, every
    optimizer state and the engine's step, anchors and outer momentum (of a sharded replica,
    this process's shards)."""
    import torch
    import xxhash

    from mtdao.sync.dtensors import local_shard

    digest = xxhash.xxh3_64()
    tensors = [p.detach() for p in run.sync.params]
    for p in run.sync.params:
        for key, value in sorted(run.optimizer.state.get(p, {}).items()):
            digest.update(key.encode())
            tensors.append(value if torch.is_tensor(value) else torch.tensor(value))
    engine = run.sync.state_dict()
    digest.update(str(engine["step"]).encode())
    tensors += engine["anchors"]
    if engine["outer"] is not None:
        tensors += engine["outer"]["momentum_buffers"]
    for tensor in tensors:
        shard = local_shard(tensor).detach().cpu().contiguous()
        digest.update(shard.reshape(-1).numpy().tobytes())
    return digest.hexdigest()


def global_digest(run) -> str:
    """A checksum of what every replica holds alike after a round even when rounds are delayed
    (each then keeps its own local progress): the engine's step, anchors, outer momentum and
    record, and the averages of the committed rounds still to apply."""
    import torch
    import xxhash

    from mtdao.sync.dtensors import local_shard

    digest = xxhash.xxh3_64()
    engine = run.sync.rounds
    digest.update(str([engine.step, *map(str, engine.events)]).encode())
    tensors = list(engine.anchors)
    if engine.outer is not None:
        tensors += engine.outer.state_dict()["momentum_buffers"]
    for pending in engine.pending.rounds:
        if pending.checked is not None:
            digest.update(str(pending.step).encode())
            tensors += pending.checked.averages
    for tensor in tensors:
        shard = local_shard(tensor).detach().cpu().contiguous()
        digest.update(shard.reshape(-1).to(torch.float64).numpy().tobytes())
    return digest.hexdigest()
