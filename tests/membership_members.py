"""Three members of one torchft quorum in one process, as tests/test_ft_auth.py runs them: two
with the run's secret and one with another. Each forms its group with the members it proved and
sums its value over it; prints ``{rank: sum}`` as JSON. Run as a script (a gloo rendezvous that
goes wrong can abort the interpreter)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from mtdao.sync.torchft.auth import RunKey
from mtdao.sync.torchft.plumbing import MembershipGloo

SECRETS = [b"0123456789abcdef0123", b"0123456789abcdef0123", b"another-secret-than-the-runs"]
VALUES = [1.0, 2.0, 10.0]


def main() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}/torchft/1/0"  # torchft's <store>/torchft/<quorum>/<rank>
    groups = [
        MembershipGloo(rank, timedelta(seconds=20), RunKey(secret), proof_wait_s=5.0)
        for rank, secret in enumerate(SECRETS)
    ]
    sums: dict[int, float] = {}

    def member(rank: int) -> None:
        group = groups[rank]
        group.configure(address, f"{rank}:member", rank, len(groups), 1, 0, 1, [0, 1, 2])
        value = torch.tensor([VALUES[rank]])
        group.allreduce([value], dist.AllreduceOptions()).wait()
        sums[rank] = value.item()

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(sums))


if __name__ == "__main__":
    main()
