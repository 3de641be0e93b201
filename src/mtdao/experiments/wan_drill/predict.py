"""Time to a target loss beyond the box: DDP, DiLoCo and MT-DAO at 8 .. 1024 workers, 16M .. 7B
parameters, 1 .. 100 Gbit/s, from the drill-calibrated round model (:mod:`.calibration`).

What each local method sends comes from the loss-vs-traffic frontier (``frontier.json`` of
``mtdao frontier``): its cheapest point within :data:`LOSS_TOLERANCE` of its own best loss, in
bytes per parameter per step measured there (relative to DDP's 4), so codecs and state periods
carry over. Every assumption is in :func:`assumptions` (printed next to the table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtdao.experiments.frontier.grid import flag_groups
from mtdao.experiments.wan_drill.calibration import Calibration, heal_seconds, round_seconds

WORKERS = (8, 32, 128, 1024)
PARAMETERS = (16e6, 125e6, 1.3e9, 7e9)
BANDWIDTHS_GBIT = (1.0, 10.0, 100.0)
TOKENS_PER_PARAMETER = 20  # the compute-optimal budget (Hoffmann et al. 2022)
GLOBAL_BATCH_TOKENS = 2**20
WORKER_FLOPS = 8 * 989e12 * 0.4  # a node of 8 accelerators, 989 TFLOP/s bf16 dense, 40 % MFU
RTT_S = 0.080
# a point this close to its method's best loss counts as as good; the cheapest such one is chosen
LOSS_TOLERANCE = 0.005


@dataclass(frozen=True)
class LocalSetting:
    """What a local method sends: one round every ``sync_period`` steps, of
    ``sync_period x bytes_per_parameter_step`` bytes per parameter on average."""

    method: str
    sync_period: int
    bytes_per_parameter_step: float
    flags: str
    loss_vs_ddp: float | None = None  # relative gap of its frontier point, when measured


# Without a frontier: fp32 rounds at K = 32, DiLoCo one tensor, MT-DAO three (parameters and
# both Adam states every round, mtdao train's defaults).
FP32_SETTINGS = {
    "diloco": LocalSetting("diloco", 32, 4 / 32, "K = 32, fp32"),
    "mtdao": LocalSetting("mtdao", 32, 12 / 32, "K = 32, fp32, states every round"),
}


def _described(argv: list[str]) -> str:
    """The point's flags without the ones every point shares."""
    shared = {"--method", "--steps", "--model", "--eval-every", "--eval-tokens"}
    return " ".join(" ".join([f, *v]) for f, v in flag_groups(argv) if f not in shared)


def frontier_settings(frontier: Mapping[str, Any]) -> dict[str, LocalSetting]:
    """DiLoCo's and MT-DAO's settings from a frontier: each one's cheapest point whose loss is
    within :data:`LOSS_TOLERANCE` of its best; bytes per parameter step relative to DDP's."""
    from mtdao.train.command import config_from_argv

    points = frontier["points"]
    ddp = [p for p in points if p["method"] == "ddp"]
    if not ddp:
        raise ValueError("the frontier has no DDP point to measure bytes per parameter against")
    ddp_loss = ddp[0]["final_val_loss_mean"]
    bytes_per_parameter = ddp[0]["bytes_per_worker"] / (
        config_from_argv(ddp[0]["argv"]).training.steps * 4
    )
    settings = {}
    for method in FP32_SETTINGS:
        own = [p for p in points if p["method"] == method]
        if not own:
            raise ValueError(f"the frontier has no {method} point")
        best = min(p["final_val_loss_mean"] for p in own)
        good = [p for p in own if p["final_val_loss_mean"] <= best * (1 + LOSS_TOLERANCE)]
        chosen = min(good, key=lambda p: p["bytes_per_worker"])
        # the point's flags read as mtdao train reads them: its defaults where a flag is absent
        config = config_from_argv(chosen["argv"])
        settings[method] = LocalSetting(
            method,
            config.sync.sync_period,
            chosen["bytes_per_worker"] / (bytes_per_parameter * config.training.steps),
            _described(chosen["argv"]),
            chosen["final_val_loss_mean"] / ddp_loss - 1,
        )
    return settings


def assumptions(settings: Mapping[str, LocalSetting]) -> list[str]:
    sent = "; ".join(
        f"{NAMES[s.method]}: `{s.flags}`, {s.bytes_per_parameter_step * s.sync_period:.3g} bytes "
        f"per parameter every {s.sync_period} steps ({4 / s.bytes_per_parameter_step:.0f}x less "
        "than DDP)" + ("" if s.loss_vs_ddp is None else f", {s.loss_vs_ddp:+.1%} loss vs DDP")
        for s in settings.values()
    )
    gaps = [s.loss_vs_ddp for s in settings.values() if s.loss_vs_ddp is not None]
    measured = (
        f"the local methods' points below ended {min(gaps):+.1%} to {max(gaps):+.1%} from DDP's "
        "loss at equal steps on the frontier"
        if gaps
        else "the local methods' steps to DDP's loss are not measured here"
    )
    return [
        f"- target: {TOKENS_PER_PARAMETER} tokens per parameter at a global batch of "
        f"{GLOBAL_BATCH_TOKENS:,} tokens, so steps = {TOKENS_PER_PARAMETER} N / "
        f"{GLOBAL_BATCH_TOKENS:,} for every method: {measured}, so every row assumes DDP's "
        "steps; DDP / X says how many times more steps X could take and still tie",
        f"- a worker is one node: {WORKER_FLOPS / 1e15:.2f} PFLOP/s effective (8 x 989 TFLOP/s "
        "bf16 at 40 % MFU); compute per step = 6 N x (global batch / M) / that; no "
        "compute-communication overlap (flatters nobody)",
        f"- every worker in a site of its own, on a link of the given bandwidth, {RTT_S * 1e3:.0f} "
        "ms round trip between sites (the drill's)",
        "- DDP: an fp32 gradient ring all-reduce (4 N bytes) every step, in a static process "
        "group (no quorum); each local method as at its cheapest frontier point within "
        f"{LOSS_TOLERANCE:.1%} of its best loss (bytes as measured there, codes, scales and "
        f"padding; a round's bytes averaged over the state periods): {sent}; both local methods "
        "pay the drill-calibrated quorum and commit per round, and their encoded rounds move "
        "like a ring all-reduce of the payload (owners reduce, then every worker gathers)",
        "- latency: the ring's 2 (M - 1) steps each wait one one-way delay; bandwidth at the "
        "calibrated fraction of the link rate; no failures (heal times in their own table)",
    ]


METHODS = ("ddp", "diloco", "mtdao")
NAMES = {"ddp": "DDP", "diloco": "DiLoCo", "mtdao": "MT-DAO"}


@dataclass(frozen=True)
class Prediction:
    method: str
    workers: int
    parameters: float
    bandwidth_gbit: float
    steps: int
    compute_s: float
    communication_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s


def target_steps(parameters: float) -> int:
    return max(int(TOKENS_PER_PARAMETER * parameters / GLOBAL_BATCH_TOKENS), 1)


def predict(
    calibration: Calibration,
    method: str,
    workers: int,
    parameters: float,
    bandwidth_gbit: float,
    settings: Mapping[str, LocalSetting] = FP32_SETTINGS,
) -> Prediction:
    steps = target_steps(parameters)
    compute = steps * 6 * parameters * (GLOBAL_BATCH_TOKENS / workers) / WORKER_FLOPS
    if method == "ddp":
        per_round = round_seconds(
            calibration, 4 * parameters, workers, RTT_S, bandwidth_gbit, False
        )
        communication = steps * per_round
    else:
        setting = settings[method]
        round_bytes = setting.bytes_per_parameter_step * setting.sync_period * parameters
        per_round = round_seconds(calibration, round_bytes, workers, RTT_S, bandwidth_gbit)
        communication = steps // setting.sync_period * per_round
    return Prediction(method, workers, parameters, bandwidth_gbit, steps, compute, communication)


def grid(
    calibration: Calibration, settings: Mapping[str, LocalSetting] = FP32_SETTINGS
) -> list[Prediction]:
    return [
        predict(calibration, method, m, n, b, settings)
        for n in PARAMETERS
        for b in BANDWIDTHS_GBIT
        for m in WORKERS
        for method in METHODS
    ]


def human_time(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def params_label(n: float) -> str:
    return f"{n / 1e9:g}B" if n >= 1e9 else f"{n / 1e6:g}M"


def prediction_table(predictions: list[Prediction]) -> str:
    by_key = {(p.method, p.workers, p.parameters, p.bandwidth_gbit): p for p in predictions}
    lines = ["| params | Gbit/s | workers | steps | DDP | DiLoCo | MT-DAO | DDP / MT-DAO | "
             "DDP / DiLoCo |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for n in PARAMETERS:
        for b in BANDWIDTHS_GBIT:
            for m in WORKERS:
                ddp, diloco, mtdao = (by_key[(x, m, n, b)] for x in METHODS)
                lines.append(
                    f"| {params_label(n)} | {b:g} | {m} | {ddp.steps:,} | {human_time(ddp.total_s)} | "
                    f"{human_time(diloco.total_s)} | {human_time(mtdao.total_s)} | "
                    f"{ddp.total_s / mtdao.total_s:.1f}x | {ddp.total_s / diloco.total_s:.1f}x |"
                )
    return "\n".join(lines)


def heal_table(calibration: Calibration) -> str:
    lines = ["| params | state sent (4 model-sized fp32 tensors) | " +
             " | ".join(f"{b:g} Gbit/s" for b in BANDWIDTHS_GBIT) + " |",
             "|---|---|" + "---|" * len(BANDWIDTHS_GBIT)]  # fmt: skip
    for n in PARAMETERS:
        heal_bytes = 16 * n
        cells = [
            human_time(heal_seconds(calibration, heal_bytes, b, RTT_S)) for b in BANDWIDTHS_GBIT
        ]
        lines.append(
            f"| {params_label(n)} | {heal_bytes / 1e9:.2f} GB | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def plot_predictions(out: Path, predictions: list[Prediction]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PARAMETERS), figsize=(15, 4.2), sharey=True)
    colours = {"ddp": "black", "diloco": "tab:blue", "mtdao": "tab:red"}
    styles = dict(zip(BANDWIDTHS_GBIT, (":", "--", "-")))
    for axis, n in zip(axes, PARAMETERS):
        for method in METHODS:
            for b in BANDWIDTHS_GBIT:
                points = [
                    p
                    for p in predictions
                    if (p.method, p.parameters, p.bandwidth_gbit) == (method, n, b)
                ]
                axis.plot([p.workers for p in points], [p.total_s / 3600 for p in points],
                          color=colours[method], ls=styles[b], marker="o", ms=3,
                          label=f"{method} {b:g} Gbit/s")  # fmt: skip
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(f"{params_label(n)} parameters, {target_steps(n):,} steps")
        axis.set_xlabel("workers (one site each)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("modelled hours to the target loss")
    axes[-1].legend(fontsize=7, ncol=1)
    figure.tight_layout()
    path = out / "beyond.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
