"""What a flood of strangers costs a fault-tolerant run on one machine, side by side in one run.

Two replicas of ``mtdao train --fault-tolerant`` (micro model) on loopback, without a secret
configured (each proves itself with this account's secret), and a lighthouse; once a fifth of the
steps are done, N bogus replica ids (``tests/rogue_peer.py flood``: each asks for a heartbeat and
a quorum, and again 0.1 s after every refusal) for FOR seconds. Prints each replica's median time
between committed rounds before, during and after the flood, the rounds it discarded, the
lighthouse's refusal line and whether the replicas ended identical.

    OMP_NUM_THREADS=1 python benchmarks/stranger_flood.py --strangers 200 --seconds 60 --nice

``--nice`` runs the flood at the lowest priority, as a stranger on a machine of its own would
cost the replicas nothing of their CPU.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mtdao.testing.fault_drill import Drill

ROGUE = Path(__file__).resolve().parents[1] / "tests" / "rogue_peer.py"


def pace(times: list[float], start: float, end: float) -> tuple[int, float, float]:
    """(rounds, median and longest seconds between committed rounds) within [start, end]."""
    within = [t for t in times if start <= t <= end]
    gaps = [b - a for a, b in zip(within, within[1:])]
    if not gaps:
        return 0, float("nan"), float("nan")
    return len(gaps), statistics.median(gaps), max(gaps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strangers", type=int, default=200, help="bogus replica ids (200)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the flood lasts")
    parser.add_argument("--steps", type=int, default=3000, help="steps of the run (3000)")
    parser.add_argument("--nice", action="store_true", help="the flood at the lowest priority")
    parser.add_argument("--out", type=Path, help="the drill's folder (default: a temporary one)")
    args = parser.parse_args(argv)
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
    with Drill(out / "drill", flags, join_timeout=10.0) as drill:
        drill.env["XDG_CONFIG_HOME"] = str(out / "config")  # this account's secret, made here
        drill.env.pop("MTDAO_AUTH_TOKEN", None)
        drill.start_lighthouse(min_replicas=2)
        drill.start("r0", 0)
        drill.start("r1", 1)
        fifth = args.steps // 5
        drill.wait_for(lambda: min(drill.status(r)[1] for r in ("r0", "r1")) >= fifth, 600, "")
        began = time.time()
        nice = ["nice", "-n", "19"] if args.nice else []
        flood = [*nice, sys.executable, str(ROGUE), "flood", drill.lighthouse]
        drill._spawn("flood", [*flood, str(args.strangers)])
        time.sleep(args.seconds)
        drill.kill("flood")
        ended = time.time()
        for replica in ("r0", "r1"):
            drill.wait_exit(replica, 900)
        for replica in ("r0", "r1"):
            times = [event["time"] for event in drill.events(replica, "committed")]
            parts = {
                "before": pace(times, 0.0, began),
                "during": pace(times, began, ended),
                "after": pace(times, ended, float("inf")),
            }
            shown = ", ".join(f"{k} {n} rounds, median {m:.3f} s, max {x:.3f} s"
                              for k, (n, m, x) in parts.items())  # fmt: skip
            discarded = len(drill.events(replica, "discarded"))
            print(f"{replica}: exit {drill.returncode(replica)}, {discarded} discarded; {shown}")
            before, during = parts["before"][1], parts["during"][1]
            print(f"{replica}: pace during the flood {before / during:.0%} of the pace before")
        refusals = [line for line in drill.log("lighthouse").splitlines() if "refused" in line]
        print("\n".join(refusals[-2:]))
        same = drill.rounds("r0")[args.steps] == drill.rounds("r1")[args.steps]
        print(f"replicas identical at step {args.steps}: {same}")


if __name__ == "__main__":
    main()
