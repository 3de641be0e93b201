"""The record of one WAN drill: what every process did, as one JSON-able dict.

Read after the drill from the files its processes wrote: each replica site's run directory
(``metrics.jsonl``, ``replicas.jsonl``, ``results.json``, checkpoints), the fault drill's
per-incarnation digests (``control/<key>.rounds``), the logs, and the drill's own samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mtdao.train.checkpoint.index import CHECKPOINTS_DIR, COMPLETE_NAME


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a JSON-lines file, and the numbers of its lines that do not parse."""
    if not path.exists():
        return [], []
    records, damaged = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            damaged.append(number)
    return records, damaged


def read_rounds(path: Path) -> dict[int, str]:
    if not path.exists():
        return {}
    pairs = (line.split() for line in path.read_text().splitlines() if line.strip())
    return {int(step): digest for step, digest in pairs}


def log_tail(path: Path, lines: int = 8) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the complete checkpoints in ``run_dir``."""
    directory = run_dir / CHECKPOINTS_DIR
    if not directory.is_dir():
        return []
    names = (COMPLETE_NAME.fullmatch(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in names if m)


def collect(drill) -> dict[str, Any]:
    """Everything the checks and the report need from the finished ``drill``
    (a :class:`~mtdao.experiments.wan_drill.drill.WanDrill`)."""
    replicas = {}
    for site in drill.replica_sites():
        run_dir = drill.out / "replicas" / site
        metrics, metrics_damaged = read_jsonl(run_dir / "metrics.jsonl")
        events, _ = read_jsonl(run_dir / "replicas.jsonl")
        results_path = run_dir / "results.json"
        results = json.loads(results_path.read_text()) if results_path.exists() else None
        incarnations = []
        for incarnation in drill.incarnations[site]:
            key = incarnation["key"]
            incarnations.append(
                {
                    **incarnation,
                    "rounds": read_rounds(drill.control / f"{key}.rounds"),
                    "globals": read_rounds(drill.control / f"{key}.globals"),
                    "log_tail": log_tail(drill.out / f"{key}.log"),
                }
            )
        replicas[site] = {
            "metrics": metrics,
            "metrics_damaged_lines": metrics_damaged,
            "events": events,
            "final_val_loss": results["final_val_loss"] if results else None,
            "results_steps": results["steps"] if results else None,
            "bytes_per_worker": results.get("bytes_per_worker") if results else None,
            "compute_s_per_step": results.get("compute_s_per_worker_step") if results else None,
            "parameters": results.get("parameters") if results else None,
            "checkpoints": checkpoint_steps(run_dir),
            "incarnations": incarnations,
        }
    lighthouse = [
        {**i, "log_tail": log_tail(drill.out / f"{i['key']}.log")}
        for i in drill.incarnations.get("lighthouse", [])
    ]
    return {
        "scenario": drill.scenario.to_dict(),
        "settings": vars(drill.settings),
        "emulation": drill.sites.emulation,
        "secured": True,  # listeners on the sites' addresses, a per-drill secret (drill.py)
        "links": {site: vars(link) for site, link in drill.sites.links.items()},
        "started": drill.started,
        "t0": drill.t0,
        "ended": max([s["time"] for s in drill.samples] or [drill.started]),
        "events": drill.applied,
        "failures": drill.failures,
        "samples": drill.samples,
        "replicas": replicas,
        "lighthouse": lighthouse,
    }
