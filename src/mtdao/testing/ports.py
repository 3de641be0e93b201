"""A TCP port for a server that a process starts a little later (a rendezvous store, a lighthouse).

Asking the kernel for port 0 and closing the socket hands back an *ephemeral* port: the kernel
gives the same range to every outgoing connection and to every listener bound to port 0 (gloo
binds one per peer), so on a busy machine another socket can take the port before the server
binds it, and the server fails with "address already in use". A port below the ephemeral range
is only ever taken by a server that names it, so a free one stays free until it is used.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below: well-known and registered services
ATTEMPTS = 200


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ephemeral ports (Linux's default where it cannot be read)."""
    try:
        low, high = map(int, EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def unused_port() -> int:
    """A port outside the ephemeral range that nothing listens on, on IPv4 and IPv6 alike."""
    low, high = ephemeral_range()
    candidates = [p for p in range(LOWEST_PORT, 65536) if not low <= p <= high]
    rng = random.Random()  # seeded from the OS: concurrent callers draw different ports
    for port in rng.sample(candidates, min(ATTEMPTS, len(candidates))):
        if _bindable(port):
            return port
    raise RuntimeError(
        f"no free TCP port outside the ephemeral range {low}-{high} after {ATTEMPTS} attempts"
    )


def _bindable(port: int) -> bool:
    families = [(socket.AF_INET, "127.0.0.1")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((host, port))
        except OSError as error:
            if family == socket.AF_INET6 and error.errno == errno.EAFNOSUPPORT:  # no IPv6 here
                continue
            return False
    return True
