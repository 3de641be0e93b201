"""WAN sites on one machine: a network namespace per site, each linked to a hub by a shaped link.

    hub namespace     port0 … port{N-1}          a switch: the kernel bridge with netem, or
                                                 :mod:`.relay` where the kernel has no netem
    site namespace i  link0 = 10.214.0.(i+1)/24 ── port i

Each site's link has its own rate (a token bucket on both veth ends), one-way delay, jitter and
loss (:class:`LinkSpec`); a path between two sites crosses both links. A partition drops every
frame of the site. Every program runs in its site with a hostname of its own that every site
resolves to the site's address, since torchft advertises ``socket.gethostname()``: a replica's
peers then dial its site's address, through the shaped links."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, replace

from mtdao.testing.network import netem
from mtdao.testing.network.netem import (
    NETNS_ETC,
    LinkCommandError,
    LinkUnavailable,
    _sh,
    delete_namespaces,
    raise_failures,
    termination_signals_held,
)

SUBNET = "10.214.0"
SITE_IFACE = "link0"
_invocations = iter(range(1 << 62))


@dataclass(frozen=True)
class LinkSpec:
    """One site's link to the WAN core. A site-to-site path crosses two links."""

    rate_mbit: float = 100.0
    """Token-bucket rate, each direction."""
    delay_ms: float = 20.0
    """One-way delay of this link: two sites with the defaults are 40 ms apart (80 ms RTT)."""
    jitter_ms: float = 1.0
    """Standard deviation of each frame's extra delay."""
    loss: float = 0.0005
    """Probability a frame is dropped on this link (about 0.1 % over a site-to-site path)."""

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"link rate_mbit must be > 0, got {self.rate_mbit}")
        for name in ("delay_ms", "jitter_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"link {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"link loss must be in [0, 1), got {self.loss}")


def tbf_arguments(rate_mbit: float, delay_ms: float) -> list[str]:
    """A token bucket of ``rate_mbit`` whose queue holds a round trip plus 50 ms."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.005), 16 * 1514)
    limit = burst + int(rate_bytes * (0.05 + 4 * delay_ms / 1000))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]


def netem_arguments(link: LinkSpec, partitioned: bool = False) -> list[str]:
    loss = 100.0 if partitioned else link.loss * 100
    argv = ["netem", "delay", f"{link.delay_ms}ms"]
    if link.jitter_ms > 0:
        argv += [f"{link.jitter_ms}ms", "distribution", "normal"]
    return argv + ["loss", f"{loss}%", "limit", "100000"]


def kernel_has_netem(namespace: str) -> bool:
    try:
        _sh("tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except LinkCommandError as error:
        if "qdisc kind is unknown" in str(error):
            return False
        raise
    _sh("tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root")
    return True


class WanSites:
    """Named sites, each a namespace on its own link; build with :meth:`build`, end with
    :meth:`close` (idempotent; kills what :meth:`run` started, deletes namespaces and files)."""

    def __init__(
        self,
        links: dict[str, LinkSpec],
        prefix: str = "mtdaowan",
        emulation: str = "auto",
        seed: int = 0,
    ) -> None:
        if not 1 <= len(links) <= 250:
            raise ValueError(f"between 1 and 250 sites, got {len(links)}")
        if emulation not in ("auto", "netem", "relay"):
            raise ValueError(f"emulation must be auto, netem or relay, got {emulation!r}")
        for name in links:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", name):
                raise ValueError(f"site names are 1-16 of [a-z0-9], starting a-z: {name!r}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", prefix):
            raise ValueError(f"prefix must be 1-16 of [a-z0-9], starting a-z: {prefix!r}")
        tag = f"{prefix}-{os.getpid()}-{next(_invocations)}"
        self.prefix, self.seed, self.requested = prefix, seed, emulation
        self.links = dict(links)
        self.names = list(links)
        self.hub = f"{tag}-hub"
        self.namespaces = {name: f"{tag}-{name}" for name in self.names}
        self.addresses = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(self.names)}
        self.hostnames = {name: f"{prefix}-{name}" for name in self.names}
        self.emulation = ""
        self.partitioned: set[str] = set()
        self._created: list[str] = []
        self._processes: list[subprocess.Popen] = []
        self._relay: subprocess.Popen | None = None
        self._relay_lock = threading.Lock()
        self._closed = False

    # -- building ---------------------------------------------------------------------------

    def build(self) -> None:
        try:
            for ns in [self.hub, *self.namespaces.values()]:
                self._created.append(ns)  # before `add`: a half-made namespace is still removed
                _sh("ip", "netns", "add", ns)
        except LinkCommandError as error:
            raise LinkUnavailable(f"cannot create a network namespace: {error}") from error
        has_netem = kernel_has_netem(self.hub)
        if self.requested == "netem" and not has_netem:
            raise LinkUnavailable("--emulation netem: this kernel has no netem qdisc")
        self.emulation = "netem" if has_netem and self.requested != "relay" else "relay"
        _sh("ip", "netns", "exec", self.hub, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.addresses[n]} {self.hostnames[n]}\n" for n in self.names
        )
        for i, name in enumerate(self.names):
            ns, port = self.namespaces[name], f"port{i}"
            _sh("ip", "-n", self.hub, "link", "add", port, "type", "veth",
                "peer", "name", SITE_IFACE, "netns", ns)  # fmt: skip
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", SITE_IFACE)
            for dev_ns, dev in ((ns, SITE_IFACE), (ns, "lo"), (self.hub, port)):
                _sh("ip", "-n", dev_ns, "link", "set", dev, "up")
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts)
            for dev_ns, dev in ((ns, SITE_IFACE), (self.hub, port)):
                for argv in self._qdisc_commands("add", dev_ns, dev, self.links[name]):
                    _sh(*argv)
        if self.emulation == "netem":
            _sh("ip", "-n", self.hub, "link", "add", "bridge0", "type", "bridge")
            _sh("ip", "-n", self.hub, "link", "set", "bridge0", "up")
            for i in range(len(self.names)):
                _sh("ip", "-n", self.hub, "link", "set", f"port{i}", "master", "bridge0")
        else:
            self._start_relay()

    def _qdisc_commands(self, verb: str, ns: str, dev: str, link: LinkSpec, partitioned=False):
        tc = ["tc", "-n", ns, "qdisc", verb, "dev", dev]
        tbf = tbf_arguments(link.rate_mbit, link.delay_ms)
        if self.emulation == "relay":
            return [[*tc, "root", "handle", "1:", *tbf]]
        # netem's recipe: delay at the root, the rate limiter as its child. A frame from site i
        # to site j leaves i's link0 and j's port: each end carries its own link's full delay.
        netem = netem_arguments(link, partitioned)
        return [
            [*tc, "root", "handle", "1:", *netem],
            [*tc, "parent", "1:1", "handle", "10:", *tbf],
        ]

    def _start_relay(self) -> None:
        ports = [
            {"name": f"port{i}", "delay_ms": link.delay_ms, "jitter_ms": link.jitter_ms,
             "loss": link.loss}
            for i, link in enumerate(self.links.values())
        ]  # fmt: skip
        config = json.dumps({"ports": ports, "seed": self.seed})
        argv = [
            "ip",
            "netns",
            "exec",
            self.hub,
            sys.executable,
            "-m",
            "mtdao.testing.network.relay",
        ]
        self._relay = subprocess.Popen(
            [*argv, config], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = self._relay.stdout.readline().strip()
        if ready != "ready":
            raise LinkUnavailable(f"the WAN relay did not start (said {ready!r})")

    def _relay_command(self, order: dict) -> str:
        with self._relay_lock:
            self._relay.stdin.write(json.dumps(order) + "\n")
            self._relay.stdin.flush()
            return self._relay.stdout.readline().strip()

    # -- running programs in sites ----------------------------------------------------------

    def run(self, site: str, argv: list[str], env=None, **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` in ``site`` under the site's hostname; killed at :meth:`close`."""
        if self._closed:
            raise RuntimeError("the sites are closed")
        wrapper = ["ip", "netns", "exec", self.namespaces[site], "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', self.hostnames[site]]  # fmt: skip
        process = subprocess.Popen([*wrapper, *argv], env=env, **popen_kwargs)
        self._processes.append(process)
        return process

    # -- events -----------------------------------------------------------------------------

    def set_rate(self, site: str, rate_mbit: float) -> None:
        """Change the rate of ``site``'s link, both directions, queued frames kept."""
        link = replace(self.links[site], rate_mbit=rate_mbit)
        self.links[site] = link
        self._change_qdiscs(site)

    def _change_qdiscs(self, site: str) -> None:
        port = f"port{self.names.index(site)}"
        for ns, dev in ((self.namespaces[site], SITE_IFACE), (self.hub, port)):
            commands = self._qdisc_commands(
                "change", ns, dev, self.links[site], site in self.partitioned
            )
            for argv in commands:
                _sh(*argv)

    def partition(self, site: str) -> None:
        """Drop every frame to and from ``site`` until :meth:`heal`."""
        self.partitioned.add(site)
        if self.emulation == "relay":
            self._relay_command({"partition": self.names.index(site)})
        else:
            self._change_qdiscs(site)

    def heal(self, site: str) -> None:
        self.partitioned.discard(site)
        if self.emulation == "relay":
            self._relay_command({"heal": self.names.index(site)})
        else:
            self._change_qdiscs(site)

    def interface_bytes(self, site: str) -> dict[str, int]:
        """Bytes ``site`` has sent and received on its link so far."""
        out = _sh("ip", "-j", "-s", "-n", self.namespaces[site], "link", "show", "dev", SITE_IFACE)
        stats = json.loads(out)[0]["stats64"]
        return {"sent": int(stats["tx"]["bytes"]), "received": int(stats["rx"]["bytes"])}

    # -- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        with termination_signals_held():
            self._closed = True
            processes = [*self._processes, *([self._relay] if self._relay else [])]
            failures = delete_namespaces(list(reversed(self._created)), processes)
            self._created.clear()
            raise_failures(failures)


@contextlib.contextmanager
def exit_on_sigterm():
    """While active, SIGTERM raises SystemExit(143), so that ``finally`` blocks tear sites down
    (signal handlers can only be set from the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def cleanup_stale(prefix: str = "mtdaowan") -> list[str]:
    """Delete namespaces left by killed runs with ``prefix`` (their pid is gone); their names."""
    return netem.cleanup_stale(prefix, rest="[a-z0-9]+")


def live_namespaces(prefix: str) -> list[str]:
    """Namespaces whose name starts with ``prefix-`` (for tests: none should outlive a drill)."""
    lines = _sh("ip", "netns", "list").splitlines()
    return [line.split(" ", 1)[0] for line in lines if line.startswith(f"{prefix}-")]
