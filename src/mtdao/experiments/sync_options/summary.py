"""The numbers behind ``mtdao sync-options``' report: pure functions of the runs' results.

Per setting and option: the final validation loss over seeds against the float32 blocking round
(the significance rule of :mod:`mtdao.experiments.common.formatting`), the traffic against DDP (the harness's account:
encoded payloads, scales and padding included) and the largest number of bytes one step sends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mtdao.experiments.common.formatting import compare_losses, stats

KIND, SCHEMA = "sync-options", 1  # results.json (see mtdao.experiments.common.results)


def peak_step_bytes(results: Mapping[str, Any]) -> int:
    """The most bytes one worker sent at any one step."""
    sent: dict[int, int] = {}
    for event in results.get("comm_events", []):
        step, num_bytes = (event["step"], event["bytes"]) if isinstance(event, dict) else event
        sent[step] = sent.get(step, 0) + num_bytes
    return max(sent.values(), default=0)


def option_row(
    runs: Sequence[Mapping[str, Any]], reference: Mapping[str, Any] | None
) -> dict[str, Any]:
    """One option at one setting, from its runs (one per seed)."""
    loss = stats(r.get("final_val_loss") for r in runs)
    row: dict[str, Any] = {
        "val_loss": loss,
        "reduction_vs_ddp": runs[0]["comm_reduction_vs_ddp"] if runs else None,
        "steady_reduction_vs_ddp": runs[0].get("comm_reduction_steady_state") if runs else None,
        "bytes_per_worker": runs[0]["bytes_per_worker"] if runs else None,
        "peak_step_bytes": peak_step_bytes(runs[0]) if runs else None,
    }
    if reference is not None and loss is not None and reference["val_loss"] is not None:
        row["difference"] = loss["mean"] - reference["val_loss"]["mean"]
        # one seed has no spread: the rule cannot tell a difference from seed noise
        enough = loss["n"] > 1 and reference["val_loss"]["n"] > 1
        row["versus_reference"] = compare_losses(loss, reference["val_loss"]) if enough else None
    return row


def paired_difference(
    results: Mapping[str, Mapping[str, Any]],
    setting: str,
    option: str,
    reference: str,
    seeds: Sequence[int],
) -> dict[str, Any] | None:
    """The option's final loss minus the reference's, seed by seed (the same seed gives both the
    same initialization and data): :func:`stats` of the differences over the seeds both ran."""
    differences = []
    for seed in seeds:
        run = results.get(f"{setting}-{option}-seed{seed}")
        base = results.get(f"{setting}-{reference}-seed{seed}")
        if run is not None and base is not None:
            differences.append(run.get("final_val_loss") - base.get("final_val_loss"))
    return stats(differences)


def summarize(
    results: Mapping[str, Mapping[str, Any]],
    *,
    options: Mapping[str, str],
    settings: Sequence[str],
    seeds: Sequence[int],
    command: str,
    failures: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``results`` by run name (``<setting>-<option>-seed<s>``); ``options`` maps each option to
    its flags, the reference (float32 blocking) first."""
    reference_name = next(iter(options))
    table: dict[str, dict[str, Any]] = {}
    for setting in settings:
        rows: dict[str, Any] = {}
        for option in options:
            runs = [results.get(f"{setting}-{option}-seed{seed}") for seed in seeds]
            runs = [r for r in runs if r is not None]
            if runs:
                rows[option] = option_row(runs, rows.get(reference_name))
                if option != reference_name:
                    rows[option]["paired_difference"] = paired_difference(
                        results, setting, option, reference_name, seeds
                    )
        table[setting] = rows
    any_run = next(iter(results.values()), {})
    config = any_run.get("config", {})
    return {
        "kind": KIND,
        "schema": SCHEMA,
        "command": command,
        "reference": reference_name,
        "options": dict(options),
        "settings": list(settings),
        "seeds": list(seeds),
        "setup": {
            key: config.get(key)
            for key in ("model", "workers", "batch_size", "seq_len", "steps", "sync_period", "lr")
        },
        "parameters": any_run.get("parameters"),
        "table": table,
        "failures": dict(failures or {}),
    }
