"""The numbers behind ``mtdao slow-link``'s report: pure functions of the measured rows.

A row is one method at one link rate: what :func:`mtdao.experiments.slow_link.run.collect_run` read
from the run directory plus the link and process measurements. :func:`compare_to_ddp` adds the
DDP-relative figures to every row of a rate that has a DDP row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

KIND, SCHEMA = "slow-link", 1  # results.json (see mtdao.experiments.common.results)


def time_to_loss(evals: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """Wall-clock at which the validation loss first reaches ``target`` (interpolated linearly
    from the evaluation before; None when never reached)."""
    previous = {"wall_time_s": 0.0, "val_loss": math.inf}
    for record in evals:
        if record["val_loss"] <= target:
            if not math.isfinite(previous["val_loss"]):
                return record["wall_time_s"]
            fraction = (previous["val_loss"] - target) / (previous["val_loss"] - record["val_loss"])
            return previous["wall_time_s"] + fraction * (
                record["wall_time_s"] - previous["wall_time_s"]
            )
        previous = record
    return None


def wall_at_step(progress: Sequence[Sequence[float]], step: int) -> float | None:
    """Wall-clock after ``step`` steps, interpolated between (step, wall_time_s) metric lines;
    None past the end."""
    previous = (0, 0.0)
    for point in progress:
        if point[0] >= step:
            fraction = (step - previous[0]) / max(point[0] - previous[0], 1)
            return previous[1] + fraction * (point[1] - previous[1])
        previous = point
    return None


def versus_ddp(row: Mapping[str, Any], ddp: Mapping[str, Any]) -> dict[str, Any]:
    """One row's figures against DDP's row at the same rate: time to DDP's final loss and the
    speedup there, wall-clock and loss at DDP's token count and the iso-token speedup."""
    target = ddp["final_val_loss"]
    reached = time_to_loss(row["evals"], target)
    ddp_time = time_to_loss(ddp["evals"], target)
    iso_wall = wall_at_step(row["progress"], ddp["steps"])
    iso_loss = next((e["val_loss"] for e in row["evals"] if e["step"] == ddp["steps"]), None)
    return {
        "target_val_loss": target,
        "time_to_ddp_loss_s": reached,
        "speedup_to_ddp_loss": ddp_time / reached if reached else None,
        "iso_token_wall_s": iso_wall,
        "iso_token_val_loss": iso_loss,
        "iso_token_speedup": ddp["wall_time_s"] / iso_wall if iso_wall else None,
    }


def compare_to_ddp(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows with :func:`versus_ddp` added where their rate has a DDP row."""
    compared = []
    for row in rows:
        ddp = next(
            (r for r in rows if r["rate_mbit"] == row["rate_mbit"] and r["method"] == "ddp"), None
        )
        compared.append({**row, **versus_ddp(row, ddp)} if ddp is not None else dict(row))
    return compared
