"""report.md of the GPU campaign, drawn from its results (``benchmarks/gpu_campaign.py``) alone.

Every section says what its part found, or why it has nothing (skipped, failed, timed out, still
running when the campaign stopped).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

H200_BYTES_PER_S = 4.8e12  # the datasheet's memory bandwidth
STEP_TARGETS = {"MTAdam N=1": 1.05, "MTAdam N=2": 1.3}  # at most this x AdamW(fused=True)
BASELINE = "AdamW(fused=True)"
PER_TENSOR_BEFORE = "MTAdam N=1 per-tensor foreach"  # the CUDA default before the flat layout

TITLES = {
    "environment": "Environment",
    "exactness": "Exactness of the flat-buffer step",
    "optimizer_step": "Optimizer step",
    "train": "`mtdao train --device cuda`, every method",
    "vmapped_workers": "Vmapped workers against separate models",
    "sharded": "Sharded workers on one GPU",
    "torchrun": "One-process torchrun jobs",
    "paper_16m": "The paper's 16M setting (`mtdao compare --preset paper-16m`)",
}


def render_report(results: dict[str, Any]) -> str:
    parts = results["parts"]
    environment = parts.get("environment", {}).get("data", {}).get("environment", {})
    title = "# GPU campaign" + (" (dry run: toy sizes on the CPU)" if results["dry_run"] else "")
    where = environment.get("gpu") or f"no GPU ({environment.get('cpus', '?')} CPUs)"
    lines = [
        title,
        "",
        f"{results['started_utc']}: {where}, torch {environment.get('torch', '?')} "
        f"(CUDA {environment.get('cuda')}), Python {environment.get('python', '?')}; "
        f"{results['elapsed_s']:.0f} s of a {results['budget_s']:.0f} s budget"
        + ("." if results["finished"] else " (still running, or stopped before its end)."),
        "",
        "```",
        results["command"],
        "```",
        "",
        "| part | status | seconds | budget, s | note |",
        "|---|---|---|---|---|",
    ]
    for name, entry in parts.items():
        lines.append(
            f"| {name} | {entry['status']} | {entry.get('seconds', '')} | "
            f"{entry.get('budget_s', '')} | {_cell(entry.get('note', ''))} |"
        )
    for name, entry in parts.items():
        lines += ["", f"## {TITLES[name]}", ""]
        data = entry.get("data") or {}
        if entry["status"] == "skipped":
            lines.append(f"Skipped: {entry.get('note', '')}.")
            continue
        if entry["status"] != "ok":
            lines.append(f"**{entry['status']}**: {entry.get('note', '')}")
            lines.append("")
        try:
            lines += SECTIONS[name](data, results)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:  # a partial record
            lines.append(f"(incomplete record: {type(error).__name__}: {error})")
        if entry.get("log_tail"):
            lines += ["", "<details><summary>end of its log</summary>", "", "```"]
            lines += [entry["log_tail"].rstrip(), "```", "", "</details>"]
    return "\n".join(lines) + "\n"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:300]


def _number(value: Any, digits: int = 3) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-" if value is None else str(value)
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"


def _verdict(passed: Any) -> str:
    return {True: "pass", False: "**FAIL**"}.get(passed, "-")


def _log_block(record: dict, title: str | None = None) -> list[str]:
    """The end of a run's log as a fenced block (nothing when none was kept)."""
    if not record.get("log_tail"):
        return []
    return ["", *([title, ""] if title else []), "```", record["log_tail"].rstrip(), "```"]


# -- sections ------------------------------------------------------------------------------------


def environment_section(data: dict, results: dict) -> list[str]:
    info = data.get("environment", {})
    lines = [f"- {key}: {value}" for key, value in info.items() if key != "packages"]
    packages = info.get("packages", {})
    lines.append(
        "- packages: "
        + ", ".join(f"{name} {version or 'MISSING'}" for name, version in packages.items())
    )
    return lines


def exactness_section(data: dict, results: dict) -> list[str]:
    lines = [
        "Each case: 8 steps of changing learning rates over a scalar, small tensors, one of 70,001 "
        "elements and a transposed one. The figures are the worst |error| / (atol + rtol |expected|) "
        "over parameters and states (at most 1 passes): against the literal reference in float64 "
        "(rtol 1e-4, atol 1e-5; float32 cases) and against the per-tensor foreach path (float32: "
        "rtol 1e-5, atol 1e-6; bfloat16 parameters: rtol 1.6e-2).",
        "",
        "| case | layout | vs reference | vs per-tensor | verdict | s |",
        "|---|---|---|---|---|---|",
    ]
    for row in data.get("rows", []):
        lines.append(
            f"| {row['case']} | {row['layout']} | {_number(row['vs_reference'])} | "
            f"{_number(row['vs_per_tensor'])} | {_verdict(row['passed'])} | {row['seconds']} |"
        )
    rows = data.get("rows", [])
    if rows:
        failed = [row["case"] for row in rows if not row["passed"]]
        lines += [
            "",
            f"{len(rows) - len(failed)} of {len(rows)} cases pass"
            + (f"; failing: {', '.join(failed)}." if failed else "."),
        ]
    if data.get("skipped"):
        lines.append(f"Not run (time): {', '.join(data['skipped'])}.")
    return lines


def optimizer_step_section(data: dict, results: dict) -> list[str]:
    rows = data.get("rows", [])
    lines = [
        "Median (and fastest) time of one step over the same parameters and fixed gradients, "
        "weight decay 0.1, float32 states, each optimizer on its own copy of the parameters. "
        "GB/s: the bytes an ideal single pass moves (read x, g and each state, write x and each "
        "state) over the median time; the flat layout also copies the gradients into its buffer "
        "(the `gather` column, 8 bytes a parameter, not counted in GB/s).",
    ]
    for size in data.get("sizes", []):
        of_size = [row for row in rows if row["size"] == size]
        if not of_size:
            continue
        baseline = next((row for row in of_size if row["label"] == BASELINE), None)
        lines += [
            "",
            f"### {size}",
            "",
            "| optimizer | layout | kernel | ms/step | fastest | vs fused AdamW | GB/s | of 4.8 TB/s | gather ms | kernel ms | first step, s | peak GB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in of_size:
            seconds = row["median_ms"] / 1e3
            bandwidth = row["ideal_bytes"] / seconds if "ideal_bytes" in row else None
            ratio = row["median_ms"] / baseline["median_ms"] if baseline else None
            lines.append(
                f"| {row['label']} | {row['layout']} | {row['kernel']} | {_number(row['median_ms'])} | "
                f"{_number(row.get('fastest_ms'))} | {_number(ratio)}x | "
                f"{_number(bandwidth and bandwidth / 1e9)} | "
                f"{_number(bandwidth and 100 * bandwidth / H200_BYTES_PER_S, 2)}% | "
                f"{_number(row.get('gather_ms'))} | {_number(row.get('kernel_ms'))} | "
                f"{_number(row.get('first_step_s'))} | {_number(row.get('peak_memory_gb'))} |"
            )
        if baseline:
            lines += [""] + _targets(of_size, baseline) + _default_check(of_size)
    if data.get("skipped"):
        lines += ["", f"Not run (time): {', '.join(data['skipped'])}."]
    return lines


def _targets(rows: list[dict], baseline: dict) -> list[str]:
    lines = []
    for label, target in STEP_TARGETS.items():
        row = next((r for r in rows if r["label"] == label), None)
        if row:
            ratio = row["median_ms"] / baseline["median_ms"]
            verdict = "met" if ratio <= target else "**missed**"
            lines.append(
                f"- {label} ({row['layout']}, {row['kernel']}): {ratio:.2f}x fused AdamW, target "
                f"<= {target}x: {verdict}."
            )
    return lines


def _default_check(rows: list[dict]) -> list[str]:
    """Does fused=None's choice (FLAT_BY_DEFAULT, fusing_pays) take the fastest measured path?"""
    candidates = [
        r for r in rows if r["label"].startswith("MTAdam N=1") and "omegas" not in r["label"]
    ]
    default = next((r for r in candidates if r["label"] == "MTAdam N=1"), None)
    if not default or len(candidates) < 2:
        return []
    fastest = min(candidates, key=lambda r: r["median_ms"])
    if fastest is default:
        verdict = (
            "the default is the fastest measured path: FLAT_BY_DEFAULT and fusing_pays confirmed"
        )
    else:
        verdict = (
            f"**`{fastest['label']}` ({fastest['layout']}, {fastest['kernel']}) is faster than the "
            f"default**, {fastest['median_ms']:.3f} ms against {default['median_ms']:.3f}: revisit "
            "FLAT_BY_DEFAULT / fusing_pays"
        )
    paths = ", ".join(f"{r['layout']} {r['kernel']} {r['median_ms']:.3f} ms" for r in candidates)
    return [f"- MTAdam N=1 by path: {paths}; {verdict}."]


def train_section(data: dict, results: dict) -> list[str]:
    lines = [
        "| run | steps | final val loss | losses finite | device | bf16 | s per worker-step | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in data.get("runs", []):
        lines.append(
            f"| {run['run']} | {run.get('steps', '-')} | {_number(run.get('final_val_loss'), 4)} | "
            f"{run.get('all_finite', '-')} | {run.get('device', '-')} | {run.get('bf16', '-')} | "
            f"{_number(run.get('compute_s_per_worker_step'))} | {_verdict(run.get('passed'))} |"
        )
    for run in data.get("runs", []):
        lines += _log_block(run, f"`{run['run']}` (exit code {run['exit_code']}):")
    return lines


def vmapped_section(data: dict, results: dict) -> list[str]:
    lines = [
        "Worst relative difference, over parameters and workers, between a worker's gradient "
        "with the 4 workers vmapped and the same worker's computed alone.",
        "",
        "| dtype | worst gap | tolerance | verdict |",
        "|---|---|---|---|",
    ]
    for row in data.get("rows", []):
        lines.append(
            f"| {row['dtype']} | {_number(row['worst_gap'])} | {row['tolerance']} | {_verdict(row['passed'])} |"
        )
    return lines


def sharded_section(data: dict, results: dict) -> list[str]:
    lines = []
    if "fsdp" in data:
        fsdp = data["fsdp"]
        lines.append(f"- `{fsdp['name']}` ({_verdict(fsdp['passed'])}): {fsdp['details']}")
    shards = data.get("shards_2")
    if shards:
        if "skipped" in shards:
            lines.append(f"- `--workers 1 --shards 2`: skipped, {shards['skipped']}.")
        else:
            lines.append(
                f"- `--workers 1 --shards 2` ({_verdict(shards.get('passed'))}): final val loss "
                f"{_number(shards.get('final_val_loss'), 4)}, exit code {shards['exit_code']}."
            )
    return lines


def torchrun_section(data: dict, results: dict) -> list[str]:
    lines = []
    run = data.get("train")
    if run:
        lines.append(
            f"- `torchrun --nproc-per-node 1 ... mtdao train --method mtdao` "
            f"({_verdict(run.get('passed'))}): exit code {run['exit_code']}, final val loss "
            f"{_number(run.get('final_val_loss'), 4)}, losses finite {run.get('all_finite', '-')} "
            "(at world size 1 the harness joins no process group)."
        )
        lines += [*_log_block(run), ""] if run.get("log_tail") else []
    group = data.get("group")
    if group:
        losses = group.get("losses") or []
        trend = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no losses"
        lines.append(
            f"- a one-process torchrun job on `{group.get('backend')}` (world size "
            f"{group.get('world_size')}), a small Llama trained {len(losses)} steps through mtdao's "
            f"process-group communicator, optimizer layout {group.get('optimizer_layout')} "
            f"({_verdict(group.get('passed'))}): {trend}, exit code {group['exit_code']}."
        )
        lines += _log_block(group)
    return lines


def paper_section(data: dict, results: dict) -> list[str]:
    lines = []
    calibration = data.get("calibration")
    if calibration:
        lines.append(
            f"Calibration: {calibration['steps']} MT-DAO steps in {calibration['wall_s']:.1f} s, "
            f"{calibration['step_s']:.3f} s a step once running, {calibration['overhead_s']:.1f} s "
            "of start-up, evaluation and saving."
        )
    if data.get("planned"):
        lines.append(
            f"Planned: {data['planned']['steps']} steps per method "
            f"({data['planned']['seconds_left']:.0f} s left for the three runs)."
        )
    runs = data.get("runs", {})
    if runs:
        lines += [
            "",
            "| method | steps | tokens | final val loss | s/step | train s | comm. reduction vs DDP |",
            "|---|---|---|---|---|---|---|",
        ]
        for run in runs.values():
            lines.append(
                f"| {run['method']} | {run['steps']} | {run['tokens']:,} | "
                f"{_number(run['final_val_loss'], 4)} | {_number(run['steady_step_s'])} | "
                f"{_number(run['train_time_s'])} | {_number(run['comm_reduction_vs_ddp'])} |"
            )
        parameters = next(iter(runs.values()))["parameters"]
        lines += ["", f"Parameters per worker: {parameters:,}."]
    return lines


SECTIONS: dict[str, Callable[[dict, dict], list[str]]] = {
    "environment": environment_section,
    "exactness": exactness_section,
    "optimizer_step": optimizer_step_section,
    "train": train_section,
    "vmapped_workers": vmapped_section,
    "sharded": sharded_section,
    "torchrun": torchrun_section,
    "paper_16m": paper_section,
}
