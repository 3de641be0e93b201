"""Bit parity after a committed round (mtdao.sync.torchft.parity), with test doubles: three
replicas in threads, their tables summed as the round's all-reduce would, each with a model that
a round has just made identical. One perturbed after the round is named by every member with the
tensor that differs, and gives up the round's commit so that it heals next; a round without a
majority names both; an exchange that fails leaves the round unchecked, said in one line."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")

from mtdao.sync.torchft.parity import ParityCheck, combined_digest, tensor_digest  # noqa: E402

REPLICAS, COMMITS = 3, 7
BARRIER_S = 10.0  # three threads meeting in memory


class SummedTables:
    """The all-reduce of the round's group: every replica's table, summed, handed to each."""

    def __init__(self, replicas: int) -> None:
        self.barrier = threading.Barrier(replicas)
        self.tables: dict[int, torch.Tensor] = {}

    def __call__(self, quorum, table: torch.Tensor) -> torch.Tensor:
        self.tables[quorum.rank] = table.clone()
        self.barrier.wait(BARRIER_S)
        total = sum(self.tables.values())
        self.barrier.wait(BARRIER_S)  # each has its sum before the next exchange writes
        return total


class Manager:
    def __init__(self) -> None:
        self.commits = {"step": COMMITS, "batches_committed": 3 * COMMITS}

    def state_dict(self) -> dict:
        return dict(self.commits)

    def load_state_dict(self, state: dict) -> None:
        self.commits = dict(state)


def replica(rank: int, exchange) -> SimpleNamespace:
    """A replica whose round just assigned the same parameters and Adam states as the others'."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    names = {id(params[0]): "weight", id(params[1]): "bias"}
    sync = SimpleNamespace(params=params, param_names=names, optimizer=optimizer, step_count=40)
    lines: list[str] = []
    parity = ParityCheck(say=lines.append)
    parity.sync, parity.exchange = sync, exchange
    quorum = SimpleNamespace(
        members=[10, 11, 12][: exchange.barrier.parties],
        rank=rank,
        manager=Manager(),
        processes=SimpleNamespace(sum=lambda number: number),
    )
    round_tensors = params + [optimizer.state[p][k] for p in params for k in ("exp_avg",)]
    return SimpleNamespace(parity=parity, quorum=quorum, lines=lines, tensors=round_tensors)


def group(size: int) -> list[SimpleNamespace]:
    exchange = SummedTables(size)
    return [replica(rank, exchange) for rank in range(size)]


def check_all(replicas) -> list:
    results = [None] * len(replicas)

    def run(i: int) -> None:
        results[i] = replicas[i].parity.check(replicas[i].tensors, replicas[i].quorum)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * BARRIER_S)
    assert not any(thread.is_alive() for thread in threads)
    return results


def perturb(tensor: torch.Tensor) -> None:
    """The smallest change: one element one float32 step away."""
    with torch.no_grad():
        flat = tensor.view(-1)
        flat[1] = torch.nextafter(flat[1], torch.tensor(float("inf")))


def test_identical_replicas_pass_quietly_and_keep_their_commits():
    replicas = group(REPLICAS)
    assert check_all(replicas) == [None] * 3
    assert [r.lines for r in replicas] == [[]] * 3
    assert [r.quorum.manager.commits["step"] for r in replicas] == [COMMITS] * 3
    assert [r.parity.checks for r in replicas] == [1] * 3


def test_a_replica_perturbed_after_the_round_is_named_and_gives_up_its_commit():
    replicas = group(REPLICAS)
    perturb(replicas[2].tensors[0])  # replica 12's weight, after the round assigned it
    mismatches = check_all(replicas)
    expected = (
        "parity: after the round at step 40 replica 12 holds another parameter 'weight' than "
        "replicas 10, 11; it heals from them at the next quorum"
    )
    assert [r.lines for r in replicas] == [[expected]] * 3  # every member says it, once
    assert all(m.deviants == [12] and m.majority == [10, 11] for m in mismatches)
    # the deviant is behind on commits at the next quorum (a source at the top count heals it)
    assert [r.quorum.manager.commits["step"] for r in replicas] == [COMMITS, COMMITS, COMMITS - 1]


def test_a_differing_optimizer_state_is_named_as_such():
    replicas = group(REPLICAS)
    perturb(replicas[0].tensors[2])
    check_all(replicas)
    assert "replica 10 holds another state 'exp_avg' of 'weight'" in replicas[1].lines[0]


def test_two_members_that_differ_are_both_named_and_neither_heals():
    replicas = group(2)
    perturb(replicas[1].tensors[1])
    check_all(replicas)
    expected = (
        "parity: after the round at step 40 replicas 10, 11 hold different values of parameter "
        "'bias' and no majority agrees: each keeps its own"
    )
    assert [r.lines for r in replicas] == [[expected]] * 2
    assert [r.quorum.manager.commits["step"] for r in replicas] == [COMMITS] * 2


def test_a_failed_exchange_leaves_the_round_unchecked_in_one_line():
    def lost_peer(quorum, table):
        raise RuntimeError("[gloo/pair.cc:598] Connection closed by peer [127.0.0.1]:4321")

    (one,) = [replica(0, SummedTables(REPLICAS))]
    one.parity.exchange = lost_peer
    assert one.parity.check(one.tensors, one.quorum) is None
    assert one.parity.check(one.tensors[2:], one.quorum) is None  # the round's states: unsaid
    assert one.lines == [
        "parity: the round at step 40 is unchecked: Connection closed by peer [127.0.0.1]:4321"
    ]
    assert one.quorum.manager.commits["step"] == COMMITS


def test_digests_see_every_bit_and_the_order():
    a = torch.arange(6, dtype=torch.float32)
    b = a.clone()
    perturb(b)
    assert tensor_digest(a) == tensor_digest(a.clone()) != tensor_digest(b)
    assert tensor_digest(a.to(torch.bfloat16)) != tensor_digest(a)  # any dtype, its own bytes
    digests = [tensor_digest(a), tensor_digest(b)]
    assert combined_digest(digests) != combined_digest(digests[::-1])
