"""A userspace Ethernet switch between WAN sites that delays, jitters, drops and partitions: what
the hub namespace of :mod:`.sites` runs where the kernel has no ``netem`` qdisc. It learns source
MAC addresses like a switch and forwards each frame (read whole from an ``AF_PACKET`` socket)
once its delay has passed; rate limits stay in the kernel's token buckets.

A frame from site i to site j waits ``delay_i + delay_j`` plus a Gaussian jitter of deviation
``sqrt(jitter_i**2 + jitter_j**2)``, never released before the frame ahead of it on its path (TCP
would read reordering as loss), and is dropped with probability ``1 - (1 - loss_i)(1 - loss_j)``.
A partitioned site's frames are dropped both ways, as across a cut link. ``PACKET_VNET_HDR``
keeps segmentation offload: a frame may be a 64 KiB TCP super-segment, so a drop is a burst loss.

    python -m mtdao.testing.network.relay '{"ports": [{"name": "port0", "delay_ms": 20, ...}]}'

It prints ``ready`` once every port is open, then reads JSON commands, one per line, on stdin:
``{"partition": i}``, ``{"heal": i}``, ``{"set": i, "delay_ms": .., "jitter_ms": .., "loss": ..}``,
``{"stats": true}`` (per-port forwarded and dropped frames and bytes, one JSON line). It exits
when stdin closes."""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import select
import socket
import sys
import time
from dataclasses import dataclass, field

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
VNET_HEADER_BYTES = 10  # struct virtio_net_hdr, before every frame read or written
MAX_FRAME = 65536 + 256
BROADCAST = b"\xff" * 6


@dataclass
class Port:
    """One site's port on the switch and the properties of that site's link."""

    name: str
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    partitioned: bool = False
    sock: socket.socket | None = None
    counters: dict = field(default_factory=lambda: dict.fromkeys(
        ("frames_in", "bytes_in", "frames_out", "bytes_out", "dropped", "partition_dropped"), 0
    ))  # fmt: skip


class Switch:
    """Learns MAC addresses, schedules frames by their release time, sends them when due."""

    def __init__(self, ports: list[Port], seed: int = 0) -> None:
        self.ports = ports
        self.where: dict[bytes, int] = {}
        self.queue: list[tuple[float, int, int, bytes]] = []  # (release, order, port, frame)
        self.last_release: dict[tuple[int, int], float] = {}
        self.order = 0
        self.random = random.Random(seed)

    def open(self) -> None:
        for port in self.ports:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
            sock.bind((port.name, 0))
            sock.setblocking(False)
            port.sock = sock

    def receive(self, index: int, now: float) -> None:
        """Take every frame waiting on port ``index`` and schedule it."""
        port = self.ports[index]
        while True:
            try:
                data, address = port.sock.recvfrom(MAX_FRAME)
            except BlockingIOError:
                return
            if address[2] == socket.PACKET_OUTGOING:
                continue  # a frame this switch sent out of the port
            port.counters["frames_in"] += 1
            port.counters["bytes_in"] += len(data) - VNET_HEADER_BYTES
            frame = data[VNET_HEADER_BYTES:]
            self.where[frame[6:12]] = index
            destination = frame[0:6]
            if destination != BROADCAST and destination in self.where:
                targets = [self.where[destination]]
            else:
                targets = [j for j in range(len(self.ports)) if j != index]
            for target in targets:
                self.schedule(index, target, data, now)

    def schedule(self, source: int, target: int, data: bytes, now: float) -> None:
        a, b = self.ports[source], self.ports[target]
        if a.partitioned or b.partitioned:
            a.counters["partition_dropped"] += 1
            return
        survive = (1.0 - a.loss) * (1.0 - b.loss)
        if survive < 1.0 and self.random.random() >= survive:
            a.counters["dropped"] += 1
            return
        delay = (a.delay_ms + b.delay_ms) / 1000
        jitter = math.hypot(a.jitter_ms, b.jitter_ms) / 1000
        if jitter > 0:
            delay = max(0.0, delay + self.random.gauss(0.0, jitter))
        release = max(now + delay, self.last_release.get((source, target), 0.0))
        self.last_release[(source, target)] = release
        self.order += 1
        heapq.heappush(self.queue, (release, self.order, target, data))

    def send_due(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, _, target, data = heapq.heappop(self.queue)
            port = self.ports[target]
            if port.partitioned:
                port.counters["partition_dropped"] += 1
                continue
            try:
                port.sock.send(data)
            except OSError:  # the port's queue is full (its rate limit): dropped, as a router
                port.counters["dropped"] += 1
                continue
            port.counters["frames_out"] += 1
            port.counters["bytes_out"] += len(data) - VNET_HEADER_BYTES

    def command(self, line: str) -> None:
        order = json.loads(line)
        if "partition" in order:
            self.ports[order["partition"]].partitioned = True
        elif "heal" in order:
            self.ports[order["heal"]].partitioned = False
        elif "set" in order:
            port = self.ports[order["set"]]
            for key in ("delay_ms", "jitter_ms", "loss"):
                if key in order:
                    setattr(port, key, float(order[key]))
        elif "stats" in order:
            print(json.dumps({p.name: p.counters for p in self.ports}), flush=True)
            return
        else:
            raise ValueError(f"unknown relay command {line.strip()!r}")
        print("ok", flush=True)


def serve(switch: Switch) -> None:
    socks = {port.sock.fileno(): index for index, port in enumerate(switch.ports)}
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        now = time.monotonic()
        timeout = max(0.0, switch.queue[0][0] - now) if switch.queue else 1.0
        ready, _, _ = select.select([stdin, *socks], [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            if fd == stdin:
                chunk = os.read(stdin, 65536)
                if not chunk:
                    return  # the controller is gone: so is the WAN
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip():
                        switch.command(line.decode())
            else:
                switch.receive(socks[fd], now)
        switch.send_due(time.monotonic())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m mtdao.testing.network.relay CONFIG_JSON", file=sys.stderr)
        return 2
    config = json.loads(argv[0])
    ports = [Port(**spec) for spec in config["ports"]]
    switch = Switch(ports, seed=int(config.get("seed", 0)))
    switch.open()
    print("ready", flush=True)
    serve(switch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
