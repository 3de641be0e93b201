"""A front for one of torchft's gRPC servers: a grpcio server that takes each call whole, checks it
against the allowed methods (and ``inspect``), and makes it again as a client of the server
behind, so no byte of a caller's reaches torchft (docs/security.md, "The fronts": the limits,
holds and refusal lines). It knows nothing of torchft: its users name the calls."""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import ipaddress
import math
import resource
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import unquote

import grpc
from grpc import aio

from mtdao.ft.lines import shown_address, to_stderr
from mtdao.ft.refusals import Refusal, RefusalLog

# Limits and holds: docs/security.md, "The fronts", gives each with its why.
CONNECTIONS = 512  # below the usual 1024 descriptors: a flood leaves the process some
STREAMS = 16  # calls at once per connection (a replica makes one or two)
CALLS = 1024  # calls in flight on a front; more are answered RESOURCE_EXHAUSTED at once
HEADER_BYTES = 16 << 10
MESSAGE_BYTES = 1 << 20  # a replica's signed claim is a few kilobytes
ANSWER_BYTES = 64 << 20  # a quorum carries every member's claim
HANDSHAKE_S = 10.0
IDLE_S = 60.0
MESSAGE_S = 10.0  # from a call's headers to its whole request message
REFUSAL_HOLD_S = 1.0
HOLD_AFTER = 10  # refusals of one host within a second from which its refusals are held
HOLD_TICK_S = 0.05  # held refusals end together on ticks this far apart (one timer a tick)
SAY_EVERY_S = 60.0
SAY_BURST = 20  # lines per SAY_EVERY_S in all; the rest counted in one line
MAX_TRACKED = 4096
SHOWN_PATH_CHARS = 80


class GrpcFront(grpc.GenericRpcHandler):
    """Serves ``host``:``port`` (0: any), making each call of ``allowed`` (full gRPC paths;
    ``local_only``: to this machine's callers only; ``inspect``: path -> check of the message
    and the caller's (host, port), which says why not itself) again on the server behind, or
    answering it itself (``answers``: path -> coroutine of the message and the caller giving
    the answer's messages, or None to refuse it as a failed check).
    ``name`` is whose front it is in ``report``'s lines. Raises OSError when it cannot serve."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        allowed: frozenset[str],
        report: Callable[[str], None] | None = None,
        local_only: frozenset[str] = frozenset(),
        inspect: dict[str, Callable[[bytes, tuple[str, int]], bool]] | None = None,
        answers: dict[str, Answer] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.allowed = name, allowed
        self.local_only = local_only & allowed
        self.inspect, self.answers = inspect or {}, answers or {}
        self.report = report or to_stderr
        self.clock = clock
        self.refusal_hold_s, self.hold_after = REFUSAL_HOLD_S, HOLD_AFTER
        self.refused = 0
        self._recent: dict[str, collections.deque] = {}  # each host's last refusal times
        self._lines = RefusalLog(
            SAY_EVERY_S, SAY_BURST, clock, "calls of other kinds in the last {s} s"
        )
        self._upstream: set[aio.UnaryUnaryCall] = set()  # calls waiting on the server behind
        self._calls = 0  # calls in flight
        self._holds: dict[int, list[asyncio.Future]] = {}  # tick -> the refusals it ends
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}  # by allowed path
        self._channel: aio.Channel | None = None
        self._stopped = threading.Event()
        self.host = numeric_host(host)
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self._server, self.port = on_loop(self._bind(f"{shown}:{port}"))
        if not self.port:
            raise OSError(errno.EADDRINUSE, f"cannot serve {shown}:{port}")

    def start(self, upstream: str | None = None) -> GrpcFront:
        """Serve, making each allowed call again on ``upstream`` (``host:port``; None: every
        allowed call is answered by the front)."""
        on_loop(self._start(upstream))
        threading.Thread(target=self._watch_descriptors, daemon=True).start()
        return self

    def shutdown(self) -> None:
        self._stopped.set()
        on_loop(self._stop())

    def end_calls(self) -> int:
        """Fail every call waiting on the server behind now; how many there were."""
        return on_loop(self._cancel_calls())

    async def _bind(self, address: str) -> tuple[aio.Server, int]:
        # no maximum_concurrent_rpcs: grpcio's limiter costs every call a task and a lock, and
        # while full stops taking calls, members' among them; the front counts its own (CALLS)
        server = aio.server(
            handlers=[self],
            options=[
                ("grpc.so_reuseport", 0),  # no other socket may share the port
                ("grpc.enable_channelz", 0),  # no bookkeeping of each connection and call
                ("grpc.http2.bdp_probe", 0),  # no pings to size windows: calls are small
                ("grpc.max_allowed_incoming_connections", CONNECTIONS),
                ("grpc.max_concurrent_streams", STREAMS),
                ("grpc.max_metadata_size", HEADER_BYTES),
                ("grpc.absolute_max_metadata_size", HEADER_BYTES),
                ("grpc.max_receive_message_length", MESSAGE_BYTES),
                ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_S * 1000)),
                ("grpc.max_connection_idle_ms", int(IDLE_S * 1000)),
            ],
        )
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        return server, port

    async def _start(self, upstream: str | None) -> None:
        if upstream is not None:
            self._channel = aio.insecure_channel(
                upstream,
                options=[
                    ("grpc.max_receive_message_length", ANSWER_BYTES),
                    ("grpc.enable_retries", 0),  # a call is made once, as its caller made it
                ],
            )
        await self._server.start()

    async def _stop(self) -> None:
        await self._server.stop(grace=None)
        if self._channel is not None:
            await self._channel.close()

    async def _cancel_calls(self) -> int:
        calls = list(self._upstream)
        for call in calls:
            call.cancel()
        return len(calls) + sum(self._end_hold(tick) for tick in list(self._holds))

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """Every method, read and answered as a stream (a missing message is bounded by MESSAGE_S;
        a unary caller gets its one answer as it would from a unary method)."""
        method = details.method
        path = method if isinstance(method, str) else method.decode("ascii", "backslashreplace")
        handler = self._handlers.get(path)
        if handler is None:
            handler = grpc.stream_stream_rpc_method_handler(functools.partial(self.call, path))
            if path in self.allowed:  # a stranger's paths are not kept
                self._handlers[path] = handler
        return handler

    async def call(self, path: str, requests, context: aio.ServicerContext) -> None:
        """One call: counted, checked, then made again on the server behind or answered by the
        front (its messages are read and written through ``context``, not ``requests``)."""
        if self._calls >= CALLS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {self.name}'s front is serving {CALLS} calls",
            )
        self._calls += 1
        try:
            for answer in await self._checked(path, context):
                await context.write(answer)
        finally:
            self._calls -= 1

    async def _checked(self, path: str, context: aio.ServicerContext) -> Iterable[bytes]:
        peer = _peer(context.peer())
        served = self.allowed if from_this_machine(peer[0]) else self.allowed - self.local_only
        if path not in served:
            where = " (served to this machine's processes only)" if path in self.local_only else ""
            await self._refuse(context, peer, f"a call of {_shown(path)}{where}", served)
        # The first message is judged before the rest is read: a refusal costs one read.
        deadline = asyncio.get_running_loop().time() + MESSAGE_S
        message, why = await _next_message(context, deadline)
        check = self.inspect.get(path)
        if message is not None and check is not None and not check(message, peer):
            await self._refuse(context, peer, None, served)
        if message is not None:  # then the end of its messages, and nothing else
            more, end = await _next_message(context, deadline)
            if end is not EOF_SEEN:
                message, why = None, "with more than one message" if more is not None else end
        if message is None and why in (None, EOF_SEEN):  # the caller ended it (or it left)
            await context.abort(grpc.StatusCode.CANCELLED, "the call ended without its message")
        if message is None:
            await self._refuse(context, peer, f"a call of {_shown(path)} {why}", served)
        if path in self.answers:
            answer = await self.answers[path](message, peer)
            if answer is None:
                await self._refuse(context, peer, None, served)
            return answer
        upstream = self._channel.unary_unary(path)(message, timeout=context.time_remaining())
        self._upstream.add(upstream)
        try:
            return [await upstream]
        except aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
        except asyncio.CancelledError:
            if not upstream.cancelled():
                raise  # the caller went away
            await context.abort(grpc.StatusCode.CANCELLED, f"ended by the {self.name}'s front")
        finally:
            self._upstream.discard(upstream)

    async def _refuse(
        self, context: aio.ServicerContext, peer: tuple[str, int], what: str | None, served
    ) -> None:
        """Count, say (``what``: None when a check said why) and end a refusal, held if flooding."""
        self.refused += 1
        if what is not None:
            self._say(peer, what, served)
        if self._flooding(peer[0]):
            self._calls -= 1  # held, it takes no member's call (connections and streams bound it)
            try:
                await self._hold()
            finally:
                self._calls += 1  # given back by call() as it ends
        why = self._served_line(served) if what is not None else "it did not pass its check"
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED, f"refused by the {self.name}'s front: {why}"
        )

    async def _hold(self) -> None:
        """Wait ``refusal_hold_s`` (to the next tick), or until :meth:`end_calls`."""
        loop = asyncio.get_running_loop()
        tick = math.ceil((loop.time() + self.refusal_hold_s) / HOLD_TICK_S)
        ended = self._holds.get(tick)
        if ended is None:
            ended = self._holds[tick] = []
            loop.call_at(tick * HOLD_TICK_S, self._end_hold, tick)
        hold = loop.create_future()
        ended.append(hold)
        await hold

    def _end_hold(self, tick: int) -> int:
        held = [hold for hold in self._holds.pop(tick, ()) if not hold.done()]
        for hold in held:
            hold.set_result(None)
        return len(held)

    def _say(self, peer: tuple[str, int], what: str, served) -> None:
        """Each kind of refusal said once a minute at most, with a count (:mod:`.refusals`)."""
        line = f"{what} from {shown_address(peer)}; {self._served_line(served)}"
        for said in self._lines.lines([Refusal(peer=what, line=line)]):
            self.report(f"{self.name}'s front: {said}")

    def _served_line(self, served) -> str:
        names = ", ".join(sorted(p.rsplit("/", 1)[-1] for p in served))
        return f"only {names} calls are served to it" if names else "no call is served to it"

    def _flooding(self, host: str) -> bool:
        """Whether ``host`` had ``hold_after`` refusals within a second (a replica's own few
        first heartbeats go unheld)."""
        now = time.monotonic()
        if len(self._recent) > MAX_TRACKED:  # many hosts: forget the quiet ones
            self._recent = {h: t for h, t in self._recent.items() if now - t[-1] < 1.0}
        recent = self._recent.setdefault(host, collections.deque(maxlen=self.hold_after))
        recent.append(now)
        return len(recent) == self.hold_after and now - recent[0] < 1.0

    def _watch_descriptors(self) -> None:
        """Say, once a minute at most, when gRPC leaves connections waiting for descriptors."""
        said_at = -float("inf")
        while not self._stopped.wait(1.0):
            if not _out_of_descriptors() or self.clock() - said_at < SAY_EVERY_S:
                continue
            said_at = self.clock()
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self.report(
                f"{self.name}'s front: this process has used all {limit} of its file "
                "descriptors; new connections wait until some close (raise the limit with "
                "ulimit -n, or firewall the port to the run's machines)"
            )


Answer = Callable[[bytes, tuple[str, int]], Awaitable[Iterable[bytes] | None]]


EOF_SEEN = "the end of the call's messages"


async def _next_message(
    context: aio.ServicerContext, deadline: float
) -> tuple[bytes | None, str | None]:
    """(next message, None), (None, EOF_SEEN), or (None, why not: None when the caller ended
    it), waiting until ``deadline`` at most, on a timer rather than a task of its own."""
    task, late = asyncio.current_task(), []

    def give_up() -> None:
        late.append(True)
        task.cancel()

    timer = asyncio.get_running_loop().call_at(deadline, give_up)
    try:
        message = await context.read()
    except asyncio.CancelledError:
        if not late:
            raise  # the caller went away
        if hasattr(task, "uncancel"):  # Python 3.11: this cancellation is handled here
            task.uncancel()
        return None, f"without its message within {MESSAGE_S:g} s"
    except aio.AioRpcError:
        return None, None
    finally:
        timer.cancel()
    return (None, EOF_SEEN) if message is aio.EOF else (message, None)


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def on_loop(coroutine):
    """``coroutine``'s result, run on the event loop every front of this process shares."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(
                target=_loop.run_forever, name="mtdao-grpc-fronts", daemon=True
            ).start()
    return asyncio.run_coroutine_threadsafe(coroutine, _loop).result()


def from_this_machine(host: str) -> bool:
    """Whether ``host`` is a loopback address or one of this machine's own (a socket binds it)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if address.is_loopback:
        return True
    if address.is_unspecified or address.is_multicast:
        return False
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def _peer(peer: str) -> tuple[str, int]:
    """gRPC's ``ipv4:1.2.3.4:5`` / ``ipv6:[::1]:5`` as (host, port)."""
    _, _, address = unquote(peer).partition(":")
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def numeric_host(host: str) -> str:
    """``host`` (an address or a name; brackets allowed) as a numeric address."""
    host = host.strip("[]")
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def _out_of_descriptors() -> bool:
    """Whether this process holds as many file descriptors as it may."""
    try:
        with open("/dev/null", "rb"):
            return False
    except OSError as error:
        return error.errno in (errno.EMFILE, errno.ENFILE)


def _shown(path: str) -> str:
    """A requested path as a refusal line shows it: printable, and short."""
    text = "".join(c if c.isprintable() else "?" for c in path) or "(no path)"
    return text if len(text) <= SHOWN_PATH_CHARS else text[:SHOWN_PATH_CHARS] + "..."
