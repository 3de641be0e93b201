"""Time to a target loss beyond the box: DDP, DiLoCo and MT-DAO at 8 .. 1024 workers, 16M .. 7B
parameters, 1 .. 100 Gbit/s, from the drill-calibrated round model (:mod:`.wan_calibration`).

Every assumption is in :data:`ASSUMPTIONS` (printed next to the table): what a worker computes,
how many steps the target takes, what each method sends per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtdao.experiments.wan_calibration import Calibration, heal_seconds, round_seconds

WORKERS = (8, 32, 128, 1024)
PARAMETERS = (16e6, 125e6, 1.3e9, 7e9)
BANDWIDTHS_GBIT = (1.0, 10.0, 100.0)
TOKENS_PER_PARAMETER = 20  # the compute-optimal budget (Hoffmann et al. 2022)
GLOBAL_BATCH_TOKENS = 2**20
WORKER_FLOPS = 8 * 989e12 * 0.4  # a node of 8 accelerators, 989 TFLOP/s bf16 dense, 40 % MFU
SYNC_PERIOD = 32
RTT_S = 0.080

ASSUMPTIONS = (
    f"- target: {TOKENS_PER_PARAMETER} tokens per parameter at a global batch of "
    f"{GLOBAL_BATCH_TOKENS:,} tokens, so steps = {TOKENS_PER_PARAMETER} N / {GLOBAL_BATCH_TOKENS:,} "
    "for every method: MT-DAO at the frontier's best settings (beta warm-up, K = 32) tied DDP's "
    "loss at equal steps in the horizon study (micro model, 3000 steps); DiLoCo's steps to a "
    "common target are not measured here (it never reached DDP's loss), so its row assumes DDP's "
    "steps and the break-even column says how many times more steps it could take and still tie",
    f"- a worker is one node: {WORKER_FLOPS / 1e15:.2f} PFLOP/s effective (8 x 989 TFLOP/s bf16 "
    "at 40 % MFU); compute per step = 6 N x (global batch / M) / that; no compute-communication "
    "overlap (flatters nobody)",
    f"- every worker in a site of its own, on a link of the given bandwidth, {RTT_S * 1e3:.0f} ms "
    "round trip between sites (the drill's)",
    "- DDP: an fp32 gradient ring all-reduce (4 N bytes) every step, in a static process group "
    "(no quorum); DiLoCo: one model-sized fp32 tensor (4 N bytes) every K = 32 steps; MT-DAO: "
    "three (parameters and both Adam states, 12 N bytes) every K = 32 steps, as this repository "
    "sends them; both local methods pay the drill-calibrated quorum and commit per round",
    "- latency: the ring's 2 (M - 1) steps each wait one one-way delay; bandwidth at the "
    "calibrated fraction of the link rate; no failures (heal times in their own table)",
)

METHODS = ("ddp", "diloco", "mtdao")


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
    calibration: Calibration, method: str, workers: int, parameters: float, bandwidth_gbit: float
) -> Prediction:
    steps = target_steps(parameters)
    compute = steps * 6 * parameters * (GLOBAL_BATCH_TOKENS / workers) / WORKER_FLOPS
    if method == "ddp":
        per_round = round_seconds(
            calibration, 4 * parameters, workers, RTT_S, bandwidth_gbit, False
        )
        communication = steps * per_round
    else:
        tensors = 1 if method == "diloco" else 3
        per_round = round_seconds(
            calibration, 4 * tensors * parameters, workers, RTT_S, bandwidth_gbit
        )
        communication = steps // SYNC_PERIOD * per_round
    return Prediction(method, workers, parameters, bandwidth_gbit, steps, compute, communication)


def grid(calibration: Calibration) -> list[Prediction]:
    return [
        predict(calibration, method, m, n, b)
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
