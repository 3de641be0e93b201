"""Beyond the box: calibrate the wall-clock model on WAN drills, check it on a held-out drill,
predict time to a target loss at scale.

Runs drills without events (``mtdao wan-drill``'s :func:`run_drill`) at several links and model
sizes, fits the round and heal model (:mod:`mtdao.experiments.wan_drill.calibration`) on all but the
held-out one, and writes ``beyond.md``, ``beyond.png`` and ``calibration.json`` into ``--out``.
Needs root (network namespaces).

    python -m mtdao.experiments.wan_drill.beyond --out reports/wan-drill --work /tmp/wan-beyond \
        --extra runs/wan-drill/baseline-0/drill.json --frontier reports/frontier-3000-iid/frontier.json

``--frontier`` takes what each local method sends from a frontier's points (its cheapest point
within half a percent of its best loss); without it, fp32 rounds at K = 32.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from mtdao.experiments.wan_drill.calibration import calibration_record, fit, measure, predict_drill
from mtdao.experiments.wan_drill.drill import DrillSettings, run_drill
from mtdao.experiments.wan_drill.predict import (
    FP32_SETTINGS,
    assumptions,
    frontier_settings,
    grid,
    heal_table,
    plot_predictions,
    prediction_table,
)
from mtdao.testing.network.scenario import Scenario
from mtdao.testing.network.sites import LinkSpec, cleanup_stale

# name: (model, link); every drill: 3 replicas, K = 16, no events
CALIBRATION = {
    "micro-5ms": ("micro", LinkSpec(delay_ms=5)),
    "micro-20ms": ("micro", LinkSpec(delay_ms=20)),
    "tiny-20ms": ("tiny", LinkSpec(delay_ms=20)),
    "micro-20mbit": ("micro", LinkSpec(rate_mbit=20, delay_ms=10)),
}
HELD_OUT = {"tiny-40ms-50mbit": ("tiny", LinkSpec(rate_mbit=50, delay_ms=40))}


def run_config(name: str, model: str, link: LinkSpec, work: Path, steps: int) -> Path:
    path = work / name / "drill.json"
    if path.exists():
        return path  # measured already: a rerun only refits
    settings = replace(DrillSettings(), model=model, steps=steps)
    scenario = Scenario("none", links={"default": link})
    record = run_drill(scenario, settings, work / name, "mtdaowanbeyond")
    if record["failures"]:
        raise RuntimeError(f"calibration drill {name} failed: {record['failures']}")
    return path


def render(record: dict, predictions_table: str, heals: str, assumed: list[str]) -> str:
    c = record["calibration"]
    command = "python -m mtdao.experiments.wan_drill.beyond " + " ".join(sys.argv[1:])
    lines = ["# Beyond the box: the wall-clock model calibrated on WAN drills", ""]
    lines += [f"    {command}", ""]
    lines += ["## Calibration", ""]
    lines += [
        f"Fitted on {len(record['measurements'])} drills without events (3 replicas, K = 16): "
        f"round time (quorum request to commit) = {c['fixed_s']:.3f} s + {c['rtts_per_round']:.2f} RTT + ring bytes at "
        f"{c['efficiency'] * 100:.0f} % of the link rate ({c['quorum_rtts']:.2f} RTT of it besides "
        f"the ring's M - 1); heal = {c['heal_fixed_s']:.2f} s + {c['heal_rtts']:.2f} RTT + "
        "state bytes at "
        f"{c['heal_efficiency'] * 100:.1f} % of the link rate.",
        "",
        "| drill | params | RTT (ms) | Mbit/s | compute / step (ms) | bytes / round | "
        "round time (s) | rounds timed | heals |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in record["measurements"]:
        lines.append(
            f"| {m['name']} | {m['parameters']:,} | {m['rtt_s'] * 1e3:.0f} | {m['rate_mbit']:g} | "
            f"{m['compute_s_per_step'] * 1e3:.1f} | {m['bytes_per_round'] / 1e6:.2f} MB | "
            f"{m['round_overhead_s']:.3f} | {m['rounds_measured']} | {len(m['heals'])} |"
        )
    lines += ["", "## Held out: prediction against measurement", ""]
    lines += ["| drill | | round time (s) | round interval (s) | training (s) | heal (s) |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for entry in record["held_out"]:
        name, p = entry["measurement"]["name"], entry["prediction"]
        heal = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {name} | predicted | {p['round_s']:.3f} | {p['round_interval_s']:.3f} | "
                     f"{p['train_s']:.1f} | {heal(p['heal_s'])} |")  # fmt: skip
        lines.append(f"| | measured | {p['measured_round_s']:.3f} | "
                     f"{p['measured_round_interval_s']:.3f} | {p['measured_train_s']:.1f} | "
                     f"{heal(p['measured_heal_s'])} |")  # fmt: skip
    for entry in record["held_out"]:
        p = entry["prediction"]
        errors = [(what, p[key], p[f"measured_{key}"]) for what, key in
                  (("round time", "round_s"), ("round interval", "round_interval_s"),
                   ("training", "train_s"), ("heal", "heal_s"))]  # fmt: skip
        said = ", ".join(f"{what} {(a - b) / b * 100:+.0f} %" for what, a, b in errors
                         if a is not None and b)  # fmt: skip
        lines += ["", f"Prediction against measurement: {said}. The measured training time "
                  "includes the evaluations, which the model leaves out."]  # fmt: skip
    compute = [m["compute_s_per_step"] for m in record["measurements"] if m["parameters"] < 2e5]
    lines += ["", "The drills ran on a shared 2-core machine: compute per step of the same model "
              f"ranged {min(compute) * 1e3:.0f} - {max(compute) * 1e3:.0f} ms between drills "
              "(other runs share the cores), which is why rounds are timed from quorum request to "
              "commit, leaving compute out."]  # fmt: skip
    lines += ["", "## Time to the target loss at scale", "", "Assumptions:", "", *assumed, ""]
    lines += [
        "DDP / X: how many times faster X is than DDP, which is also how many times more steps "
        "X could need and still tie DDP.",
        "",
        predictions_table,
        "",
        "![predictions](beyond.png)",
        "",
        "## Heal time against model size",
        "",
        "A restarted replica receives parameters, both Adam states and the engine's anchor "
        "(4 model-sized tensors), at the calibrated heal rate, 80 ms round trip:",
        "",
        heals,
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reports/wan-drill"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/wan-beyond"))
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--extra", nargs="*", default=[], help="drill.json of more no-event drills")
    parser.add_argument(
        "--frontier", type=Path, help="frontier.json whose points say what each method sends"
    )
    args = parser.parse_args(argv)
    cleanup_stale("mtdaowanbeyond")
    calibration_paths = [run_config(n, *c, args.work, args.steps) for n, c in CALIBRATION.items()]
    held_paths = [run_config(n, *c, args.work, args.steps) for n, c in HELD_OUT.items()]
    measurements = [measure(p) for p in [*calibration_paths, *map(Path, args.extra)]]
    held_out = [measure(p) for p in held_paths]
    calibration = fit(measurements)
    record = calibration_record(calibration, measurements, held_out)
    settings = (
        frontier_settings(json.loads(args.frontier.read_text())) if args.frontier else FP32_SETTINGS
    )
    record["settings"] = {method: asdict(s) for method, s in settings.items()}
    predictions = grid(calibration, settings)
    record["predictions"] = [{**vars(p), "total_s": p.total_s} for p in predictions]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps(record, indent=1))
    plot_predictions(args.out, predictions)
    text = render(
        record, prediction_table(predictions), heal_table(calibration), assumptions(settings)
    )
    (args.out / "beyond.md").write_text(text)
    for entry in record["held_out"]:
        print(entry["measurement"]["name"], json.dumps(predict_drill(calibration, held_out[0])))
    print(f"report: {args.out / 'beyond.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
