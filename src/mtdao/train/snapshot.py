"""Saving a whole run to its checkpoint and restoring it exactly (``--resume``)."""

from __future__ import annotations

import torch

from mtdao.train import checkpoint as ckpt
from mtdao.train.config import TrainConfig
from mtdao.train.distributed import barrier
from mtdao.train.setup import Run


def save(run: Run) -> None:
    state = {
        "step": run.step,
        "params": {name: p.detach() for name, p in run.workers.named_parameters()},
        "optimizer": run.optimizer.state_dict(),
        "sync": run.sync.state_dict(),
        "shards": [shard.state_dict() for shard in run.shards],
        "torch_rng": torch.get_rng_state(),
        "wall_time_s": run.wall_time_s,
        "compute_time_s": run.compute_time_s,
        "comm_events": run.comm_events,
        "evals": run.evals,
    }
    meta = {"step": run.step, "config": run.config.to_dict()}
    ckpt.save_checkpoint(
        run.run_dir,
        run.process.rank,
        run.process.world_size,
        state,
        meta,
        lambda: barrier(run.process),
    )


@torch.no_grad()
def resume(run: Run) -> None:
    meta = ckpt.load_meta(run.run_dir)
    saved_config = TrainConfig.from_dict(meta["config"])
    differences = saved_config.differences(run.config)
    if differences:
        raise ckpt.CheckpointError(
            f"--resume: the config differs from the run in {run.run_dir}: " + "; ".join(differences)
        )
    state = ckpt.load_checkpoint(run.run_dir, run.process.rank, run.process.world_size)
    if state["step"] > run.total_steps:
        raise ckpt.CheckpointError(
            f"--resume: the checkpoint is at step {state['step']}, past --steps {run.total_steps}"
        )
    params = dict(run.workers.named_parameters())
    if set(params) != set(state["params"]):
        raise ckpt.CheckpointError("--resume: the checkpoint's parameters do not match the model")
    for name, p in params.items():
        p.copy_(state["params"][name])
    run.optimizer.load_state_dict(state["optimizer"])
    for group in run.optimizer.param_groups:  # keys torch restores as saved; keep ours current
        group["target_omegas"] = tuple(group["target_omegas"])
    run.sync.load_state_dict(state["sync"])
    for shard, saved in zip(run.shards, state["shards"], strict=True):
        shard.load_state_dict(saved)
    torch.set_rng_state(state["torch_rng"])
    run.step = state["step"]
    run.wall_time_s = state["wall_time_s"]
    run.compute_time_s = state["compute_time_s"]
    run.comm_events = [list(e) for e in state["comm_events"]]
    run.evals = list(state["evals"])
