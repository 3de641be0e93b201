"""Raw HTTP/2 gRPC requests, as a rogue client would send them (no grpcio needed): used by the
tests of mtdao's gRPC fronts (tests/test_grpc_front.py, test_ft_lighthouse.py, test_ft_attacks.py).

``python tests/grpc_calls.py kill HOST:PORT`` sends torchft's ``ManagerService/Kill`` to a
manager and prints what came back.
"""

from __future__ import annotations

import socket
import sys

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, HEADERS, DATA, CONTINUATION, RST_STREAM, GOAWAY = 0x4, 0x1, 0x0, 0x9, 0x3, 0x7
END_STREAM, END_HEADERS = 0x1, 0x4
KILL = "/torchft.ManagerService/Kill"
PERMISSION_DENIED = 7  # the gRPC status of a call a front refused


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def kill_request(msg: str = "stopped by a stranger") -> bytes:
    """torchft's KillRequest {string msg = 1}, protobuf-encoded."""
    text = msg.encode()
    return b"\x0a" + bytes([len(text)]) + text


def http2_request(
    address: str, method: str, path: str, body: bytes | None = None, timeout: float = 10.0
) -> bytes:
    """Send one HTTP/2 request (prior knowledge, as gRPC does; with ``body``, a gRPC message)
    and read until its answer ends (a gRPC status, or the stream or connection reset), the
    connection ends, or it goes quiet for ``timeout`` s: all the other side sent."""
    host, port = address.rsplit(":", 1)
    headers = [(":method", method), (":scheme", "http"), (":path", path), (":authority", host)]
    if body is not None:
        headers += [("content-type", "application/grpc"), ("te", "trailers")]
    block = hpack.Encoder().encode(headers)
    frames = PREFACE + frame(SETTINGS, 0, 0, b"")
    if body is None:
        frames += frame(HEADERS, END_HEADERS | END_STREAM, 1, block)
    else:
        message = b"\x00" + len(body).to_bytes(4, "big") + body  # not compressed, length, body
        frames += frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, END_STREAM, 1, message)
    received = b""
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as connection:
        connection.sendall(frames)
        try:
            while not _ended(received) and (chunk := connection.recv(65536)):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return received


def _ended(received: bytes) -> bool:
    """Whether an answer has ended: a gRPC status, a reset stream (RST_STREAM) or the end of
    the connection (GOAWAY)."""
    return grpc_status(received) is not None or any(
        kind in (RST_STREAM, GOAWAY) for kind, _ in _frames(received)
    )


def grpc_call(address: str, path: str, body: bytes, timeout: float = 10.0) -> bytes:
    return http2_request(address, "POST", path, body, timeout)


def headers_frames(received: bytes) -> int:
    """HEADERS frames (requests, or answers) among the HTTP/2 frames ``received``."""
    return len(header_blocks(received))


def header_blocks(received: bytes) -> list[bytes]:
    """The payload of each HEADERS frame among the HTTP/2 frames ``received``."""
    return [payload for kind, payload in _frames(received) if kind == HEADERS]


def _frames(received: bytes) -> list[tuple[int, bytes]]:
    """(type, payload) of each whole HTTP/2 frame in ``received``."""
    frames, offset = [], len(PREFACE) if received.startswith(PREFACE) else 0
    while offset + 9 <= len(received):
        length, kind = int.from_bytes(received[offset : offset + 3], "big"), received[offset + 3]
        if offset + 9 + length > len(received):
            break
        frames.append((kind, received[offset + 9 : offset + 9 + length]))
        offset += 9 + length
    return frames


def grpc_status(received: bytes) -> int | None:
    """The gRPC status an answer ``received`` ends with (None: no gRPC answer came)."""
    decoder, status = hpack.Decoder(), None
    for block in header_blocks(received):
        for name, value in decoder.decode(block):
            if name == "grpc-status":
                status = int(value)
    return status


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "kill":
        sys.exit("usage: python tests/grpc_calls.py kill HOST:PORT")
    print(grpc_call(sys.argv[2], KILL, kill_request(), timeout=5.0))
