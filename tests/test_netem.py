"""The emulated link really is shaped, connects every pair of hosts, and always cleans up after itself.

Needs root, iproute2 and namespace support; skips with the reason otherwise.
"""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from wait_limits import first_line, limit_s

from mtdao.testing.network.netem import (
    LinkUnavailable,
    cleanup_stale,
    emulated_link,
    measure_throughput_mbit,
)
from mtdao.testing.network.relay_link import emulation_of, slow_link

PREFIX = "mtdaotest"
# a plain Python client (no torch) against servers already listening: one start at most
CLIENT_S = limit_s(starts=1)
TRANSFER_S = 2  # seconds of traffic at the link's rate that the throughput test sends
# the sender's start beside the receiver, then the transfer at the link's rate
THROUGHPUT_S = limit_s(starts=1, processes=2, sat_out_s=TRANSFER_S)
TEARDOWN_S = 60  # `ip netns del` per namespace: ip commands, slow under load, not CPU work


@pytest.fixture(autouse=True)
def require_link():
    try:
        with emulated_link(1, 10.0, prefix=PREFIX):
            pass
    except LinkUnavailable as error:
        pytest.skip(str(error))


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split(" ", 1)[0] for line in out.splitlines()]


def leftovers(names: list[str]) -> list[str]:
    """Any of ``names`` still present as a namespace or as a root-namespace interface."""
    links = subprocess.run(["ip", "link"], capture_output=True, text=True, check=True).stdout
    return [name for name in names if name in namespaces() or name in links]


ECHO_SERVER = """
import socket, sys
server = socket.socket(); server.bind((sys.argv[1], 7000)); server.listen(8)
print("ready", flush=True)
while True:
    connection, _ = server.accept(); connection.sendall(connection.recv(64)); connection.close()
"""

ECHO_CLIENT = """
import socket, sys
for address in sys.argv[1:]:
    connection = socket.create_connection((address, 7000), timeout=5)  # listening: a hang guard
    connection.sendall(address.encode()); assert connection.recv(64) == address.encode()
print("ok", flush=True)
"""


def test_throughput_matches_rate_and_teardown_is_complete():
    rate_mbit = 50.0
    with emulated_link(2, rate_mbit, prefix=PREFIX) as link:
        names = [link.hub, *link.hosts]
        assert link.addresses == ["10.213.0.1", "10.213.0.2"]
        assert all(name in namespaces() for name in names)
        megabytes = rate_mbit * TRANSFER_S / 8
        measured = measure_throughput_mbit(link, 0, 1, megabytes=megabytes, timeout_s=THROUGHPUT_S)
        print(f"measured {measured:.1f} Mbit/s over a {rate_mbit} Mbit/s link")
        assert 0.5 * rate_mbit < measured < 1.2 * rate_mbit
    assert leftovers(names) == []


def test_every_host_reaches_every_other_over_tcp():
    with emulated_link(3, 100.0, prefix=PREFIX) as link:
        pipes = {"stdout": subprocess.PIPE, "text": True}
        servers = [
            link.run(i, [sys.executable, "-c", ECHO_SERVER, address], **pipes)
            for i, address in enumerate(link.addresses)
        ]
        started_s = limit_s(processes=len(servers))
        assert all(first_line(server, started_s).strip() == "ready" for server in servers)
        for i in range(3):
            others = [address for j, address in enumerate(link.addresses) if j != i]
            client = link.run(i, [sys.executable, "-c", ECHO_CLIENT, *others], **pipes)
            assert client.communicate(timeout=CLIENT_S)[0].strip() == "ok"
    # The echo servers never exit by themselves: teardown must have killed them.
    assert all(server.poll() is not None for server in servers)


def test_teardown_on_exception():
    with pytest.raises(ZeroDivisionError), emulated_link(2, 10.0, prefix=PREFIX) as link:
        names = [link.hub, *link.hosts]
        raise ZeroDivisionError("raised inside the block")
    assert leftovers(names) == []
    link.close()  # idempotent


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_teardown_when_process_is_signalled(signum):
    script = textwrap.dedent(f"""
        import signal, time
        # A shell's background job inherits SIGINT ignored; a user at a terminal has Python's.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from mtdao.testing.network.netem import emulated_link
        with emulated_link(2, 10.0, prefix={PREFIX!r}) as link:
            print(" ".join([link.hub, *link.hosts]), flush=True)
            time.sleep(30)
    """)
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        names = first_line(process, limit_s()).split()
        assert len(names) == 3 and all(name in namespaces() for name in names)
        process.send_signal(signum)
        process.wait(timeout=TEARDOWN_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0
    if signum == signal.SIGTERM:
        assert process.returncode == 128 + signal.SIGTERM
    assert leftovers(names) == []


def test_cleanup_stale_removes_only_dead_runs():
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read()) + 1  # no process can have it
    dead = f"{PREFIX}-{dead_pid}-0-h0"
    live = f"{PREFIX}-{os.getpid()}-999-h0"
    for name in (dead, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert cleanup_stale(PREFIX) == [dead]
        assert dead not in namespaces() and live in namespaces()
    finally:
        for name in (dead, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


CONNECT_PROBE = textwrap.dedent("""
    import socket, sys, time
    start = time.perf_counter()
    socket.create_connection((sys.argv[1], 7000), timeout=5).close()  # listening: a hang guard
    print(time.perf_counter() - start)
""")


def connect_seconds(link) -> float:
    """Seconds host 0 takes to open a TCP connection to host 1 (one round trip)."""
    pipes = {"stdout": subprocess.PIPE, "text": True}
    server = link.run(1, [sys.executable, "-c", ECHO_SERVER, link.addresses[1]], **pipes)
    assert first_line(server, limit_s()).strip() == "ready"
    client = link.run(0, [sys.executable, "-c", CONNECT_PROBE, link.addresses[1]], **pipes)
    return float(client.communicate(timeout=CLIENT_S)[0])


def test_delay_is_applied():
    with contextlib.ExitStack() as stack:
        try:
            link = stack.enter_context(emulated_link(2, 50.0, delay_ms=10.0, prefix=PREFIX))
        except LinkUnavailable as error:
            pytest.skip(str(error))
        assert connect_seconds(link) >= 0.9 * 2 * 0.010  # a handshake crosses the delay twice


def test_the_slow_link_has_its_delay_with_netem_or_without():
    """Where the kernel has no netem the slow link's delay comes from the WAN relay; either way a
    handshake takes the round trip, and nothing is left behind."""
    with slow_link(2, 50.0, delay_ms=40.0, prefix=PREFIX) as link:
        names = list(link.hosts)
        assert emulation_of(link) in ("netem", "relay")
        assert 0.9 * 2 * 0.040 <= connect_seconds(link) < 2 * 0.040 + 0.5
    assert leftovers(names) == []
