"""``mtdao slow-link``'s report.md and time_to_loss.png, rendered from the measured rows
(the content of results.json) and the environment they were measured in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mtdao.experiments.common.figures import saved_figure
from mtdao.experiments.common.formatting import format_traffic, megabytes, table

COLUMNS = (
    "rate (Mbit/s)",
    "measured (Mbit/s)",
    "method",
    "steps",
    "final val loss",
    "wall time (s)",
    "s/step",
    "time to DDP's final loss (s)",
    "speedup to DDP's loss",
    "wall at DDP's tokens (s)",
    "val loss at DDP's tokens",
    "iso-token speedup",
    "payload MB/worker",
    "traffic vs DDP",
    "wire MB/worker",
    "compute / comm s per step",
)
NOTES = """\
- wall time: rank 0's training-step seconds (waits on collectives included; start-up and
  evaluation excluded). Speedup = DDP's time / this method's time ("-x% time": faster).
- time to DDP's final loss: first evaluation at or below it, interpolated from the one before.
- payload: bytes the harness averages per worker (model-size buffers, or their encoded blocks and
  scales); traffic vs DDP: DDP's payload per step over this row's; wire: bytes each worker's
  interface sent (ring all-reduce moves ~2(M-1)/M of the payload, as does the quantized exchange,
  plus TCP/IP headers, rendezvous, evaluation averages and loss gathers).
- compute / comm: rank 0's seconds per step outside / inside the averaging calls."""


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


def _speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x ({100 * (1 / value - 1):+.0f}% time)"


def _traffic(reduction: float | None) -> str:
    return "-" if reduction is None else format_traffic(reduction)


def _row(r: Mapping[str, Any]) -> list[str]:
    iso_loss = r.get("iso_token_val_loss")
    return [
        f"{r['rate_mbit']:g}",
        f"{r['measured_mbit']:.1f}",
        r["method"],
        str(r["steps"]),
        f"{r['final_val_loss']:.4f}",
        f"{r['wall_time_s']:.1f}",
        f"{r['wall_time_s'] / max(r['steps'], 1):.3f}",
        _seconds(r.get("time_to_ddp_loss_s")),
        _speedup(r.get("speedup_to_ddp_loss")),
        _seconds(r.get("iso_token_wall_s")),
        "-" if iso_loss is None else f"{iso_loss:.4f}",
        _speedup(r.get("iso_token_speedup")),
        megabytes(r["bytes_per_worker"]),
        _traffic(r.get("comm_reduction_vs_ddp")),
        "-" if r["wire_bytes_per_worker"] is None else megabytes(r["wire_bytes_per_worker"]),
        f"{r['compute_s_per_step']:.3f} / {r['comm_s_per_step']:.3f}",
    ]


def report_table(rows: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(table(COLUMNS, (_row(r) for r in rows)))


def delay_line(row: Mapping[str, Any]) -> str:
    """How the link's delay was made, for the report's first paragraph ('' without one)."""
    delay = row.get("delay_ms") or 0
    if delay <= 0:
        return ""
    how = {
        "netem": "the kernel's netem qdisc",
        "relay": "a userspace switch between the namespaces (this kernel has no netem), which "
        "holds every frame for it",
    }.get(row.get("emulation"), "an unrecorded emulation")
    return f", {delay:g} ms one way between two workers ({2 * delay:g} ms round trip) from {how}"


def run_line(r: Mapping[str, Any]) -> str:
    where = f"- {r['method']} at {r['rate_mbit']:g} Mbit/s: "
    kept = " (kept from an earlier invocation: --keep-finished)" if r.get("kept") else ""
    if r["process_time_s"] is None:
        return (
            f"{where}a finished run kept from an earlier invocation, which did not record its "
            "launch-to-exit time, load or interface bytes (--keep-finished)"
        )
    return (
        f"{where}{r['process_time_s']:.0f} s from launch to exit, load average "
        f"{r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}{kept}"
    )


def render(results: Mapping[str, Any]) -> str:
    """report.md from a results.json: the rows and where they were measured."""
    return render_report(
        results["rows"],
        command=results["command"],
        workers=results["workers"],
        torch=results["torch"],
        cores=results["cores"],
    )


def render_report(
    rows: Sequence[Mapping[str, Any]], *, command: str, workers: int, torch: str, cores: int
) -> str:
    """The whole report.md; ``torch`` and ``cores`` say where it was measured."""
    runs = "\n".join(run_line(r) for r in rows)
    variants = {r["method"]: r["flags"] for r in rows if r.get("flags")}
    if variants:
        listed = "\n".join(f"- {name}: `{flags}`" for name, flags in variants.items())
        runs = f"Variants (`mtdao train` flags on top of the method's):\n\n{listed}\n\n{runs}"
    return f"""# Slow link: DDP vs local updates, measured on an emulated link

Command: `{command}`

{rows[0]["parameters"]:,} parameters, {workers} gloo worker processes (one thread each), one per
network namespace; every byte between them crosses a token-bucket link of the given rate (upload and
download per worker){delay_line(rows[0])}. torch {torch}, {cores} CPU cores.

{report_table(rows)}

{NOTES}

{runs}
"""


def plot_time_to_loss(out: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Validation loss against measured wall-clock, one panel per link rate."""
    rates = sorted({r["rate_mbit"] for r in rows})
    path = Path(out) / "time_to_loss.png"
    size = (5.5 * len(rates), 4.0)
    panels = saved_figure(path, 1, len(rates), figsize=size, dpi=120, squeeze=False, style=None)
    with panels as (fig, axes):
        for ax, rate in zip(axes[0], rates):
            for index, row in enumerate(r for r in rows if r["rate_mbit"] == rate):
                points = [(e["wall_time_s"], e["val_loss"]) for e in row["evals"]]
                ax.plot(*zip(*points), "o-", color=f"C{index}", lw=2, ms=3, label=row["method"])
                if row["method"] == "ddp":
                    ax.axhline(
                        row["final_val_loss"], color="0.5", ls="--", lw=1, label="DDP's final loss"
                    )
            ax.set_title(f"{rate:g} Mbit/s link")
            ax.set_xlabel("wall-clock training seconds (measured)")
            ax.set_ylabel("validation loss (nats/token)")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
    return path


def plot_time_to_target(out: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Seconds to DDP's final loss per row, one panel per link rate ('never' rows unbarred)."""
    rates = sorted({r["rate_mbit"] for r in rows})
    path = Path(out) / "time_to_ddp_loss.png"
    size = (5.5 * len(rates), 0.5 + 0.45 * len(rows))
    with saved_figure(path, 1, len(rates), figsize=size, squeeze=False, style=None) as (fig, axes):
        for ax, rate in zip(axes[0], rates):
            at_rate = [r for r in rows if r["rate_mbit"] == rate]
            names = [r["method"] for r in at_rate]
            times = [r.get("time_to_ddp_loss_s") for r in at_rate]
            ax.barh(names, [t or 0.0 for t in times], color=[f"C{i}" for i in range(len(names))])
            for y, seconds in enumerate(times):
                ax.text(seconds or 0.0, y, f" {_seconds(seconds)}", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_title(f"{rate:g} Mbit/s link: time to DDP's final loss")
            ax.set_xlabel("wall-clock training seconds (measured)")
            ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
    return path
