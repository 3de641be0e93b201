"""An emulated slow link between worker processes: network namespaces on a shaped bridge.

Layout (everything lives inside namespaces this module creates; the root namespace is untouched,
so deleting the namespaces removes every veth and the bridge with them):

    hub namespace      bridge0 ── port0 … port{N-1}        (bridge-side veth ends)
    host namespace i   link0 = 10.213.0.(i+1)/24 ── port i

Each host's ``link0`` egress (upload) and its bridge port's egress (download) pass a token bucket at
``rate_mbit``, so every host has a full-duplex NIC of that rate: bytes from A to B cross A's upload
and B's download shaper, and N senders cannot push N times the rate into one receiver. ``delay_ms``
adds a one-way netem delay on the upload side (needs ``sch_netem`` in the kernel).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

SUBNET = "10.213.0"
HOST_IFACE = "link0"
BRIDGE = "bridge0"
NETNS_ETC = Path("/etc/netns")
_NAME_PART = re.compile(r"[A-Za-z0-9_]{1,32}")
_invocations = iter(range(1 << 62))  # unique suffix per link within one process


class LinkUnavailable(RuntimeError):
    """This machine cannot emulate a link (not root, no iproute2, no namespaces or qdisc)."""


class LinkCommandError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


def _sh(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise LinkCommandError(
            f"`{shlex.join(argv)}` failed (exit {result.returncode}): {result.stderr.strip()}"
        )
    return result.stdout


def _check_available() -> None:
    if os.geteuid() != 0:
        raise LinkUnavailable(
            f"emulated link needs root for network namespaces (euid {os.geteuid()})"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkUnavailable(f"emulated link needs `{tool}` (iproute2), not found on PATH")


def _shaper_commands(ns: str, dev: str, rate_mbit: float, delay_ms: float) -> list[list[str]]:
    """tc commands that rate-limit (and optionally delay) the egress of ``dev`` in ``ns``."""
    rate_bytes = rate_mbit * 1e6 / 8
    # 5 ms of traffic per bucket (at least 16 full frames) keeps short-term bursts close to the rate;
    # the queue holds one RTT plus 50 ms so TCP can fill the link without tail drops.
    burst = max(int(rate_bytes * 0.005), 16 * 1514)
    limit = burst + int(rate_bytes * (0.05 + 2 * delay_ms / 1000))
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]
    tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
    if delay_ms <= 0:
        return [[*tc, "root", "handle", "1:", *tbf]]
    # netem's documented recipe: delay at the root, the rate limiter as its child.
    netem = ["netem", "delay", f"{delay_ms}ms", "limit", str(max(1000, limit // 1000))]
    return [[*tc, "root", "handle", "1:", *netem], [*tc, "parent", "1:1", "handle", "10:", *tbf]]


def _add_qdisc(argv: list[str]) -> None:
    try:
        _sh(*argv)
    except LinkCommandError as error:
        if "qdisc kind is unknown" in str(error):
            kind = argv[argv.index("handle") + 2]
            raise LinkUnavailable(f"kernel lacks the `{kind}` qdisc: {error}") from error
        raise


class EmulatedLink:
    """Namespaces ``hosts[i]`` with address ``addresses[i]``, joined by a link of ``rate_mbit``.

    Build it with :func:`emulated_link`; :meth:`close` tears everything down and is idempotent.
    """

    def __init__(self, num_hosts: int, rate_mbit: float, delay_ms: float, prefix: str) -> None:
        if not 1 <= num_hosts <= 250:
            raise ValueError(f"num_hosts must be in [1, 250], got {num_hosts}")
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        if not delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        if not _NAME_PART.fullmatch(prefix):
            raise ValueError(f"prefix must be 1-32 of [A-Za-z0-9_], got {prefix!r}")
        # The pid in the name lets cleanup_stale tell a dead run's leftovers from a live run's.
        tag = f"{prefix}-{os.getpid()}-{next(_invocations)}"
        self.rate_mbit = float(rate_mbit)
        self.delay_ms = float(delay_ms)
        self.hub = f"{tag}-hub"
        self.hosts = [f"{tag}-h{i}" for i in range(num_hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(num_hosts)]
        self._created: list[str] = []
        self._processes: list[subprocess.Popen] = []
        self._closed = False

    def build(self) -> None:
        try:
            for ns in [self.hub, *self.hosts]:
                self._created.append(ns)  # before `add`, so a half-made namespace is still removed
                _sh("ip", "netns", "add", ns)
        except LinkCommandError as error:
            raise LinkUnavailable(f"cannot create a network namespace: {error}") from error
        _sh("ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", BRIDGE, "up")
        for i, (ns, address) in enumerate(zip(self.hosts, self.addresses)):
            port = f"port{i}"
            _sh("ip", "-n", self.hub, "link", "add", port, "type", "veth",
                "peer", "name", HOST_IFACE, "netns", ns)  # fmt: skip
            _sh("ip", "-n", self.hub, "link", "set", port, "master", BRIDGE, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", HOST_IFACE)
            _sh("ip", "-n", ns, "link", "set", HOST_IFACE, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            for argv in _shaper_commands(ns, HOST_IFACE, self.rate_mbit, self.delay_ms):
                _add_qdisc(argv)
            for argv in _shaper_commands(self.hub, port, self.rate_mbit, 0.0):
                _add_qdisc(argv)

    def run(
        self, host_index: int, argv: list[str], env: dict[str, str] | None = None, **popen_kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` inside host namespace ``host_index``; it is killed at teardown if alive."""
        if self._closed:
            raise RuntimeError("link is closed")
        # `ip netns exec` execs argv, so the Popen's pid is the program itself.
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host_index], *argv], env=env, **popen_kwargs
        )
        self._processes.append(process)
        return process

    def close(self) -> None:
        """Kill processes started by :meth:`run`, delete the namespaces. Safe to call repeatedly."""
        if self._closed:
            return
        with termination_signals_held():
            self._closed = True
            failures = delete_namespaces(list(reversed(self._created)), self._processes)
            self._created.clear()
            raise_failures(failures)


@contextlib.contextmanager
def termination_signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends (in the main thread; elsewhere nothing
    changes): a second Ctrl-C must not leave a half-deleted link."""
    held = {signal.SIGINT, signal.SIGTERM}
    in_main = threading.current_thread() is threading.main_thread()
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held) if in_main else None
    try:
        yield
    finally:
        if previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


@contextlib.contextmanager
def _close_on_sigterm(link: EmulatedLink) -> Iterator[None]:
    """While active, SIGTERM tears the link down, then runs the previous handler or exits 143."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; __exit__ still cleans up
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        yield  # the process chose to survive SIGTERM; so does the link
        return

    def on_sigterm(signum, frame):
        link.close()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def emulated_link(
    num_hosts: int, rate_mbit: float, delay_ms: float = 0.0, prefix: str = "mtdao"
) -> Iterator[EmulatedLink]:
    """Namespaces joined by a ``rate_mbit`` link, removed on exit, exception, Ctrl-C or SIGTERM.

    Raises :class:`LinkUnavailable` (one line, fit for ``pytest.skip``) where it cannot be built.
    """
    _check_available()
    link = EmulatedLink(num_hosts, rate_mbit, delay_ms, prefix)
    with _close_on_sigterm(link):
        try:
            link.build()
            yield link
        finally:
            link.close()


def delete_namespaces(names: list[str], processes: list[subprocess.Popen] = ()) -> list[str]:
    """Kill ``processes`` and whatever else runs in the namespaces, delete them and their
    ``/etc/netns`` files; the failures, as messages (a namespace outlives its deletion while a
    process holds it)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    failures = []
    for ns in names:
        try:
            for pid in _sh("ip", "netns", "pids", ns).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        except LinkCommandError:
            pass  # already gone
        try:
            _sh("ip", "netns", "delete", ns)
        except LinkCommandError as error:
            if "No such file" not in str(error):
                failures.append(str(error))
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    return failures


def raise_failures(failures: list[str]) -> None:
    if failures:
        raise LinkCommandError("teardown incomplete: " + "; ".join(failures))


def cleanup_stale(prefix: str = "mtdao", rest: str = r"(?:hub|h\d+)") -> list[str]:
    """Delete the namespaces ``<prefix>-<pid>-<n>-<rest>`` left by killed runs (their pid is
    gone); returns their names."""
    _check_available()
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-\d+-{rest}")
    names = [line.split(" ", 1)[0] for line in _sh("ip", "netns", "list").splitlines()]
    if NETNS_ETC.is_dir():
        names += [path.name for path in NETNS_ETC.iterdir()]
    stale = sorted(
        {n for n in names if (m := pattern.fullmatch(n)) and not _pid_alive(int(m.group(1)))}
    )
    delete_namespaces(stale)
    return stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_RECEIVER = """
import socket, sys, time
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
received, start = 0, None
while chunk := connection.recv(1 << 20):
    if start is None:
        start, first = time.perf_counter(), len(chunk)
    received += len(chunk)
print(received - first, time.perf_counter() - start, flush=True)
"""

_SENDER = """
import socket, sys
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
block, left = bytes(1 << 16), int(sys.argv[3])
while left > 0:
    connection.sendall(block[: min(left, len(block))])
    left -= len(block)
connection.close()
"""


def measure_throughput_mbit(
    link: EmulatedLink,
    src: int,
    dst: int,
    megabytes: float | None = None,
    timeout_s: float = 60.0,
) -> float:
    """Mbit/s of one TCP stream from host ``src`` to host ``dst`` across ``link``.

    ``megabytes`` defaults to about two seconds of traffic at the link's nominal rate. The clock runs
    from the first received byte to EOF, so connection setup and interpreter start-up do not count.
    """
    if megabytes is None:
        megabytes = max(link.rate_mbit * 2 / 8, 0.5)
    num_bytes = int(megabytes * 1e6)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    receiver = link.run(dst, [sys.executable, "-c", _RECEIVER, link.addresses[dst]], **pipes)
    port = receiver.stdout.readline().strip()
    if not port:
        raise RuntimeError(f"throughput receiver failed: {receiver.communicate()[1].strip()}")
    sender = link.run(
        src,
        [sys.executable, "-c", _SENDER, link.addresses[dst], port, str(num_bytes)],
        **pipes,
    )
    try:
        _, sender_err = sender.communicate(timeout=timeout_s)
        out, receiver_err = receiver.communicate(timeout=timeout_s)
    finally:
        for process in (sender, receiver):
            if process.poll() is None:
                process.kill()
    if sender.returncode != 0 or receiver.returncode != 0:
        raise RuntimeError(f"throughput probe failed: {sender_err.strip()} {receiver_err.strip()}")
    measured_bytes, seconds = (float(x) for x in out.split())
    return measured_bytes * 8 / seconds / 1e6
