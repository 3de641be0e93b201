"""The summary of a finished run, written to results.json."""

from __future__ import annotations

from typing import Any

from mtdao.sync.dtensors import process_share
from mtdao.sync.engine import SyncEvent
from mtdao.sync.policy import communication_per_step, full_cycle
from mtdao.train.setup import Run
from mtdao.train.sharding import process_memory
from mtdao.units import format_bytes, format_traffic


def summarize(run: Run) -> dict[str, Any]:
    config, traffic, layout = run.config, run.sync.traffic, run.workers.layout
    final = run.evals[-1] if run.evals else {}
    state_keys = sorted({k for s in run.optimizer.state.values() for k in s})
    steady_steps = run.step - run.step % full_cycle(run.sync.policy, state_keys)
    params = [p for _, p in run.workers.named_parameters()]
    return {
        "method": config.sync.method,
        "optimizer": config.sync.optimizer,
        "workers": config.parallel.workers,
        "shards": config.parallel.shards,
        "sync_period": config.sync.sync_period,
        "sync_policy": run.sync.policy.name,
        "periods": run.sync.policy.periods(),
        "steps": run.step,
        "tokens": run.step * config.tokens_per_step,
        "final_val_loss": final.get("val_loss"),
        "val_ppl": final.get("val_ppl"),
        "bytes_per_worker": traffic.bytes,
        # a sharded worker's processes each send their shards (encoded, when quantized)
        "bytes_per_process": bytes_per_process(run, params),
        "bytes_by_kind": traffic.bytes_by_kind,
        "collectives": traffic.collectives,
        "ddp_bytes_per_worker": traffic.ddp_bytes,
        # None when nothing was sent (one worker): JSON has no infinity
        "comm_reduction_vs_ddp": traffic.reduction_vs_ddp(),
        # the same over whole cycles of the policy: a run's last steps after its final sync send
        # nothing, which the measured figure counts in its favour
        "comm_reduction_steady_state": steady_reduction(run.sync.events, traffic, steady_steps),
        "steady_state_steps": steady_steps,
        "modelled_comm_fraction_of_ddp": communication_per_step(run.sync.policy, state_keys),
        "wall_time_s": run.clock.wall_s(),
        "train_time_s": run.clock.train_s,
        "eval_time_s": run.clock.eval_s,
        "compute_s_per_worker_step": (run.clock.train_s - run.clock.sync_s)
        / max(run.step, 1)
        / layout.local_workers,
        "simulated": not run.process.distributed,
        "parameters": sum(layout.worker_numel(p) for p in params),
        # what this process holds: its shards (sharded), its worker (torchrun), all (simulated)
        "memory_per_process": process_memory(params, run.optimizer),
        "evals": run.evals,
        "comm_events": bytes_per_step(run.sync.events),
        "alignment": run.sync.alignment,
        "skipped_rounds": run.sync.skipped_rounds,
        "settings": {
            "lr": config.lr_schedule.lr,
            "warmup_steps": run.lr_schedule.warmup_steps,
            "betas": list(config.sync.betas or ()),
            "omegas": list(config.sync.omegas or ()),
            "beta2": config.sync.beta2,
            "omega_warmup": config.sync.omega_warmup,
            "beta_warmup": config.sync.beta_warmup,
        },
        "config": config.to_dict(),
    }


def bytes_per_process(run: Run, params: list) -> int | None:
    """What this process sent (None when simulated): counted where a worker is several processes
    (before its first round: none), its worker's bytes where it is one."""
    traffic = run.sync.traffic
    if not run.process.distributed:
        return None
    if traffic.process_bytes is not None:
        return traffic.process_bytes
    return round(traffic.bytes * process_share(params))


def bytes_per_step(events: list[SyncEvent]) -> list[list[int]]:
    """[step, bytes sent per worker] for every step that sent something."""
    sent: dict[int, int] = {}
    for event in events:
        sent[event.step] = sent.get(event.step, 0) + event.bytes
    return [[step, num_bytes] for step, num_bytes in sent.items() if num_bytes > 0]


def steady_reduction(events: list[SyncEvent], traffic, steps: int) -> float | None:
    """DDP's bytes over the bytes sent in the first ``steps`` steps, the final round left out
    (None if none were sent)."""
    sent = sum(event.bytes for event in events if event.step <= steps and not event.final)
    if not sent or traffic.ddp_bytes_per_step is None:
        return None
    return traffic.ddp_bytes_per_step * steps / sent


def traffic_line(results: dict[str, Any]) -> str:
    """One line on what the run sent, against DDP, for the terminal."""
    text = f"traffic: {format_bytes(results['bytes_per_worker'])} sent per worker"
    measured, steady = results["comm_reduction_vs_ddp"], results["comm_reduction_steady_state"]
    if measured is None:
        if results["workers"] == 1:
            return text + " (nothing to average with one worker)"
        if not results["bytes_per_worker"]:  # e.g. --steps below --sync-period
            return text + (
                f" (no round came due in {results['steps']} steps with --sync-period "
                f"{results['sync_period']})"
            )
        return text
    text += ", " + format_traffic(measured, "DDP")
    if steady is not None and format_traffic(steady) != format_traffic(measured):
        tail = results["steps"] - results["steady_state_steps"]
        text += (
            f" ({format_traffic(steady)} in steady state, over whole sync cycles: the last {tail} "
            "steps are a partial cycle whose syncs have not all come due)"
        )
    return text
