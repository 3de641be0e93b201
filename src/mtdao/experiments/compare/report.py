"""``mtdao compare``'s report.md, rendered from the summary of :mod:`.summary` alone (the content
of results.json), so a committed report re-renders from its results.json."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mtdao.experiments.common.formatting import (
    SIGNIFICANCE_RULE,
    failures_section,
    format_bytes,
    format_count,
    format_lr,
    format_relative,
    format_seconds,
    format_traffic,
    join_numbers,
    label,
    pm,
    table,
)
from mtdao.experiments.compare.summary import CLAIM_BASELINES, claim_checks, lr_key, ranking
from mtdao.methods.table import MULTI_TIMESCALE_METHODS

CLAIM = "the paper's claim (MT-DAO matches or beats DDP and beats Local Adam and DiLoCo)"
PLOTS = (
    ("loss_vs_tokens.png", "validation loss vs tokens (mean over seeds, band min-max)"),
    ("loss_vs_time.png", "validation loss vs modelled wall-clock time"),
    ("alignment.png", "worker alignment and drift at each sync"),
    ("traffic.png", "bytes sent per worker"),
)


# -- the verdict ----------------------------------------------------------------------------------


def _claim_wording(other: str) -> str:
    return ("matches or beats " if other == "ddp" else "beats ") + label(other)


def _negate(claim: str) -> str:
    return claim.replace("matches or beats", "match or beat").replace("beats", "beat")


def versus_sentence(methods: Mapping[str, Any], method: str, other: str, numbers: dict) -> str:
    """One sentence comparing ``method`` with ``other``: ``numbers`` is their
    :func:`~mtdao.experiments.compare.summary.versus`."""
    a, b = methods[method]["final_val_loss"], methods[other]["final_val_loss"]
    name, other_name = label(method), label(other)
    band = (
        f"the noise band {numbers['noise']:.4f}" if numbers["noise_known"] else "no noise estimate"
    )
    values = f"{name} {pm(a)} vs {other_name} {pm(b)}"
    if not numbers["finite"]:
        return f"{values}: a non-finite loss, no comparison."
    if numbers["outcome"] == "tie":
        return (
            f"{values}: a difference of {numbers['difference']:.4f} within {band}, a tie within "
            "seed noise."
        )
    winner = name if numbers["outcome"] == "better" else other_name
    return (
        f"{values}: {winner} is better by {numbers['difference']:.4f} "
        f"({numbers['relative_percent']:.1f}%), "
        + (f"beyond {band}." if numbers["noise_known"] else "with no noise estimate.")
    )


def _claim_paragraph(methods: Mapping[str, Any]) -> str:
    findings = []
    checks = claim_checks(methods)
    for check in checks:
        if check["versus"] is None:
            claim = _claim_wording(check["other"])
            findings.append(f"{label(check['other'])} was not run, so '{claim}' is not checked.")
        else:
            findings.append(versus_sentence(methods, "mtdao", check["other"], check["versus"]))
    tested = [c for c in checks if c["holds"] is not None]
    held = [_claim_wording(c["other"]) for c in tested if c["holds"]]
    failed = [_negate(_claim_wording(c["other"])) for c in tested if not c["holds"]]
    if tested and not failed:
        partly = " as far as it was tested" if len(tested) < 1 + len(CLAIM_BASELINES) else ""
        conclusion = f"So {CLAIM} holds here{partly}."
    elif held:
        conclusion = (
            f"So {CLAIM} holds only in part: MT-DAO {' and '.join(held)}, but it does not "
            f"{' or '.join(failed)}."
        )
    elif tested:
        conclusion = f"So {CLAIM} does not hold here: MT-DAO does not {' or '.join(failed)}."
    else:
        conclusion = "None of the claim's baselines was run, so the claim is not checked."
    return " ".join([*findings, conclusion])


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
    target = summary["target_val_loss"]
    if target is None:
        return sentences
    reach = mtdao["steps_to_target"]
    if reach["reached"]:
        sentences.append(
            f"It reached DDP's final loss {target:.4f} in {reach['reached']}/{reach['n']} seeds, "
            f"at step {reach['stats']['mean']:.0f} on average (of {mtdao['steps']})."
        )
    else:
        sentences.append(
            f"It never reached DDP's final loss {target:.4f} within {mtdao['steps']} steps."
        )
    if "ddp" in methods:
        changes = [
            f"{link} {_versus_ddp_time(summary, 'mtdao', link)}" for link in summary["links"]
        ]
        sentences.append(
            "Modelled iso-token wall-clock time relative to DDP: " + ", ".join(changes) + "."
        )
    return sentences


def _versus_ddp_time(summary: Mapping[str, Any], method: str, link: str) -> str:
    """The modelled whole-run time of ``method`` on ``link`` relative to DDP's: -11.0%."""
    run_s = summary["methods"][method]["wallclock"][link]["run_s"]["mean"]
    return format_relative(run_s, summary["methods"]["ddp"]["wallclock"][link]["run_s"]["mean"])


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
    ranking_text = "Ranking by mean final loss: " + " < ".join(
        f"{label(m)} {methods[m]['final_val_loss']['mean']:.4f}" for m in ranking(methods)
    )
    settings = summary["settings"]
    scale = (
        f"Scale: the {settings.get('model')} preset ({format_count(settings.get('parameters'))} "
        f"parameters), {settings.get('steps')} steps, {format_count(settings.get('tokens'))} "
        f"tokens, sequence {settings.get('seq_len')}; the paper's claims are for "
        "16M-720M-parameter models at sequence 2048, so this tests them at this scale only."
    )
    paragraphs = [
        _claim_paragraph(methods),
        " ".join([*_efficiency_sentences(summary), ranking_text + "."]),
        rule + " " + scale,
    ]
    return "\n\n".join(paragraphs)


# -- report.md sections ---------------------------------------------------------------------------


def _method_order(summary: Mapping[str, Any]) -> list[str]:
    methods = summary["methods"]
    return [m for m in summary["settings"].get("methods", methods) if m in methods]


def _method_line(summary: Mapping[str, Any], method: str) -> str:
    s = summary["settings"]
    info = summary["methods"][method]
    st = info["settings"]
    # a run's own resolved warm-ups; older results.json only had the comparison's omega warm-up
    omega_warmup = st.get(
        "omega_warmup", s.get("omega_warmup") if method in MULTI_TIMESCALE_METHODS else 0
    )
    beta_warmup = st.get("beta_warmup") or 0
    return (
        f"- {label(method)}: lr {format_lr(st['lr'])}, betas {st['betas']}, omegas "
        f"{st['omegas']}, beta2 {st['beta2']}, sync `{info.get('sync_policy') or ''}`"
        + (f", omega warm-up {omega_warmup:g}" if omega_warmup else "")
        + (f", beta warm-up {beta_warmup:g}" if beta_warmup else "")
    )


def _settings_section(summary: Mapping[str, Any]) -> list[str]:
    s = summary["settings"]
    lines = [
        "## Settings",
        "",
        f"- model `{s.get('model')}` ({format_count(s.get('parameters'))} parameters), data "
        f"`{s.get('data') or 'built-in'}`, tokenizer `{s.get('tokenizer')}`, base optimizer "
        f"`{s.get('optimizer')}`, LR schedule `{s.get('schedule')}`",
        f"- {s.get('workers')} workers x {s.get('batch_size')} sequences x {s.get('seq_len')} "
        f"tokens per step, {s.get('steps')} steps = {format_count(s.get('tokens'))} tokens per "
        "run, identical for every method",
        f"- sync period K = {s.get('sync_period')} (local methods); evaluation every "
        f"{s.get('eval_every')} steps on {format_count(s.get('eval_tokens'))} held-out tokens",
        f"- seeds {join_numbers(s.get('seeds', []))}; learning rates: {s.get('lr_selection')}",
    ]
    lines += [_method_line(summary, m) for m in _method_order(summary)]
    if s.get("preset"):
        lines.append(f"- preset `{s['preset']}`, with the flags of the command below")
    if s.get("command"):
        lines += ["", f"Command: `{s['command']}`"]
    return lines


def _steps_cell(reach: Mapping[str, Any]) -> str:
    if not reach["reached"]:
        return "never"
    text = pm(reach["stats"], 0)
    if reach["reached"] < reach["n"]:
        text += f" ({reach['reached']}/{reach['n']} seeds; others never)"
    return text


def _results_section(summary: Mapping[str, Any]) -> list[str]:
    methods = summary["methods"]
    target = summary["target_val_loss"]
    target_text = f"{target:.4f}" if target is not None else "n/a (DDP not run)"
    header = ["method", "LR", "final val loss", "val perplexity"]
    header += [f"steps to DDP's loss {target_text}", "bytes / worker", "traffic vs DDP"]
    rows = [
        [
            label(m),
            format_lr(methods[m]["lr"]),
            pm(methods[m]["final_val_loss"]),
            pm(methods[m]["val_ppl"], 3),
            _steps_cell(methods[m]["steps_to_target"]),
            format_bytes(methods[m]["bytes_per_worker"]),
            format_traffic(methods[m]["traffic_vs_ddp"]),
        ]
        for m in _method_order(summary)
    ]
    return [
        "## Results",
        "",
        *table(header, rows),
        "",
        "Mean ± sample std over seeds. Steps to target: the first evaluation at or below DDP's "
        "mean final loss, so resolved to the evaluation interval "
        f"({summary['settings'].get('eval_every')} steps); averaged over the seeds that reached it.",
        "",
    ]


WALLCLOCK_INTRO = (
    "Every method does identical compute per step (same model, batch and update), so one "
    "shared figure removes timing noise and the differences below come from communication "
    "alone: the logged collectives costed as ring all-reduces (2(M-1) latency + "
    "2(M-1)/M x bytes / bandwidth), no overlap with compute. Each cell: time for the whole "
    "run at equal tokens (time to reach DDP's final loss)."
)


def _wallclock_cell(summary: Mapping[str, Any], method: str, link: str) -> str:
    cell = summary["methods"][method]["wallclock"][link]
    text = format_seconds(cell["run_s"]["mean"])
    if "ddp" in summary["methods"] and method != "ddp":
        text += f" [{_versus_ddp_time(summary, method, link)}]"
    reach = cell["to_target_s"]
    return text + f" ({format_seconds(reach['mean']) if reach else 'never'})"


def _wallclock_section(summary: Mapping[str, Any]) -> list[str]:
    header = ["method"] + [
        f"{name} ({info['bandwidth_gbit']:g} Gbit/s, {info['latency_s'] * 1e3:g} ms)"
        for name, info in summary["links"].items()
    ]
    rows = [
        [label(m), *(_wallclock_cell(summary, m, link) for link in summary["links"])]
        for m in _method_order(summary)
    ]
    return [
        "## Modelled wall-clock time",
        "",
        f"Compute per step: {summary['compute_s_per_step'] * 1e3:.1f} ms for every method, the "
        f"median measured compute time per worker-step over {summary['compute_s_runs']} runs. "
        + WALLCLOCK_INTRO,
        "",
        *table(header, rows),
        "",
        "[+x%] is the iso-token time relative to DDP.",
        "",
    ]


def _alignment_section(summary: Mapping[str, Any]) -> list[str]:
    methods = summary["methods"]
    aligned = [m for m in _method_order(summary) if methods[m]["alignment"]]
    if not aligned:
        return []
    header = ["method", "mean cosine", "cosine, last quarter", "mean drift", "syncs per run"]
    rows = [
        [
            label(m),
            f"{a['cosine_mean']:.3f}",
            f"{a['cosine_last_quarter']:.3f}",
            f"{a['drift_mean']:.4f}",
            f"{a['syncs_per_run']:.0f}",
        ]
        for m in aligned
        for a in [methods[m]["alignment"]]
    ]
    intro = (
        "Cosine similarity between each worker's pseudo-gradient (its change since the last "
        "parameter sync) and the global one (the averaged change), and each worker's L2 "
        "distance from the average (drift), at every parameter sync; mean over workers, "
        "syncs and seeds. The paper reports > 0.95 for MT-DAO and ~0.7 for Local ADOPT."
    )
    return ["## Worker alignment", "", intro, "", *table(header, rows), ""]


def _sweep_cell(loss: float | None, chosen: bool) -> str:
    text = "failed" if loss is None else ("diverged" if not math.isfinite(loss) else f"{loss:.4f}")
    return f"**{text}**" if chosen else text


def render_sweep(sweep: Mapping[str, Any]) -> list[str]:
    """The LR sweep table: final val loss of the sweep seed per method and LR, best in bold."""
    lrs = sweep["lrs"]
    rows = []
    for method, losses in sweep["losses"].items():
        best = sweep["best"].get(method)
        cells = [_sweep_cell(losses.get(lr_key(lr)), best is not None and lr == best) for lr in lrs]
        edge = best is not None and len(lrs) > 1 and best in (min(lrs), max(lrs))
        chosen = f"{format_lr(best)}" + (" (edge)" if edge else "") if best else "—"
        rows.append([label(method), *cells, chosen])
    return [
        "## Learning-rate sweep",
        "",
        f"Seed {sweep['seed']} of every method at each LR; each method then ran its other seeds at "
        "its best LR (bold). A best LR at the edge of the sweep means the optimum may lie "
        "outside it.",
        "",
        *table(["method", *(f"lr {format_lr(lr)}" for lr in lrs), "chosen"], rows),
        "",
    ]


def render(summary: Mapping[str, Any]) -> str:
    s = summary["settings"]
    lines = [
        f"# MT-DAO vs baselines: {s.get('model')} model, M = {s.get('workers')}, "
        f"K = {s.get('sync_period')}, {s.get('steps')} steps",
        "",
        *_settings_section(summary),
        "",
        "## Verdict",
        "",
        verdict(summary),
        "",
        *_results_section(summary),
        *_wallclock_section(summary),
        *_alignment_section(summary),
        *(render_sweep(summary["sweep"]) if summary.get("sweep") else []),
        "## Plots",
        "",
        *(f"- {caption}: ![{name}]({name})" for name, caption in PLOTS),
        "",
        *failures_section(summary.get("failures")),
    ]
    if summary.get("missing_methods"):
        lines += [f"No finished runs for: {', '.join(summary['missing_methods'])}.", ""]
    return "\n".join(lines)
