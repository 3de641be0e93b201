"""Bit parity after a committed round (mtdao.ft.parity), with test doubles: replicas in
threads, their tables summed as the round's all-reduce would, each with a model that a round has
just made identical. The exchange that opens the next round (round_identity) compares them: one
perturbed after the round is named by every member with the tensor that differs and sits that
round out (so that it heals); two that differ with no majority are both named and neither sits
out; the final round compares at once, and an exchange that fails there is said in one line."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")

from mtdao.ft import round_identity  # noqa: E402
from mtdao.ft.parity import ParityCheck, combined_digest, tensor_digest  # noqa: E402
from mtdao.ft.shards import ReplicaProcesses  # noqa: E402

STEP = 40  # the round's
BARRIER_S = 10.0  # threads meeting in memory


class SummedTables:
    """The all-reduce of a round's group: every replica's table, summed, handed to each."""

    def __init__(self, replicas: int) -> None:
        self.barrier = threading.Barrier(replicas)
        self.tables: dict[int, torch.Tensor] = {}

    def for_rank(self, rank: int):
        def summed(table: torch.Tensor) -> torch.Tensor:
            self.tables[rank] = table.clone()
            self.barrier.wait(BARRIER_S)
            total = sum(self.tables.values())
            self.barrier.wait(BARRIER_S)  # each has its sum before the next exchange writes
            return total

        return summed


def replica(rank: int, size: int) -> SimpleNamespace:
    """A replica whose round just assigned the same parameters and Adam states as the others'."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    names = {id(params[0]): "weight", id(params[1]): "bias"}
    sync = SimpleNamespace(params=params, param_names=names, optimizer=optimizer, step_count=STEP)
    lines: list[str] = []
    parity = ParityCheck(say=lines.append)
    parity.sync = sync
    quorum = SimpleNamespace(members=[10, 11, 12][:size], rank=rank, processes=ReplicaProcesses())
    states = [optimizer.state[p]["exp_avg"] for p in params]
    return SimpleNamespace(parity=parity, quorum=quorum, lines=lines, params=params, states=states)


def group(size: int) -> list[SimpleNamespace]:
    replicas = [replica(rank, size) for rank in range(size)]
    for one in replicas:  # the round committed: its parameters, then its states
        one.parity.assigned(one.params, one.quorum, final=False)
        one.parity.assigned(one.states, one.quorum, final=False)
    return replicas


def in_threads(replicas, run) -> list:
    results = [None] * len(replicas)

    def target(i: int) -> None:
        results[i] = run(replicas[i])

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(3 * BARRIER_S)
    assert not any(thread.is_alive() for thread in threads)
    return results


def open_next_round(replicas) -> list[tuple[list[int], str | None]]:
    """round_identity's exchange at the next round's quorum, every member at step STEP + 8."""
    tables = SummedTables(len(replicas))

    def check(one):
        members, rank = one.quorum.members, one.quorum.rank
        summed = tables.for_rank(rank)
        return round_identity.check(summed, members, rank, STEP + 8, "ab" * 8, one.parity)

    return in_threads(replicas, check)


def perturb(tensor: torch.Tensor) -> None:
    """The smallest change: one element one float32 step away."""
    with torch.no_grad():
        flat = tensor.view(-1)
        flat[1] = torch.nextafter(flat[1], torch.tensor(float("inf")))


def test_identical_replicas_take_part_and_say_nothing():
    replicas = group(3)
    assert open_next_round(replicas) == [([], None)] * 3
    assert [r.lines for r in replicas] == [[]] * 3


def test_a_replica_perturbed_after_the_round_is_named_and_sits_the_next_round_out():
    replicas = group(3)
    for one in replicas[2:]:  # replica 12's weight, as the round left it, then hashed: its own
        perturb(one.params[0])
        one.parity.last = None
        one.parity.assigned(one.params, one.quorum, final=False)
        one.parity.assigned(one.states, one.quorum, final=False)
    verdicts = open_next_round(replicas)
    expected = (
        f"parity: after the round at step {STEP} replica 12 holds another parameter 'weight' "
        "than replicas 10, 11; it sits the next round out and heals from them"
    )
    assert [r.lines for r in replicas] == [[expected]] * 3  # every member says it, once
    reason = f"its values after the round at step {STEP} differ from the majority's"
    # every member agrees who sits out; the deviant knows why (it fails its commit and heals)
    assert verdicts == [([12], None), ([12], None), ([12], reason)]


def test_a_differing_optimizer_state_is_named_as_such():
    replicas = [replica(rank, 3) for rank in range(3)]
    perturb(replicas[0].states[0])
    for one in replicas:
        one.parity.assigned(one.params, one.quorum, final=False)
        one.parity.assigned(one.states, one.quorum, final=False)
    open_next_round(replicas)
    assert "replica 10 holds another state 'exp_avg' of 'weight'" in replicas[1].lines[0]


def test_two_members_that_differ_are_both_named_and_neither_sits_out():
    replicas = [replica(rank, 2) for rank in range(2)]
    perturb(replicas[1].params[1])
    for one in replicas:
        one.parity.assigned(one.params, one.quorum, final=False)
    assert open_next_round(replicas) == [([], None)] * 2
    expected = (
        f"parity: after the round at step {STEP} replicas 10, 11 hold different values of "
        "parameter 'bias' and no majority agrees: each keeps its own"
    )
    assert [r.lines for r in replicas] == [[expected]] * 2


def test_a_deviant_sharing_its_replica_id_with_an_honest_member_is_named_by_its_rank():
    """Two members may claim one replica id (members 10, 10, 12): the verdict is by quorum rank,
    so the deviant at rank 1 sits out, never the honest rank 0 that shares its id."""
    replicas = group(3)
    perturb(replicas[1].params[0])
    replicas[1].parity.last = None
    replicas[1].parity.assigned(replicas[1].params, replicas[1].quorum, final=False)
    replicas[1].parity.assigned(replicas[1].states, replicas[1].quorum, final=False)
    positions = [one.parity.position() for one in replicas]
    digests = torch.tensor([one.parity.last.digests for one in replicas])
    reason = f"its values after the round at step {STEP} differ from the majority's"
    for rank, one in enumerate(replicas):  # the sum hands each member every member's digests
        verdict = one.parity.judge(positions, [10, 10, 12], rank, lambda table: digests.flatten())
        assert verdict == {1: reason}


@pytest.mark.parametrize("count", [2**40, 2**62], ids=["2**40", "2**62"])
def test_a_huge_tensor_count_is_named_as_a_set_of_tensors_without_allocating_it(count):
    """A peer's count column is not trusted: comparing tensor by tensor would allocate a row of
    ``count`` digests (a MemoryError that ended the replica); the round is named as a whole."""
    parity = ParityCheck(say=[].append)
    positions = [[STEP + 1, 7, count], [STEP + 1, 7, count], [STEP + 1, 8, count]]

    def no_sum(table):
        raise AssertionError("no per-tensor exchange for a count no round has")

    assert parity.judge(positions, [10, 11, 12], 0, no_sum) == {
        2: f"its values after the round at step {STEP} differ from the majority's"
    }
    assert parity.mismatches[0].tensor == "set of tensors"


def test_a_member_that_missed_the_round_is_not_compared():
    replicas = group(3)
    replicas[0].parity.last = None  # healed, or restarted: it assigned no round since
    perturb(replicas[0].params[0])
    assert open_next_round(replicas) == [([], None)] * 3
    assert [r.lines for r in replicas] == [[]] * 3


def test_the_final_round_is_compared_at_once():
    replicas = [replica(rank, 3) for rank in range(3)]
    perturb(replicas[1].params[0])
    tables = SummedTables(3)
    for one in replicas:
        one.parity.final_sum = lambda quorum: tables.for_rank(quorum.rank)
    in_threads(replicas, lambda one: one.parity.assigned(one.params, one.quorum, final=True))
    expected = (
        "parity: after the final round replica 11 holds another parameter 'weight' than "
        "replicas 10, 12; its model is not theirs"
    )
    assert [r.lines for r in replicas] == [[expected]] * 3


def test_a_failed_final_exchange_leaves_the_round_unchecked_in_one_line():
    def lost_peer(table):
        raise RuntimeError("[gloo/pair.cc:598] Connection closed by peer [127.0.0.1]:4321")

    one = replica(0, 3)
    one.parity.final_sum = lambda quorum: lost_peer
    one.parity.assigned(one.params, one.quorum, final=True)
    assert one.lines == [
        "parity: the final round is unchecked: Connection closed by peer [127.0.0.1]:4321"
    ]


def test_digests_see_every_bit_and_the_order():
    a = torch.arange(6, dtype=torch.float32)
    b = a.clone()
    perturb(b)
    assert tensor_digest(a) == tensor_digest(a.clone()) != tensor_digest(b)
    assert tensor_digest(a.to(torch.bfloat16)) != tensor_digest(a)  # any dtype, its own bytes
    digests = [tensor_digest(a), tensor_digest(b)]
    assert combined_digest(digests) != combined_digest(digests[::-1])
