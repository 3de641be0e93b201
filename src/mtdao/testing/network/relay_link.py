"""The slow link with a delay on a kernel without ``netem``: the same hosts as
:func:`mtdao.testing.network.netem.emulated_link` (interface ``link0``, a token-bucket link of the
rate) on :class:`WanSites` whose hub runs the userspace switch (:mod:`.relay`). A frame crosses
two sites' links, so each link gets half of the one-way delay asked for."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
from collections.abc import Iterator

from mtdao.testing.network.netem import EmulatedLink, _check_available, _sh
from mtdao.testing.network.netem import emulated_link as netem_link
from mtdao.testing.network.sites import LinkSpec, WanSites, exit_on_sigterm, kernel_has_netem

_probes = itertools.count(1 << 20)  # beside the links' own numbers, in netem's naming scheme


class RelayLink:
    """What the slow link's runner uses of :class:`EmulatedLink` (hosts by index, their
    addresses, ``run``, the rate), on :class:`WanSites` sites ``h0`` .. ``h{n-1}``."""

    def __init__(self, sites: WanSites, rate_mbit: float, delay_ms: float) -> None:
        self.sites, self.rate_mbit, self.delay_ms = sites, float(rate_mbit), float(delay_ms)
        self.hosts = [sites.namespaces[name] for name in sites.names]
        self.addresses = [sites.addresses[name] for name in sites.names]

    def run(self, host_index: int, argv: list[str], env=None, **popen_kwargs) -> subprocess.Popen:
        return self.sites.run(self.sites.names[host_index], argv, env=env, **popen_kwargs)


def netem_missing(prefix: str) -> bool:
    """Whether this kernel lacks the ``netem`` qdisc (tried in a namespace made for it)."""
    _check_available()
    probe = f"{prefix}-{os.getpid()}-{next(_probes)}-hub"  # netem.cleanup_stale's pattern
    _sh("ip", "netns", "add", probe)
    try:
        return not kernel_has_netem(probe)
    finally:
        _sh("ip", "netns", "delete", probe)


@contextlib.contextmanager
def slow_link(
    num_hosts: int, rate_mbit: float, delay_ms: float, prefix: str
) -> Iterator[EmulatedLink | RelayLink]:
    """``num_hosts`` hosts on a ``rate_mbit`` link with ``delay_ms`` one way between any two:
    netem's where the kernel has it or no delay is asked for, else the relay's. Removed on exit,
    exception, Ctrl-C or SIGTERM; raises ``LinkUnavailable`` where it cannot be built."""
    if delay_ms <= 0 or not netem_missing(prefix):
        with netem_link(num_hosts, rate_mbit, delay_ms, prefix=prefix) as link:
            yield link
        return
    if not 1 <= num_hosts <= 250:
        raise ValueError(f"num_hosts must be in [1, 250], got {num_hosts}")
    spec = LinkSpec(rate_mbit=rate_mbit, delay_ms=delay_ms / 2, jitter_ms=0.0, loss=0.0)
    sites = WanSites({f"h{i}": spec for i in range(num_hosts)}, prefix=prefix, emulation="relay")
    with exit_on_sigterm():  # SIGTERM unwinds through the finally below
        try:
            sites.build()
            yield RelayLink(sites, rate_mbit, delay_ms)
        finally:
            sites.close()


def emulation_of(link: EmulatedLink | RelayLink) -> str:
    """How the link's delay is made: ``netem``, ``relay`` or ``none`` (no delay)."""
    if isinstance(link, RelayLink):
        return "relay"
    return "netem" if link.delay_ms > 0 else "none"
