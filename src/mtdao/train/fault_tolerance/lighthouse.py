"""``mtdao lighthouse``: the coordinator of a fault-tolerant run (torchft's lighthouse).

Replicas (``mtdao train --fault-tolerant --lighthouse HOST:PORT``) report to it with heartbeats
and ask it for a quorum at every sync; it answers with the replicas alive at that moment. It holds
no training state: while it is away the replicas skip their rounds and train on locally, and they
register again once it is back on the same address. It serves on ``--bind-host`` through
:mod:`mtdao.ft.security.grpc_front`: the two calls of torchft's lighthouse service the replicas make
(quorum and heartbeat), not torchft's unauthenticated web dashboard (which lists replica
addresses and can stop a replica), and one it answers itself (its ``--min-replicas``). With the
run's secret (``--auth-token-file``, ``$MTDAO_AUTH_TOKEN``, or on loopback this account's own, as
the replicas' on this machine), it lets only replicas that prove they belong to the run into its
quorums (:mod:`mtdao.ft.security.lighthouse_gate`).
"""

from __future__ import annotations

import argparse
import signal
import threading

from mtdao.flags import DefaultsHelpFormatter
from mtdao.ft.lines import advertised_host
from mtdao.ft.lines import to_stderr as _say

INSTALL_HINT = 'pip install -c constraints.txt -e ".[ft]"'
STOP_S = 10.0  # what each server's shutdown may take once the lighthouse is told to stop


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "lighthouse",
        help="start the lighthouse of a fault-tolerant run (mtdao train --fault-tolerant)",
        description="Keep track of the live replicas of a fault-tolerant run and form their "
        "quorums. Runs until interrupted (Ctrl-C or SIGTERM stop it cleanly).",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--bind-host",
        default="127.0.0.1",
        help="address to serve on: loopback for replicas on this machine, this machine's address "
        "on the replicas' network for several (see docs/security.md)",
    )
    parser.add_argument("--port", type=int, default=29510, help="port to serve on (0: any free)")
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="replicas a quorum needs to form"
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        help="seconds without a heartbeat after which a replica counts as dead: the time to "
        "detect a failure",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=60.0,
        help="seconds a new quorum waits for live replicas that have not asked to join it yet; "
        "keep it above the time between two syncs, or a replica that waited longer than this to "
        "join makes the next quorum form with whoever asks first (a member a moment late then "
        "misses that sync and is healed at the next)",
    )
    parser.add_argument(
        "--quorum-tick", type=float, default=0.1, help="seconds between checks for a quorum"
    )
    parser.add_argument(
        "--auth-token-file",
        default=None,
        help="a file holding the run's secret, the replicas' too: quorum requests not signed "
        "with it are refused (default: $MTDAO_AUTH_TOKEN; without it, on loopback, this "
        "account's own, as the replicas')",
    )
    parser.set_defaults(func=run_lighthouse)


def run_lighthouse(args: argparse.Namespace) -> int:
    if args.min_replicas < 1:
        raise ValueError(f"--min-replicas must be >= 1, got {args.min_replicas}")
    for name in ("heartbeat_timeout", "join_timeout", "quorum_tick"):
        if not getattr(args, name) > 0:
            flag = name.replace("_", "-")
            raise ValueError(f"--{flag} must be a number of seconds > 0, got {getattr(args, name)}")
    # Until the servers start, Ctrl-C and SIGTERM end the start-up where it is (an import, or
    # the read of a secret from a pipe that nobody writes)
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, _stop_starting)
    try:
        from mtdao.ft import start_lighthouse
    except ModuleNotFoundError as error:
        if error.name != "torchft":
            raise
        raise ValueError(f"the lighthouse needs torchft: {INSTALL_HINT}") from None
    host = args.bind_host.strip("[]")
    if not host:
        raise ValueError("--bind-host is empty; give an address, e.g. 127.0.0.1")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must lie in 0 .. 65535, got {args.port}")
    from mtdao.ft.security.auth import is_loopback, read_token, run_key
    from mtdao.ft.security.grpc_front import GrpcFront
    from mtdao.ft.security.lighthouse_gate import CALLS, LighthouseGate, settings

    token = read_token(args.auth_token_file)
    gate = None
    if token is not None or is_loopback(host):
        gate = LighthouseGate(run_key(token, host), _say)
    # From here they end the wait below: no KeyboardInterrupt can land in a thread or in the
    # middle of shutting the servers down
    stop = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: stop.set())

    # torchft's lighthouse on a loopback port of its own; the replicas reach it through the
    # front, which lets the replicas' calls through and not its dashboard (see grpc_front)
    server = start_lighthouse(
        "127.0.0.1:0", args.min_replicas, args.join_timeout, args.heartbeat_timeout,
        args.quorum_tick,
    )  # fmt: skip
    internal = f"127.0.0.1:{server.address().rsplit(':', 1)[1]}"  # address() names the host
    try:
        front = GrpcFront(
            "lighthouse", host, args.port, CALLS,
            inspect=gate.inspectors() if gate else None, answers=settings(args.min_replicas),
        )  # fmt: skip
    except OSError as error:
        server.shutdown()
        reason = error.strerror
        raise ValueError(f"cannot serve the lighthouse on {host}:{args.port}: {reason}") from None
    front.start(internal)
    address = f"http://{advertised_host(host)}:{front.port}"
    print(
        f"lighthouse: serving at {address} (min replicas {args.min_replicas}, heartbeat timeout "
        f"{args.heartbeat_timeout:g} s, join timeout {args.join_timeout:g} s; no dashboard); "
        "start replicas "
        f"with mtdao train --fault-tolerant --lighthouse {address.split('://')[-1]} ...",
        flush=True,
    )
    if gate is None:
        _say(
            "lighthouse: no --auth-token-file or $MTDAO_AUTH_TOKEN: any process that reaches it "
            "can join its quorums and hold them open (the replicas still refuse it; see "
            "docs/security.md)"
        )
    else:
        _say(f"lighthouse: only replicas that hold {gate.key.origin} join its quorums")
    _say(
        f"lighthouse: torchft's own lighthouse listens behind the front on {internal}, which "
        "every account on this machine can reach (its dashboard lists and stops replicas); on a "
        "shared machine give the run a network namespace of its own (see docs/security.md)"
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        servers = {"its front": front.shutdown, "torchft's lighthouse": server.shutdown}
        stuck = [name for name, shutdown in servers.items() if not _ends(shutdown)]
    late = f" ({' and '.join(stuck)} did not stop within {STOP_S:g} s)" if stuck else ""
    _say("lighthouse: stopped" + late)
    return 0


def _ends(shutdown) -> bool:
    """Whether ``shutdown`` returns within STOP_S: a server that does not stop must not keep
    the lighthouse from ending (its threads end with the process)."""
    thread = threading.Thread(target=shutdown, daemon=True)
    thread.start()
    thread.join(STOP_S)
    return not thread.is_alive()


def _stop_starting(*_) -> None:
    raise KeyboardInterrupt  # mtdao's main says "mtdao lighthouse: interrupted" (exit 130)
