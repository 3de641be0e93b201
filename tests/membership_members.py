"""Three members of one torchft quorum in one process, as tests/test_ft_auth.py runs them: two
with the run's secret and one with another, each having proven what its secret lets it prove
(the two each other, the third itself). Each forms its group with the members it proved, where
and as a replica would (:mod:`mtdao.ft.quorum_plan`), and sums its value over it;
prints ``{rank: sum}`` as JSON. Run as a script (a gloo rendezvous that goes wrong can abort the
interpreter)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from mtdao.ft.quorum_plan import plan_quorum, rendezvous
from mtdao.ft.security.auth import RunKey
from mtdao.ft.security.proofs import Claim
from mtdao.ft.security.torchft_internals import GlooGroup

SECRETS = [b"0123456789abcdef0123", b"0123456789abcdef0123", b"another-secret-than-the-runs"]
VALUES = [1.0, 2.0, 10.0]


def main() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    claims = [
        Claim(r, f"{r}:member", 1, 4, "c", 1, f"127.0.0.1:{store.port}", ("http://x/heal/",))
        for r in range(3)
    ]
    proven = {0: claims[:2], 1: claims[:2], 2: claims[2:]}
    sums: dict[int, float] = {}

    def member(rank: int) -> None:
        key = RunKey(SECRETS[rank])
        mine = claims[rank].member
        plan = plan_quorum(proven[rank], mine, 0, rendezvous(key, "digest", proven[rank]))
        group = GlooGroup("127.0.0.1", timedelta(seconds=20), rendezvous_timeout=20.0)
        ranks = [c.replica_id for c in plan.members]
        group.configure(f"{plan.store}/0", mine, plan.rank, len(ranks), 1, 0, 1, ranks)
        value = torch.tensor([VALUES[rank]])
        group.allreduce([value], dist.AllreduceOptions()).wait()
        sums[rank] = value.item()

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(len(claims))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(sums))


if __name__ == "__main__":
    main()
