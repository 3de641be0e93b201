"""What a run protects from this machine's other accounts, and how to shut them out.

torchft's own servers (the lighthouse, and each replica's manager) listen on loopback addresses
behind mtdao's fronts, with no way to bind them elsewhere or to check who connects: every
account on the machine can reach them. So the start-up lines say so, and docs/security.md tells
how to isolate a run: a network namespace of its own, whose loopback no other process shares.
This test runs that recipe (``unshare``): a lighthouse in a namespace of its own serves there,
and its port is out of reach from outside."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest
from wait_limits import first_line, limit_s

pytest.importorskip("torchft")
pytest.importorskip("grpc")


def namespace_command() -> list[str]:
    """``unshare`` into a network namespace of its own (as root, or as a user through a user
    namespace), or a skip when this machine allows neither."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2)")
    for command in (["unshare", "--net"], ["unshare", "--map-root-user", "--net"]):
        if subprocess.run([*command, "true"], capture_output=True).returncode == 0:
            return command
    pytest.skip("this account may not make a network namespace")


@pytest.mark.slow
def test_a_lighthouse_in_a_network_namespace_of_its_own_is_out_of_reach_from_outside():
    unshare = namespace_command()
    # hold the port here, bound but not listening: nothing outside the namespace answers on it
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        script = f"ip link set lo up && exec {sys.executable} -m mtdao lighthouse --port {port}"
        process = subprocess.Popen(
            [*unshare, "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = first_line(process, limit_s())
            assert f"serving at http://127.0.0.1:{port}" in line, line
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=limit_s()).close()
        finally:
            process.terminate()
            _, errors = process.communicate(timeout=limit_s())
    assert "listens behind the front on 127.0.0.1:" in errors, errors
    assert "every account on this machine can reach" in errors, errors
    assert "lighthouse: stopped" in errors, errors
