"""What a flood of strangers costs a fault-tolerant run on one machine, in interleaved windows.

Two replicas of ``mtdao train --fault-tolerant`` (micro model) on loopback, without a secret
configured (each proves itself with this account's secret), and a lighthouse; once a fifth of the
steps are done, N bogus replica ids (``tests/rogue_peer.py flood``: each asks for a heartbeat and
a quorum, and again 0.1 s after every refusal) flood the lighthouse in windows of ``--window``
seconds between windows of quiet: quiet, flood, quiet, ..., flood, quiet, ``--seconds`` of flood
in all.
The flood is one process, started (and its start-up waited out) before the first window and
stopped (SIGSTOP) and resumed (SIGCONT) at each window's edge, so every flood window costs the
flood's requests only.

On cores shared with other busy processes the load drifts by as much as the flood costs within
a minute or two: a flood phase against the phase before it measures the drift as much as the
flood. Windows a few seconds long, interleaved, see the same background load on average, so
each flood window is compared with the quiet windows either side. For each replica it prints the
median time between committed rounds in all quiet and all flood windows, and the pace during the
flood: for each flood window, the mean of the median times between rounds of the quiet windows
either side over its own, and the median and range of those; then the rounds discarded, the
lighthouse's last refusal lines, the load average and whether the replicas ended identical.

    OMP_NUM_THREADS=1 python benchmarks/stranger_flood.py --strangers 200 --seconds 60 --nice

``--nice`` runs the flood at the lowest priority, as a stranger on a machine of its own would
cost the replicas nothing of their CPU.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mtdao.testing.fault_drill import Drill

ROGUE = Path(__file__).resolve().parents[1] / "tests" / "rogue_peer.py"
FLOOD_UP_S = 120.0  # the flood's start-up (torch, torchft, 200 threads) on crowded cores
SETTLE_S = 3.0  # after the flood's start-up, before the first window


def gaps(times: list[float], start: float, end: float) -> list[float]:
    """Seconds between consecutive committed rounds within [start, end]."""
    within = [t for t in times if start <= t <= end]
    return [b - a for a, b in zip(within, within[1:])]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def windows(began: float, window_s: float, floods: int) -> list[tuple[bool, float, float]]:
    """(flooded, start, end) of each window: quiet, flood, quiet, ..., flood, quiet."""
    return [(i % 2 == 1, began + i * window_s, began + (i + 1) * window_s)
            for i in range(2 * floods + 1)]  # fmt: skip


def replica_pace(times: list[float], plan: list[tuple[bool, float, float]]) -> dict:
    """The replica's pace in each flood window: the mean of the median gaps of the quiet windows
    either side over its own (the mean of the two follows a steady drift of the background load
    exactly; gaps pooled across windows would lean toward the faster one, which has more), and
    the median gap of all quiet and of all flood windows."""
    by_window = [gaps(times, start, end) for _, start, end in plan]
    quiet = [g for (flooded, _, _), w in zip(plan, by_window) if not flooded for g in w]
    flood = [g for (flooded, _, _), w in zip(plan, by_window) if flooded for g in w]
    each = [
        (median(by_window[i - 1]) + median(by_window[i + 1])) / 2 / median(by_window[i])
        for i, (flooded, _, _) in enumerate(plan)
        if flooded
    ]
    return {
        "quiet_rounds": len(quiet),
        "flood_rounds": len(flood),
        "quiet_median_s": median(quiet),
        "flood_median_s": median(flood),
        "pace": median(each),
        "by_window": each,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strangers", type=int, default=200, help="bogus replica ids (200)")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of flood in all")
    parser.add_argument("--window", type=float, default=10.0, help="seconds a window (10)")
    parser.add_argument("--steps", type=int, default=12000, help="steps of the run (12000)")
    parser.add_argument("--nice", action="store_true", help="the flood at the lowest priority")
    parser.add_argument("--out", type=Path, help="the drill's folder (default: a temporary one)")
    args = parser.parse_args(argv)
    for name in ("strangers", "seconds", "window", "steps"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be > 0, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="stranger-flood-"))
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    import json.decoder
    import json.encoder
    import textwrap

    for module in (json.decoder, json.encoder, textwrap, inspect):
        (corpus / f"{module.__name__}.py").write_text(inspect.getsource(module))
    flags = ["--data", str(corpus), "--no-progress", "--workers", "2", "--model", "micro"]
    flags += ["--collective-timeout", "20", "--connect-timeout", "10", "--quorum-timeout", "60"]
    flags += ["--steps", str(args.steps), "--batch-size", "2", "--seq-len", "16"]
    flags += ["--eval-tokens", "256", "--sync-period", "4", "--log-every", "500"]
    flags += ["--eval-every", str(args.steps)]
    floods = math.ceil(args.seconds / args.window)
    with Drill(out / "drill", flags, join_timeout=10.0) as drill:
        drill.env["XDG_CONFIG_HOME"] = str(out / "config")  # this account's secret, made here
        drill.env.pop("MTDAO_AUTH_TOKEN", None)
        drill.start_lighthouse(min_replicas=2)
        drill.start("r0", 0)
        drill.start("r1", 1)
        fifth = args.steps // 5
        drill.wait_for(lambda: min(drill.status(r)[1] for r in ("r0", "r1")) >= fifth, 600, "")
        drill._spawn("flood", [sys.executable, str(ROGUE), "flood", drill.lighthouse,
                               str(args.strangers)], lowest_priority=args.nice)  # fmt: skip
        drill.wait_for(lambda: "flooding" in drill.log("flood"), FLOOD_UP_S, "the flood")
        flood = drill.processes["flood"].pid
        os.kill(flood, signal.SIGSTOP)
        time.sleep(SETTLE_S)
        load_before = os.getloadavg()
        plan = windows(time.time(), args.window, floods)
        for flooded, _, end in plan:
            os.kill(flood, signal.SIGCONT if flooded else signal.SIGSTOP)
            time.sleep(max(0.0, end - time.time()))
        load_after = os.getloadavg()
        drill.kill("flood")
        for replica in ("r0", "r1"):
            drill.wait_exit(replica, 900)
        print(f"{floods} flood windows of {args.window:g} s between {floods + 1} quiet ones; "
              f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")  # fmt: skip
        cut_short = False
        for replica in ("r0", "r1"):
            times = [event["time"] for event in drill.events(replica, "committed")]
            cut_short |= not times or times[-1] < plan[-1][2]
            pace = replica_pace(times, plan)
            discarded = len(drill.events(replica, "discarded"))
            print(f"{replica}: exit {drill.returncode(replica)}, {discarded} discarded; "
                  f"quiet {pace['quiet_rounds']} rounds, median {pace['quiet_median_s']:.3f} s; "
                  f"flood {pace['flood_rounds']} rounds, median {pace['flood_median_s']:.3f} s")  # fmt: skip
            each = pace["by_window"]
            print(f"{replica}: pace during the flood {pace['pace']:.0%} of the quiet windows' "
                  f"(the median of the flood windows' {min(each):.0%}-{max(each):.0%})")  # fmt: skip
        refusals = [line for line in drill.log("lighthouse").splitlines() if "refused" in line]
        print("\n".join(refusals[-2:]))
        same = drill.rounds("r0")[args.steps] == drill.rounds("r1")[args.steps]
        print(f"replicas identical at step {args.steps}: {same}")
    if cut_short:
        print(f"the run ended before the last window: raise --steps (now {args.steps})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
