"""Peers of a replica's heal server for the tests of the heal transport: a server answering every
request with the messages given (a rogue or replaying peer), and a request as anyone can make it."""

from __future__ import annotations

import json

import grpc

from mtdao.ft.security.grpc_front import GrpcFront
from mtdao.ft.security.safe_transport import FETCH


def answering(*messages: bytes) -> GrpcFront:
    """A heal server on loopback answering ``messages`` (its address: ``http://127.0.0.1:port``)."""

    async def answer(message: bytes, peer: tuple[str, int]) -> list[bytes]:
        return list(messages)

    return GrpcFront(
        "rogue heal server", "127.0.0.1", 0, frozenset({FETCH}), answers={FETCH: answer}
    ).start()


def heal_request(url: str, step: int, receiver: str, signature: str) -> list[bytes]:
    """What the heal server at ``url`` answers to this request (raises grpc.RpcError), on a
    connection of its own, as from another process (grpcio shares one within a process)."""
    request = json.dumps({"step": step, "receiver": receiver, "sig": signature}).encode()
    own = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(url.removeprefix("http://"), options=own) as channel:
        return list(channel.unary_stream(FETCH)(request, timeout=5.0))
