"""Heal state that cannot carry code (``torch.load(weights_only=True)``, never torchft's
unpickling transport), requests and states signed over the quorum, sender, receiver, process and
step, served by a front like torchft's servers', with their caps (docs/security.md, "Heal
state")."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import itertools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc
import torch

from mtdao.ft.lines import advertised_host, first_line
from mtdao.ft.security.auth import RunKey
from mtdao.ft.security.grpc_front import GrpcFront, on_loop
from mtdao.ft.security.torchft_internals import CheckpointTransport

FETCH = "/mtdao.Heal/Fetch"  # {"step", "receiver", "sig"}: the state's signature, then its chunks
URL_PATTERN = re.compile(r"^http://[^/?#\s]+$")
CHUNK_BYTES = 1 << 20  # a state's messages (gRPC's messages stop at 2 GiB; a client's at 4 MiB)
QUORUM_SKEW_S = 5.0
"""How long a heal request signed for a quorum this replica has not opened yet waits for it."""
UNVERIFIED_WAITING = 64
"""Requests not verified yet that may wait at once; the rest are refused at once, so a stranger's
unsigned requests cannot fill the front's calls (a member's proven request is verified at once)."""
ASK_AGAIN_S = 0.25  # a member's request refused at once is made again this much later


class HealRefused(ConnectionError):
    """A peer's heal state was not taken (unreachable, unsigned, not loadable)."""


@dataclass(frozen=True)
class HealBinding:
    """What a state and its request are bound to (``group_rank``: each process heals its own)."""

    digest: str
    source: str
    receiver: str
    group_rank: int
    step: int

    def fields(self) -> tuple[object, ...]:
        return (self.digest, self.source, self.receiver, self.group_rank, self.step)


@dataclass(frozen=True)
class Quorum:
    """The quorum this process serves in, and the members that may ask for its state."""

    digest: str
    member: str
    group_rank: int
    receivers: frozenset[str]


class SignedHealTransport(CheckpointTransport):
    def __init__(self, key: RunKey, bind_host: str, timeout: timedelta) -> None:
        self.key, self.timeout = key, timeout
        self.received_bytes = 0
        self.quorum: Quorum | None = None
        self._served: tuple[int, bytes, str] | None = None  # step, payload, its SHA-256
        self._changed = asyncio.Event()  # set, and replaced, on the fronts' loop at each change
        self._unverified = 0  # requests waiting for a quorum that verifies them
        answers = {FETCH: self._answer}
        self._front = GrpcFront("heal server", bind_host, 0, frozenset(answers), answers=answers)
        self._front.start()
        self.advertised = advertised_host(bind_host)

    @property
    def address(self) -> tuple[str, int]:
        return self._front.host, self._front.port

    def metadata(self) -> str:
        return f"http://{self.advertised}:{self._front.port}"

    def open(self, quorum: Quorum) -> None:
        """Answer requests signed for ``quorum`` from now on (they wait for its state)."""
        self.quorum = quorum
        on_loop(self._notify())

    def serve(self, step: int, state_dict: Any) -> None:
        """Serve ``state_dict`` (a CPU copy) at ``step`` until :meth:`disallow_checkpoint`."""
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        payload = buffer.getvalue()
        self._served = (step, payload, _sha(payload))
        on_loop(self._notify())

    def send_checkpoint(self, dst_ranks, step: int, state_dict: Any, timeout) -> None:
        raise NotImplementedError("a state is served bound to its quorum: serve()")

    def disallow_checkpoint(self) -> None:
        self._served = None  # the healed peers have it by now

    async def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _answer(self, message: bytes, peer: tuple[str, int]) -> Iterable[bytes] | None:
        """For a request signed for this quorum, this source and the receiver it names: the
        state's header (its size and signatures, :func:`_header`), then the state in chunks (nothing: no state served at its step within
        the timeout); None (refused) for any other, after QUORUM_SKEW_S for a quorum its sender
        learned of first (at once past UNVERIFIED_WAITING such waits)."""
        try:
            request = json.loads(message)
            step, receiver = int(request["step"]), str(request["receiver"])
            signature = request["sig"]
        except (TypeError, ValueError, KeyError, RecursionError, OverflowError):  # int(inf)
            return None

        def binding() -> HealBinding | None:
            quorum = self.quorum
            if quorum is None or receiver not in quorum.receivers:
                return None
            bound = HealBinding(quorum.digest, quorum.member, receiver, quorum.group_rank, step)
            return bound if self.key.verifies(signature, "fetch", *bound.fields()) else None

        def at_step() -> tuple[int, bytes, str] | None:
            served = self._served
            return served if served is not None and served[0] == step else None

        bound = binding()
        if bound is None and self._unverified < UNVERIFIED_WAITING:
            self._unverified += 1
            try:
                bound = await self._once(binding, QUORUM_SKEW_S)
            finally:
                self._unverified -= 1
        served = await self._once(at_step, self.timeout.total_seconds()) if bound else None
        if served is None:
            return None if bound is None else []
        _, payload, sha = served
        chunks = (payload[at : at + CHUNK_BYTES] for at in range(0, len(payload), CHUNK_BYTES))
        header = {
            "bytes": len(payload),
            "size_sig": self.key.sign("heal-size", *bound.fields(), len(payload)),
            "sig": self.key.sign("heal", *bound.fields(), sha),
        }
        return itertools.chain([json.dumps(header).encode()], chunks)

    async def _once(self, value: Callable[[], Any], seconds: float) -> Any:
        """``value()`` once it is not None, asked again at each change, ``seconds`` at most."""
        deadline = time.monotonic() + seconds
        while (found := value()) is None and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):  # not TimeoutError on Python 3.10
                await asyncio.wait_for(self._changed.wait(), left)
        return found

    def fetch(self, url: str, binding: HealBinding, peer: str) -> Any:
        """The state ``peer`` serves at its heal address ``url`` for ``binding``, or HealRefused."""
        if not isinstance(url, str) or not URL_PATTERN.match(url):
            raise HealRefused(f"not healing from {peer}: its heal address {url!r} is no URL")
        signed = self.key.sign("fetch", *binding.fields())
        request = json.dumps({"step": binding.step, "receiver": binding.receiver, "sig": signed})
        unsigned = HealRefused(
            f"{peer} at {url} sent a state not signed for this quorum and this replica with "
            "this run's secret: refused, nothing of it was read"
        )

        def read(answers: Iterator[bytes]) -> tuple[str, bytes] | None:
            """The state's signature and bytes, read no further than the size it signed."""
            header = next(answers, b"")
            if not header:
                return None
            try:
                header = json.loads(header)
                size, signature = header["bytes"], header["sig"]
                signed = self.key.verifies(header["size_sig"], "heal-size", *binding.fields(), size)
            except (TypeError, ValueError, KeyError, RecursionError):
                signed = False
            if not signed:
                raise unsigned
            parts, read_bytes = [], 0
            for part in answers:
                read_bytes += len(part)
                if read_bytes > size:
                    raise HealRefused(
                        f"{peer} at {url} sent more than the {size:,} bytes it signed"
                    )
                parts.append(part)
            return signature, b"".join(parts)  # copied once, not at each growth

        try:
            answer = self._ask(url, request.encode(), read)
        except grpc.RpcError as error:
            why = f"{error.code().name}: {error.details()}"
            raise HealRefused(f"{peer} at {url} did not send its state: {why}") from None
        if answer is None:
            raise HealRefused(
                f"{peer} at {url} did not send its state: it served none at step {binding.step}"
            )
        signature, payload = answer
        if not self.key.verifies(signature, "heal", *binding.fields(), _sha(payload)):
            raise unsigned
        try:
            state = torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as error:  # signed, yet damaged: a faulty member, not an attack
            raise HealRefused(
                f"{peer} sent a state that does not load: {first_line(error, 200)}"
            ) from None
        self.received_bytes = len(payload)
        return state

    def _ask(self, url: str, request: bytes, read: Callable[[Iterator[bytes]], Any]) -> Any:
        """What ``read`` makes of ``url``'s answers to ``request``; asked again while
        refused at once within QUORUM_SKEW_S (a source whose quorum is not open yet refuses at
        once while UNVERIFIED_WAITING requests wait, a stranger's among them)."""
        deadline = time.monotonic() + QUORUM_SKEW_S
        with grpc.insecure_channel(url.removeprefix("http://")) as channel:
            while True:
                try:
                    timeout = self.timeout.total_seconds()
                    return read(channel.unary_stream(FETCH)(request, timeout=timeout))
                except grpc.RpcError as error:
                    refused = error.code() == grpc.StatusCode.PERMISSION_DENIED
                    if not refused or time.monotonic() + ASK_AGAIN_S >= deadline:
                        raise
                time.sleep(ASK_AGAIN_S)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout) -> Any:
        raise NotImplementedError("a state is fetched bound to its quorum: fetch()")

    def shutdown(self, wait: bool = True) -> None:
        self._front.shutdown()


def _sha(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()
