"""The numbers behind ``mtdao compare``'s report, and the report itself.

Input: per method, the results dicts of its runs (one per seed, all at the method's chosen LR).
Everything here is arithmetic on those dicts, so it is tested without training anything.

* target loss: DDP's mean final validation loss; steps to target: the first evaluation at or
  below it (resolution: the evaluation interval);
* mean ± std over seeds (sample std, ddof = 1; 0 with one seed);
* significance rule (:data:`SIGNIFICANCE_RULE`): a difference counts only if it exceeds the sum of
  the two standard deviations, otherwise it is a tie within seed noise;
* traffic: bytes each worker contributed to collectives; DDP's is one gradient per step;
* modelled wall-clock: :mod:`mtdao.experiments.wallclock` on the logged collectives with ONE
  compute time per step for every method (the median measured over all runs), since every method
  does the same forward/backward/update per step and only communication differs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mtdao.experiments.wallclock import LINK_PRESETS, Link, run_seconds, time_to_step

SIGNIFICANCE_RULE = (
    "a difference between two methods counts only if it exceeds the sum of their standard "
    "deviations over seeds; otherwise it is a tie within seed noise"
)
LABELS = {
    "ddp": "DDP",
    "qh-ddp": "QH-DDP",
    "local-adam": "Local Adam",
    "diloco": "DiLoCo",
    "desloc": "DES-LOC",
    "mtdao": "MT-DAO",
}
# The paper's claim: MT-DAO matches or beats DDP, and beats these local baselines.
CLAIM_BASELINES = ("local-adam", "diloco")


def label(method: str, optimizer: str = "adam") -> str:
    name = LABELS.get(method, method)
    if optimizer == "adopt":
        name = name.replace("Adam", "ADOPT")
    return name


# -- statistics -----------------------------------------------------------------------------------


def stats(values: Iterable[float]) -> dict[str, Any] | None:
    """Mean, sample std (0 for one value) and count of the finite ``values``; None if none."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    finite = all(math.isfinite(v) for v in values)
    std = statistics.stdev(values) if len(values) > 1 and finite else 0.0
    mean = statistics.fmean(values) if finite else math.inf
    return {"mean": mean, "std": std, "n": len(values), "values": values}


def compare_losses(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """'better' if a's mean loss is lower than b's by more than a.std + b.std, 'worse' if higher,
    else 'tie'."""
    difference = a["mean"] - b["mean"]
    if math.isnan(difference):
        return "tie"
    if abs(difference) <= a["std"] + b["std"]:
        return "tie"
    return "better" if difference < 0 else "worse"


def steps_to_target(evals: Sequence[Mapping[str, Any]], target: float) -> int | None:
    """Step of the first evaluation with validation loss at or below ``target``; None if never."""
    for record in evals:
        if record.get("val_loss") is not None and record["val_loss"] <= target:
            return int(record["step"])
    return None


def traffic_ratio(ddp_bytes: float, method_bytes: float) -> float:
    """How many times less than DDP a method sent (inf when it sent nothing)."""
    return ddp_bytes / method_bytes if method_bytes else math.inf


def shared_compute_seconds(runs: Iterable[Mapping[str, Any]]) -> float:
    """Median measured compute seconds per worker-step over ``runs``."""
    measured = [r["compute_s_per_worker_step"] for r in runs if r.get("compute_s_per_worker_step")]
    if not measured:
        raise ValueError("no run reports compute_s_per_worker_step")
    return statistics.median(measured)


# -- the summary ----------------------------------------------------------------------------------


def summarize_method(
    runs: Sequence[Mapping[str, Any]],
    target: float | None,
    compute_s: float,
    links: Mapping[str, Link] = LINK_PRESETS,
) -> dict[str, Any]:
    """Everything the report says about one method's runs (one per seed)."""
    reached = [steps_to_target(r["evals"], target) if target is not None else None for r in runs]
    bytes_sent = stats(r["bytes_per_worker"] for r in runs)["mean"]
    ddp_bytes = stats(r["ddp_bytes_per_worker"] for r in runs)["mean"]
    wallclock = {}
    for name, link in links.items():
        totals, to_target = [], []
        for run, step in zip(runs, reached):
            events = [tuple(e) for e in run["comm_events"]]
            totals.append(run_seconds(compute_s, events, run["workers"], link, steps=run["steps"]))
            if step is not None:
                to_target.append(time_to_step(compute_s, events, run["workers"], link, step=step))
        wallclock[name] = {"run_s": stats(totals), "to_target_s": stats(to_target)}
    return {
        "lr": runs[0]["settings"]["lr"],
        "settings": runs[0]["settings"],
        "sync_policy": runs[0].get("sync_policy"),
        "seeds": [r["config"]["seed"] for r in runs],
        "steps": runs[0]["steps"],
        "final_val_loss": stats(r["final_val_loss"] for r in runs),
        "val_ppl": stats(r["val_ppl"] for r in runs),
        "steps_to_target": {
            "per_seed": reached,
            "reached": sum(s is not None for s in reached),
            "n": len(runs),
            "stats": stats(s for s in reached if s is not None),
        },
        "bytes_per_worker": bytes_sent,
        "ddp_bytes_per_worker": ddp_bytes,
        "traffic_vs_ddp": traffic_ratio(ddp_bytes, bytes_sent),
        "wallclock": wallclock,
        "alignment": alignment_summary(runs),
    }


def alignment_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Mean worker/global pseudo-gradient cosine and drift over all syncs and the last quarter."""
    records = [(r["steps"], a) for r in runs for a in r.get("alignment") or []]
    if not records:
        return None

    def mean_of(key: str, late: bool) -> float:
        values = [v for steps, a in records if not late or a["step"] > 0.75 * steps for v in a[key]]
        return statistics.fmean(values) if values else math.nan

    return {
        "syncs_per_run": len(records) / len(runs),
        "cosine_mean": mean_of("cosine", False),
        "cosine_last_quarter": mean_of("cosine", True),
        "drift_mean": mean_of("drift", False),
    }


def summarize_compare(
    runs_by_method: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    settings: Mapping[str, Any],
    sweep: Mapping[str, Any] | None = None,
    failures: Mapping[str, str] | None = None,
    links: Mapping[str, Link] = LINK_PRESETS,
    compute_runs: Iterable[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The aggregate written to results.json and rendered into report.md and the plots."""
    present = {m: list(r) for m, r in runs_by_method.items() if r}
    if not present:
        raise ValueError("no finished runs to report on")
    all_runs = [r for runs in present.values() for r in runs]
    measured = list(compute_runs) if compute_runs is not None else all_runs
    compute_s = shared_compute_seconds(measured)
    ddp_loss = stats(r["final_val_loss"] for r in present["ddp"]) if "ddp" in present else None
    target = ddp_loss["mean"] if ddp_loss else None
    return {
        "settings": dict(settings),
        "significance_rule": SIGNIFICANCE_RULE,
        "target_val_loss": target,
        "compute_s_per_step": compute_s,
        "compute_s_runs": len(measured),
        "links": {
            name: {"bandwidth_gbit": link.bandwidth_gbit, "latency_s": link.latency_s}
            for name, link in links.items()
        },
        "methods": {
            m: summarize_method(runs, target, compute_s, links) for m, runs in present.items()
        },
        "missing_methods": [m for m, r in runs_by_method.items() if not r],
        "sweep": dict(sweep) if sweep else None,
        "failures": dict(failures or {}),
        "runs": present,
    }


# -- the verdict ----------------------------------------------------------------------------------


def _versus(summary: Mapping[str, Any], method: str, other: str) -> tuple[str, str]:
    """(outcome, sentence) comparing ``method`` with ``other`` on final validation loss."""
    a = summary["methods"][method]["final_val_loss"]
    b = summary["methods"][other]["final_val_loss"]
    outcome = compare_losses(a, b)
    name, other_name = label(method), label(other)
    difference = abs(a["mean"] - b["mean"])
    relative = difference / b["mean"] * 100 if b["mean"] else math.nan
    noise = a["std"] + b["std"]
    band = f"the noise band {noise:.4f}" if a["n"] > 1 and b["n"] > 1 else "no noise estimate"
    numbers = f"{name} {_pm(a)} vs {other_name} {_pm(b)}"
    if not (math.isfinite(a["mean"]) and math.isfinite(b["mean"])):
        return outcome, f"{numbers}: a non-finite loss, no comparison."
    if outcome == "tie":
        return outcome, (
            f"{numbers}: a difference of {difference:.4f} within {band}, a tie within seed noise."
        )
    winner = name if outcome == "better" else other_name
    return outcome, (
        f"{numbers}: {winner} is better by {difference:.4f} ({relative:.1f}%), "
        + (f"beyond {band}." if a["n"] > 1 and b["n"] > 1 else "with no noise estimate.")
    )


def verdict(summary: Mapping[str, Any]) -> str:
    """Paragraphs judging the paper's claim from the numbers, stating the rule they apply."""
    methods = summary["methods"]
    rule = f"Significance rule: {SIGNIFICANCE_RULE}."
    if min(m["final_val_loss"]["n"] for m in methods.values()) == 1:
        rule += (
            " Some methods have a single seed, so there is no noise estimate for them and every "
            "difference counts; treat those comparisons as provisional."
        )
    if "mtdao" not in methods:
        return rule + " MT-DAO has no finished runs, so the paper's claim cannot be checked here."
    claim_text = "the paper's claim (MT-DAO matches or beats DDP and beats Local Adam and DiLoCo)"
    findings, checks = [], []
    for other in ("ddp", *CLAIM_BASELINES):
        claim = ("matches or beats " if other == "ddp" else "beats ") + label(other)
        if other not in methods:
            findings.append(f"{label(other)} was not run, so '{claim}' is not checked.")
            continue
        outcome, sentence = _versus(summary, "mtdao", other)
        findings.append(sentence)
        checks.append(
            (claim, outcome in ("better", "tie") if other == "ddp" else outcome == "better")
        )
    held = [claim for claim, holds in checks if holds]
    failed = [_negate(claim) for claim, holds in checks if not holds]
    if checks and not failed:
        partly = " as far as it was tested" if len(checks) < 1 + len(CLAIM_BASELINES) else ""
        conclusion = f"So {claim_text} holds here{partly}."
    elif held:
        conclusion = (
            f"So {claim_text} holds only in part: MT-DAO {' and '.join(held)}, but it does not "
            f"{' or '.join(failed)}."
        )
    elif checks:
        conclusion = f"So {claim_text} does not hold here: MT-DAO does not {' or '.join(failed)}."
    else:
        conclusion = "None of the claim's baselines was run, so the claim is not checked."
    ranking = sorted(methods, key=lambda m: methods[m]["final_val_loss"]["mean"])
    ranking_text = "Ranking by mean final loss: " + " < ".join(
        f"{label(m)} {methods[m]['final_val_loss']['mean']:.4f}" for m in ranking
    )
    settings = summary["settings"]
    scale = (
        f"Scale: the {settings.get('model')} preset ({_count(settings.get('parameters'))} "
        f"parameters), {settings.get('steps')} steps, {_count(settings.get('tokens'))} tokens, "
        f"sequence {settings.get('seq_len')}; the paper's claims are for 16M-720M-parameter "
        "models at sequence 2048, so this tests them at this scale only."
    )
    paragraphs = [
        " ".join([*findings, conclusion]),
        " ".join([*_efficiency_sentences(summary), ranking_text + "."]),
        rule + " " + scale,
    ]
    return "\n\n".join(paragraphs)


def _negate(claim: str) -> str:
    return claim.replace("matches or beats", "match or beat").replace("beats", "beat")


def _efficiency_sentences(summary: Mapping[str, Any]) -> list[str]:
    methods = summary["methods"]
    mtdao = methods["mtdao"]
    ratio = mtdao["traffic_vs_ddp"]
    if math.isinf(ratio):
        sentences = ["MT-DAO sent no bytes at all (no sync fell within the run)."]
    elif ratio > 1 + 1e-9:
        sentences = [f"MT-DAO sent {ratio:.1f}x less than DDP per worker."]
    else:
        sentences = [f"MT-DAO sent {1 / ratio:.2f}x as many bytes as DDP per worker."]
    if summary["target_val_loss"] is None:
        return sentences
    reach = mtdao["steps_to_target"]
    if reach["reached"]:
        sentences.append(
            f"It reached DDP's final loss {summary['target_val_loss']:.4f} in "
            f"{reach['reached']}/{reach['n']} seeds, at step {reach['stats']['mean']:.0f} on "
            f"average (of {mtdao['steps']})."
        )
    else:
        sentences.append(
            f"It never reached DDP's final loss {summary['target_val_loss']:.4f} within "
            f"{mtdao['steps']} steps."
        )
    if "ddp" in methods:
        changes = []
        for link in summary["links"]:
            ours = mtdao["wallclock"][link]["run_s"]["mean"]
            theirs = methods["ddp"]["wallclock"][link]["run_s"]["mean"]
            changes.append(f"{link} {_relative(ours, theirs)}")
        sentences.append(
            "Modelled iso-token wall-clock time relative to DDP: " + ", ".join(changes) + "."
        )
    return sentences


# -- formatting -----------------------------------------------------------------------------------


def _pm(value: Mapping[str, Any] | None, digits: int = 4) -> str:
    if value is None:
        return "—"
    if not math.isfinite(value["mean"]):
        return "diverged"
    if value["n"] == 1:
        return f"{value['mean']:.{digits}f}"
    return f"{value['mean']:.{digits}f} ± {value['std']:.{digits}f}"


def _ratio(ratio: float) -> str:
    if math.isinf(ratio):
        return "nothing"
    if abs(ratio - 1) < 1e-9:
        return "the same"
    return f"{ratio:.1f}x less" if ratio > 1 else f"{1 / ratio:.1f}x more"


def _relative(value: float, reference: float) -> str:
    if not reference:
        return "n/a"
    change = (value - reference) / reference * 100
    return f"{change:+.1f}%"


def format_seconds(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def _count(value) -> str:
    if value is None:
        return "?"
    for suffix, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return str(value)


def _steps_cell(reach: Mapping[str, Any]) -> str:
    if not reach["reached"]:
        return "never"
    text = _pm(reach["stats"], 0)
    if reach["reached"] < reach["n"]:
        text += f" ({reach['reached']}/{reach['n']} seeds; others never)"
    return text


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


# -- report.md ------------------------------------------------------------------------------------


def render_compare_report(summary: Mapping[str, Any]) -> str:
    s = summary["settings"]
    methods = summary["methods"]
    order = [m for m in s.get("methods", methods) if m in methods]
    title = (
        f"# MT-DAO vs baselines: {s.get('model')} model, M = {s.get('workers')}, "
        f"K = {s.get('sync_period')}, {s.get('steps')} steps"
    )
    lines = [title, ""]
    lines += ["## Settings", ""]
    lines += [
        f"- model `{s.get('model')}` ({_count(s.get('parameters'))} parameters), data "
        f"`{s.get('data') or 'built-in'}`, tokenizer `{s.get('tokenizer')}`, base optimizer "
        f"`{s.get('optimizer')}`, LR schedule `{s.get('schedule')}`",
        f"- {s.get('workers')} workers x {s.get('batch_size')} sequences x {s.get('seq_len')} "
        f"tokens per step, {s.get('steps')} steps = {_count(s.get('tokens'))} tokens per run, "
        "identical for every method",
        f"- sync period K = {s.get('sync_period')} (local methods); evaluation every "
        f"{s.get('eval_every')} steps on {_count(s.get('eval_tokens'))} held-out tokens",
        f"- seeds {', '.join(map(str, s.get('seeds', [])))}; learning rates: {s.get('lr_selection')}",
    ]
    for method in order:
        st = methods[method]["settings"]
        policy = methods[method].get("sync_policy") or ""
        lines.append(
            f"- {label(method)}: lr {st['lr']:.3g}, betas {st['betas']}, omegas {st['omegas']}, "
            f"beta2 {st['beta2']}, sync `{policy}`"
            + (
                f", omega warm-up {s['omega_warmup']:g}"
                if s.get("omega_warmup") and method in ("mtdao", "qh-ddp")
                else ""
            )
        )
    if s.get("command"):
        lines += ["", f"Command: `{s['command']}`"]
    lines += ["", "## Verdict", "", verdict(summary), ""]

    target = summary["target_val_loss"]
    lines += ["## Results", ""]
    target_text = f"{target:.4f}" if target is not None else "n/a (DDP not run)"
    lines += _table(
        [
            "method",
            "LR",
            "final val loss",
            "val perplexity",
            f"steps to DDP's loss {target_text}",
            "bytes / worker",
            "traffic vs DDP",
        ],
        (
            [
                label(m),
                f"{methods[m]['lr']:.3g}",
                _pm(methods[m]["final_val_loss"]),
                _pm(methods[m]["val_ppl"], 3),
                _steps_cell(methods[m]["steps_to_target"]),
                format_bytes(methods[m]["bytes_per_worker"]),
                _ratio(methods[m]["traffic_vs_ddp"]),
            ]
            for m in order
        ),
    )
    lines += [
        "",
        f"Mean ± sample std over seeds. Steps to target: the first evaluation at or below DDP's "
        f"mean final loss, so resolved to the evaluation interval ({s.get('eval_every')} steps); "
        "averaged over the seeds that reached it.",
        "",
    ]

    lines += ["## Modelled wall-clock time", ""]
    lines += [
        f"Compute per step: {summary['compute_s_per_step'] * 1e3:.1f} ms for every method, the "
        f"median measured compute time per worker-step over {summary['compute_s_runs']} runs. "
        "Every method does identical compute per step (same model, batch and update), so one "
        "shared figure removes timing noise and the differences below come from communication "
        "alone: the logged collectives costed as ring all-reduces (2(M-1) latency + "
        "2(M-1)/M x bytes / bandwidth), no overlap with compute. Each cell: time for the whole "
        "run at equal tokens (time to reach DDP's final loss).",
        "",
    ]
    links = list(summary["links"])
    header = ["method"] + [
        f"{name} ({info['bandwidth_gbit']:g} Gbit/s, {info['latency_s'] * 1e3:g} ms)"
        for name, info in summary["links"].items()
    ]
    rows = []
    for m in order:
        row = [label(m)]
        for link in links:
            cell = methods[m]["wallclock"][link]
            text = format_seconds(cell["run_s"]["mean"])
            if "ddp" in methods and m != "ddp":
                text += f" [{_relative(cell['run_s']['mean'], methods['ddp']['wallclock'][link]['run_s']['mean'])}]"
            reach = cell["to_target_s"]
            text += f" ({format_seconds(reach['mean']) if reach else 'never'})"
            row.append(text)
        rows.append(row)
    lines += _table(header, rows)
    lines += ["", "[+x%] is the iso-token time relative to DDP.", ""]

    aligned = [m for m in order if methods[m]["alignment"]]
    if aligned:
        lines += ["## Worker alignment", ""]
        lines += [
            "Cosine similarity between each worker's pseudo-gradient (its change since the last "
            "parameter sync) and the global one (the averaged change), and each worker's L2 "
            "distance from the average (drift), at every parameter sync; mean over workers, "
            "syncs and seeds. The paper reports > 0.95 for MT-DAO and ~0.7 for Local ADOPT.",
            "",
        ]
        lines += _table(
            ["method", "mean cosine", "cosine, last quarter", "mean drift", "syncs per run"],
            (
                [
                    label(m),
                    f"{a['cosine_mean']:.3f}",
                    f"{a['cosine_last_quarter']:.3f}",
                    f"{a['drift_mean']:.4f}",
                    f"{a['syncs_per_run']:.0f}",
                ]
                for m in aligned
                for a in [methods[m]["alignment"]]
            ),
        )
        lines.append("")

    if summary.get("sweep"):
        lines += render_sweep(summary["sweep"])

    lines += ["## Plots", ""]
    for name, caption in (
        ("loss_vs_tokens.png", "validation loss vs tokens (mean over seeds, band min-max)"),
        ("loss_vs_time.png", "validation loss vs modelled wall-clock time"),
        ("alignment.png", "worker alignment and drift at each sync"),
        ("traffic.png", "bytes sent per worker"),
    ):
        lines.append(f"- {caption}: ![{name}]({name})")
    lines.append("")
    if summary.get("failures"):
        lines += ["## Failed runs", ""]
        lines += [f"- `{name}`: {error}" for name, error in summary["failures"].items()]
        lines.append("")
    if summary.get("missing_methods"):
        lines += [f"No finished runs for: {', '.join(summary['missing_methods'])}.", ""]
    return "\n".join(lines)


def render_sweep(sweep: Mapping[str, Any]) -> list[str]:
    """The LR sweep table: final val loss of the sweep seed per method and LR, best in bold."""
    lrs = sweep["lrs"]
    lines = [
        "## Learning-rate sweep",
        "",
        f"Seed {sweep['seed']} of every method at each LR; each method then ran its other seeds at "
        "its best LR (bold). A best LR at the edge of the sweep means the optimum may lie "
        "outside it.",
        "",
    ]
    rows = []
    for method, losses in sweep["losses"].items():
        best = sweep["best"].get(method)
        cells = []
        for lr in lrs:
            loss = losses.get(lr_key(lr))
            text = (
                "failed"
                if loss is None
                else ("diverged" if not math.isfinite(loss) else f"{loss:.4f}")
            )
            cells.append(f"**{text}**" if best is not None and lr == best else text)
        edge = best is not None and len(lrs) > 1 and best in (min(lrs), max(lrs))
        rows.append(
            [label(method), *cells, f"{best:.3g}" + (" (edge)" if edge else "") if best else "—"]
        )
    lines += _table(["method", *(f"lr {lr:.3g}" for lr in lrs), "chosen"], rows)
    lines.append("")
    return lines


def lr_key(lr: float) -> str:
    return f"{lr:.6g}"


def write_compare_report(out_dir: Path, summary: Mapping[str, Any]) -> Path:
    path = Path(out_dir) / "report.md"
    path.write_text(render_compare_report(summary))
    return path
