"""What a refused call costs ``mtdao lighthouse``: CPU seconds of its process per refusal.

Starts ``mtdao lighthouse`` on loopback (this account's secret) and THREADS bogus replica ids
that each ask it for a heartbeat, on a new connection every time, as a flood does
(``tests/rogue_peer.py flood``), for SECONDS; prints the refusals a second and the lighthouse's
CPU milliseconds per refusal. CPU time, unlike a run's pace, barely depends on what else the
machine runs, so two versions compare on a busy machine:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/front_refusal_cost.py --threads 50
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid``, its ended threads included."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=50, help="bogus replica ids (50)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long they ask (20)")
    args = parser.parse_args(argv)
    from torchft._torchft import LighthouseClient

    env = dict(os.environ, XDG_CONFIG_HOME=tempfile.mkdtemp(prefix="front-cost-"))
    command = [sys.executable, "-m", "mtdao", "lighthouse", "--port", "0", "--min-replicas", "2"]
    lighthouse = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    address = re.search(r"serving at (\S+)", lighthouse.stdout.readline()).group(1)
    refused, stop = [0], threading.Event()

    def bogus() -> None:
        member = f"100:{uuid.uuid4()}"
        while not stop.is_set():
            try:
                client = LighthouseClient(address, timedelta(seconds=5))
                client.heartbeat(member, timeout=timedelta(seconds=5))
            except Exception:  # noqa: BLE001 - refused, as expected
                refused[0] += 1

    time.sleep(2.0)  # the lighthouse's start-up is not what is measured
    before = cpu_seconds(lighthouse.pid)
    for _ in range(args.threads):
        threading.Thread(target=bogus, daemon=True).start()
    time.sleep(args.seconds)
    stop.set()
    spent, count = cpu_seconds(lighthouse.pid) - before, refused[0]
    lighthouse.terminate()
    lighthouse.communicate(timeout=60)
    print(
        f"{count} refused in {args.seconds:g} s ({count / args.seconds:.0f} a second); "
        f"the lighthouse spent {spent:.2f} CPU s: {1000 * spent / max(count, 1):.2f} ms per refusal"
    )


if __name__ == "__main__":
    main()
