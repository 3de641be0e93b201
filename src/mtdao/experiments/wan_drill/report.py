"""The report of ``mtdao wan-drill``: plots of the drill's record and a markdown page.

* ``timeline.png``: every replica's step against wall time, its committed (dots) and discarded
  (crosses) rounds, the events shaded;
* ``loss.png``: validation loss against wall time, the drill's replicas beside the drills
  without events and DDP over the same links;
* ``bytes.png``: bytes each site sent and received.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtdao.experiments.common.figures import saved_figure
from mtdao.experiments.common.formatting import megabytes, table
from mtdao.experiments.wan_drill.checks import Check, mean_final_loss
from mtdao.experiments.wan_drill.summary import event_effects, round_counts, rounds, site_bytes

KIND, SCHEMA = "wan-drill", 1  # results.json (see mtdao.experiments.common.results)

PLAIN = dict(style=None, save_dpi=110)  # the drill's figures: matplotlib's own style
EVENT_COLOURS = {"kill": "tab:red", "partition": "tab:purple", "slow_link": "tab:orange",
                 "straggler": "tab:brown", "lighthouse_restart": "tab:gray"}  # fmt: skip

SECURED = (
    "- as across real sites: every listener serves on its site's address (`--bind-host`; the"
    " lighthouse's front on `--port`), and the replicas prove membership with a random secret"
    " made for this drill (`--auth-token-file`, mode 0600, deleted when the drill ends)"
)

EMULATION = {
    "relay": (
        "- sites: a network namespace each (the lighthouse's too), a veth pair to a hub namespace;"
        " every process has the site's own hostname, resolved by every site to the site's address,"
        " so torchft's manager, store and heal transport and gloo's pairs all dial across the links",
        "- rate: a kernel token bucket on both ends of each veth (upload and download)",
        "- delay, jitter, loss: this kernel has no netem qdisc, so the hub runs a userspace switch"
        " (`mtdao.testing.network.relay`) that holds each Ethernet frame for both links' delays plus"
        " a Gaussian jitter (never reordering a path) and drops it with the links' loss; frames are"
        " the veths' offloaded TCP super-segments, so a loss is a burst of up to 64 KiB",
        "- partition: the switch drops every frame to and from the site; TCP stalls and retransmits"
        " as across a cut link",
        "- slow link: both token buckets changed to the new rate; straggler: a CPU cgroup quota on"
        " the replica's process (a SIGSTOP/SIGCONT duty cycle where there is no CPU cgroup)",
        "- kill: SIGKILL; the replica restarts with the same command line (`--resume`); lighthouse"
        " restart: SIGKILL, the same command after the pause",
    ),
    "netem": (
        "- sites: a network namespace each on a kernel bridge; every process has the site's own"
        " hostname, resolved by every site to the site's address",
        "- rate, delay, jitter, loss: netem at the root of both ends of each veth, a token bucket"
        " as its child; partition: netem loss 100 % on both ends",
        "- slow link: the token buckets changed; straggler: a CPU cgroup quota; kill: SIGKILL",
    ),
}


def step_times(record: dict[str, Any], site: str) -> tuple[list[float], list[int]]:
    """(seconds since the scenario's clock started, step) of ``site``'s samples, when running."""
    points = [(s["time"] - record["t0"], s["steps"][site]) for s in record["samples"]]
    points = [(t, step) for t, step in points if step >= 0]
    return [t for t, _ in points], [step for _, step in points]


def time_of_step(record: dict[str, Any], site: str, step: int) -> float | None:
    """When ``site`` first reached ``step`` (from the samples), in seconds since the clock."""
    times, steps = step_times(record, site)
    best = None
    for t, s in zip(times, steps):
        if s >= step:
            best = t
            break
    return best


def drill_losses(record: dict[str, Any], site: str) -> list[tuple[float, float]]:
    out = []
    for line in record["replicas"][site]["metrics"]:
        if "val_loss" in line:
            # a replica's status names the step it is about to take: the last one it names is
            # the run's last step minus one
            when = time_of_step(record, site, line["step"] - 1)
            if when is not None:
                out.append((when, line["val_loss"]))
    return out


def shade_events(axis, record: dict[str, Any]) -> None:
    for event in record["events"]:
        start = event["began"] - record["t0"]
        end = (event.get("ended") or event["until"]) - record["t0"]
        colour = EVENT_COLOURS[event["kind"]]
        axis.axvspan(start, max(end, start + 0.5), color=colour, alpha=0.18, lw=0)
        axis.text(start, 1.0, " " + event["label"], transform=axis.get_xaxis_transform(),
                  rotation=90, va="top", fontsize=7, color=colour)  # fmt: skip


def plot_timeline(out: Path, record: dict[str, Any]) -> Path:
    """One row per replica: its step against wall time, its rounds, the events shaded."""
    sites = list(record["replicas"])
    path = out / "timeline.png"
    size = (10, 1.2 + 1.9 * len(sites))
    rows = saved_figure(path, len(sites), 1, figsize=size, sharex=True, squeeze=False, **PLAIN)
    with rows as (figure, axes):
        for row, (axis, site) in enumerate(zip(axes[:, 0], sites)):
            times, steps = step_times(record, site)
            colour = f"C{row}"
            axis.plot(times, steps, lw=1.2, color=colour)
            for kind, marker in (("committed", "o"), ("discarded", "x")):
                points = [(e["time"] - record["t0"], e["step"]) for e in rounds(record, site, kind)]
                if points:
                    xs, ys = zip(*points)
                    axis.scatter(xs, ys, marker=marker, s=10 if kind == "committed" else 50,
                                 color=colour if kind == "committed" else "red", zorder=3,
                                 label=kind)  # fmt: skip
            for incarnation in record["replicas"][site]["incarnations"][1:]:
                axis.axvline(incarnation["started"] - record["t0"], color="black", ls=":", lw=1)
            shade_events(axis, record)
            axis.set_ylabel(f"{site}: step")
            if row == 0:
                axis.legend(loc="lower right", fontsize=8)
        axes[-1, 0].set_xlabel("wall time since every replica's first step (s); dotted: a restart")
        figure.suptitle("replicas across the WAN: dots committed rounds, red crosses discarded")
        figure.tight_layout()
    return path


def ddp_losses(ddp: dict[str, Any]) -> list[tuple[float, float]]:
    return [(e["wall_time_s"], e["val_loss"]) for e in ddp["evals"]]


def baseline_summary(record: dict[str, Any]) -> dict[str, Any]:
    """What the report shows of a drill without events: its seed, final loss and loss curve."""
    return {
        "seed": record["settings"].get("seed"),
        "final_val_loss": mean_final_loss(record),  # the statistic the loss check uses
        "curve": drill_losses(record, "r0"),
    }


def plot_loss(out: Path, record, baselines: list[dict], ddp: dict | None) -> Path:
    path = out / "loss.png"
    with saved_figure(path, figsize=(8, 4.8), **PLAIN) as (figure, axis):
        for site in record["replicas"]:
            points = drill_losses(record, site)
            if points:
                axis.plot(*zip(*points), marker="o", ms=3, lw=1.2, label=f"drill {site}")
        for base in baselines:
            if base["curve"]:
                axis.plot(*zip(*base["curve"]), ls="--", color="gray", lw=1,
                          label=f"no events, seed {base['seed']}")  # fmt: skip
        if ddp is not None:
            axis.plot(
                *zip(*ddp_losses(ddp)), color="black", marker="s", ms=3, label="DDP, same links"
            )
        shade_events(axis, record)
        axis.set_xlabel("wall time since the first step (s)")
        axis.set_ylabel("validation loss")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
        figure.tight_layout()
    return path


def plot_bytes(out: Path, record: dict[str, Any]) -> Path:
    counts = site_bytes(record)
    sites = list(counts)
    path = out / "bytes.png"
    with saved_figure(path, figsize=(6, 3.6), **PLAIN) as (figure, axis):
        xs = range(len(sites))
        axis.bar([x - 0.2 for x in xs], [counts[s]["sent"] / 1e6 for s in sites], 0.4, label="sent")
        axis.bar([x + 0.2 for x in xs], [counts[s]["received"] / 1e6 for s in sites], 0.4,
                 label="received")  # fmt: skip
        axis.set_xticks(list(xs), sites)
        axis.set_ylabel("MB on the site's link")
        axis.legend()
        figure.tight_layout()
    return path


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def render(results: dict[str, Any]) -> str:
    """report.md from results.json: the drill's record and checks, the drills without events and
    DDP over the same links beside them."""
    record, baselines, ddp = results["record"], results["baselines"], results["ddp"]
    checks, command = [Check(**check) for check in results["checks"]], results["command"]
    s = record["settings"]
    lines = [f"# WAN drill: scenario `{record['scenario']['name']}`", "", f"    {command}", ""]
    lines += [
        f"{s['replicas']} fault-tolerant replicas of `{s['model']}` (MT-DAO, {s['steps']} steps, "
        f"K = {s['sync_period']}, seed {s['seed']}) and a lighthouse, each in a site of its own; "
        f"emulation: **{record['emulation']}**.",
        "",
    ]
    lines += ["| check | | detail |", "|---|---|---|"]  # the verdicts' column has no name
    lines += [f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.detail} |" for c in checks]
    lines += ["", "## Links", ""]
    lines += table(
        ("site", "rate (Mbit/s)", "one-way delay (ms)", "jitter (ms)", "loss"),
        [
            (site, *(f"{link[key]:g}" for key in ("rate_mbit", "delay_ms", "jitter_ms", "loss")))
            for site, link in record["links"].items()
        ],
    )
    lines += ["", "A path between two sites crosses both sites' links (delays add).", ""]
    # a record from before the drill bound its sites' addresses and shared a secret says nothing
    secured = [SECURED] if record.get("secured") else []
    lines += ["How it is emulated:", "", *EMULATION[record["emulation"]], *secured, ""]
    lines += ["## Events", ""]
    lines += table(
        ("event", "at (s)", "lasted (s)", "time to heal (s)", "group steps lost",
         "replica's absent steps", "rounds discarded"),
        [
            (e["label"], f"{e['at_s']:.1f}", f"{e['for_s']:.1f}", _fmt(e["heal_s"]),
             _fmt(e["steps_lost"], ".0f"), _fmt(e["absent_steps"], "d"), str(e["rounds_discarded"]))
            for e in event_effects(record)
        ],
    )  # fmt: skip
    lines += ["", "Time to heal: from the event's end to the next round all replicas committed "
              "together. Group steps lost: how far the most advanced replica fell behind its pace "
              "before the event, when healed. Absent steps: group steps the struck replica missed "
              "(from its step at the event to the step it healed to).", ""]  # fmt: skip
    lines += ["", "![timeline](timeline.png)", "", "## Rounds and bytes", ""]
    replicas = record["replicas"]
    lines += table(
        ("replica", "rounds committed", "discarded", "incarnations", "final val loss"),
        [
            (site, str(n["committed"]), str(n["discarded"]),
             str(len(replicas[site]["incarnations"])), _fmt(replicas[site]["final_val_loss"], ".4f"))
            for site, n in round_counts(record).items()
        ],
    )  # fmt: skip
    lines += [""]
    lines += table(
        ("site", "MB sent", "MB received"),
        [
            (site, megabytes(n["sent"]), megabytes(n["received"]))
            for site, n in site_bytes(record).items()
        ],
    )
    lines += ["", "![bytes](bytes.png)", "", "## Loss against wall time", ""]
    if baselines:
        finals = ", ".join(
            _fmt(b["final_val_loss"], ".4f") if b["final_val_loss"] is not None
            else "did not finish" for b in baselines
        )  # fmt: skip
        lines.append(f"Drills without events (seeds {[b['seed'] for b in baselines]}): "
                     f"final val loss {finals}.")  # fmt: skip
    if ddp is not None:
        lines.append(
            f"DDP over the same links ({ddp['steps']} steps): final val loss "
            f"{ddp['final_val_loss']:.4f} after {ddp['train_time_s']:.0f} s of training (its "
            "time: training steps with every wait on a collective, evaluation excluded; the "
            "drill's: wall time since every replica's first step)."
        )
    lines += ["", "![loss](loss.png)", ""]
    return "\n".join(lines)
