"""The workers of a slow-link run: one ``mtdao train`` process per host of the emulated link,
met as torchrun's static rendezvous meets them, and the bytes each host's interface sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mtdao.testing.network.netem import HOST_IFACE, EmulatedLink
from mtdao.testing.network.relay_link import RelayLink


def worker_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """What torchrun's static rendezvous would set for one worker per node, plus one thread."""
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": HOST_IFACE,
        "OMP_NUM_THREADS": "1",
    }


def launch_workers(
    link: EmulatedLink | RelayLink,
    train_args: list[str],
    port: int,
    log_prefix: Path,
    timeout_s: float,
) -> None:
    """Run ``mtdao train`` as worker i in host i; raise (after killing the rest) if one fails."""
    world_size = len(link.hosts)
    processes = []
    for rank in range(world_size):
        log = open(f"{log_prefix}-rank{rank}.log", "w")  # noqa: SIM115 - closed below
        env = worker_env(rank, world_size, link.addresses[0], port)
        argv = [sys.executable, "-m", "mtdao", "train", *train_args]
        processes.append((link.run(rank, argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [process.poll() for process, _ in processes]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"worker {failed[0]} exited with {codes[failed[0]]}; its log ends:\n"
                    + _tail(Path(f"{log_prefix}-rank{failed[0]}.log"))
                )
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers still running after {timeout_s:.0f} s ({log_prefix})")
            time.sleep(0.2)
    finally:
        for process, log in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def sent_bytes(link: EmulatedLink | RelayLink, host: int) -> int:
    """Bytes host ``host`` has sent through its link interface so far."""
    out = subprocess.run(
        ["ip", "-j", "-s", "-n", link.hosts[host], "link", "show", "dev", HOST_IFACE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
