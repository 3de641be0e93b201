"""Saving a whole run to its checkpoint and restoring it exactly (``--resume``)."""

from __future__ import annotations

import torch

from mtdao.train import checkpoint as ckpt
from mtdao.train.config import TrainConfig, resolve
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
        "clock": run.clock.state_dict(),
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


def saved_config(meta: dict) -> TrainConfig:
    """The resolved config a checkpoint was written with (one written with unset fields, as
    older versions wrote them, resolves to today's defaults)."""
    try:
        return resolve(TrainConfig.from_dict(meta["config"]))
    except (KeyError, TypeError, ValueError) as error:
        raise ckpt.CheckpointError(
            f"--resume: the checkpoint's config is unusable: {error}"
        ) from None


@torch.no_grad()
def resume(run: Run) -> None:
    meta = ckpt.load_meta(run.run_dir)
    differences = saved_config(meta).differences(run.config)
    if differences:
        raise ckpt.CheckpointError(
            f"--resume: the config differs from the run in {run.run_dir}: " + "; ".join(differences)
        )
    state = ckpt.load_checkpoint(run.run_dir, run.process.rank, run.process.world_size)
    if "clock" not in state or "events" not in state["sync"]:
        raise ckpt.CheckpointError(
            f"--resume: the checkpoint in {run.run_dir} was written by an older version of mtdao "
            "(no record of its sync rounds); start a new run"
        )
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
    run.sync.load_state_dict(state["sync"])
    for shard, saved in zip(run.shards, state["shards"], strict=True):
        shard.load_state_dict(saved)
    torch.set_rng_state(state["torch_rng"])
    run.clock.load_state_dict(state["clock"])
    run.evals = list(state["evals"])
