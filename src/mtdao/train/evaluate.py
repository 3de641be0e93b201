"""Validation loss of the global (averaged) model on a fixed set of held-out batches."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mtdao.sync.engine import NonFiniteError

if TYPE_CHECKING:
    from mtdao.train.metrics import MetricsLog
    from mtdao.train.setup import Run

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, device: torch.device) -> float:
    """Mean token cross-entropy over ``batches`` of (inputs, targets)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in batches:
        logits = model(inputs.to(device))
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            targets.to(device).reshape(-1),
            reduction="sum",
        )
        total += loss.item()
        count += targets.numel()
    model.train(was_training)
    return total / max(count, 1)


def run_evaluation(run: Run, log: MetricsLog) -> float:
    """Evaluate the run's global model now; the record goes to ``run.evals`` and the log.

    With ``--on-non-finite skip`` a worker left out of its last round holds NaN/inf until its next
    one; the global model is then the average of the other workers (the record lists the workers
    left out, and the log says so)."""
    started = time.perf_counter()
    excluded = non_finite_workers(run) if run.config.sync.on_non_finite == "skip" else []
    if len(excluded) == run.workers.layout.num_workers:
        raise NonFiniteError(
            f"the parameters are NaN/inf at step {run.step} on every worker; none is left to "
            "average (lower --lr)"
        )
    model = run.workers.global_model(excluded)
    with run.workers.autocast():
        val_loss = evaluate(model, run.val_batches, run.device)
    if not math.isfinite(val_loss) and run.config.sync.on_non_finite == "raise":
        raise NonFiniteError(
            f"validation loss of the averaged model is NaN/inf at step {run.step}; lower --lr"
        )
    run.clock.eval_s += time.perf_counter() - started
    record = {
        "step": run.step,
        "tokens": run.step * run.config.tokens_per_step,
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 50.0)),
        "train_time_s": run.clock.train_s,
        "wall_time_s": run.clock.wall_s(),
        "bytes_per_worker": run.sync.traffic.bytes,
    }
    if excluded:
        record["excluded_workers"] = excluded
    if excluded and run.is_main:
        logger.warning(
            "step %d: evaluating the average of the workers but %s, which hold NaN/inf until "
            "their next round",
            run.step,
            excluded,
        )
    for key in ("cosine", "drift"):
        if run.sync.alignment:
            values = run.sync.alignment[-1][key]
            record[f"alignment_{key}_mean"] = sum(values) / len(values)
    run.evals.append(record)
    log.write(record)
    return val_loss


def non_finite_workers(run: Run) -> list[int]:
    """The workers whose parameters hold NaN/inf (every process takes part: a small gather)."""
    params = [p for _, p in run.workers.named_parameters()]
    return sorted(run.workers.layout.first_non_finite(params))
