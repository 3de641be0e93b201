"""The summary of a finished run, written to results.json."""

from __future__ import annotations

from typing import Any

from mtdao.sync.policy import communication_per_step
from mtdao.train.setup import Run


def ddp_bytes_per_step(run: Run) -> int:
    """What DDP sends per worker per step: one gradient of every parameter."""
    comm = run.sync.communicator
    return sum(comm.bytes_per_worker(p) for _, p in run.workers.named_parameters())


def summarize(run: Run) -> dict[str, Any]:
    config = run.config
    traffic = run.sync.communicator.traffic
    ddp_bytes = ddp_bytes_per_step(run) * run.step
    final = run.evals[-1] if run.evals else {}
    state_keys = sorted({k for s in run.optimizer.state.values() for k in s})
    return {
        "method": config.method,
        "optimizer": config.optimizer,
        "workers": config.workers,
        "sync_period": config.sync_period,
        "sync_policy": run.sync.policy.name,
        "periods": run.sync.policy.periods(),
        "steps": run.step,
        "tokens": run.step * config.tokens_per_step,
        "final_val_loss": final.get("val_loss"),
        "val_ppl": final.get("val_ppl"),
        "bytes_per_worker": traffic.bytes,
        "bytes_by_kind": traffic.bytes_by_kind,
        "collectives": traffic.collectives,
        "ddp_bytes_per_worker": ddp_bytes,
        # None when nothing was sent (one worker): JSON has no infinity
        "comm_reduction_vs_ddp": ddp_bytes / traffic.bytes if traffic.bytes else None,
        "modelled_comm_fraction_of_ddp": communication_per_step(run.sync.policy, state_keys),
        "wall_time_s": run.wall_time_s,
        "compute_s_per_worker_step": run.compute_time_s
        / max(run.step, 1)
        / (1 if run.process.distributed else config.workers),
        "simulated": not run.process.distributed,
        "parameters": sum(
            p[0].numel() if not run.process.distributed else p.numel()
            for _, p in run.workers.named_parameters()
        ),
        "evals": run.evals,
        "comm_events": run.comm_events,
        "alignment": run.sync.alignment,
        "skipped_rounds": run.sync.skipped_rounds,
        "settings": {
            "lr": run.optimizer.param_groups[0]["initial_lr"],
            "betas": list(run.optimizer.param_groups[0]["betas"]),
            "omegas": list(run.optimizer.param_groups[0]["target_omegas"]),
            "beta2": run.optimizer.param_groups[0].get("beta2"),
        },
        "config": config.to_dict(),
    }
