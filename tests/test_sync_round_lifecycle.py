"""A round's lifecycle, pinned with the scripted communicator: a delayed, fragmented, int8 round with
error feedback that the communicator discards when it lands leaves every worker as if it had not
been sent (local progress kept, residuals and anchors as before it opened, no record), the round
opened at the same step still goes out, and the rounds after it apply as usual."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from optimizer_cases import make_params, set_gradients

from mtdao import MTAdam
from mtdao.sync import LocalUpdateSync, unified
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.communicator import RoundNotCommitted
from mtdao.sync.rounds import Stage
from mtdao.sync.testing import ScriptedCommunicator

K, DELAY, FRAGMENTS = 4, 2, 2


def shifted(tensors):
    """A scripted 'average' that differs from every input, so an applied round shows."""
    return [t + 0.25 for t in tensors]


def make_engine(discard_at: int | None):
    params = make_params(shapes=[(6, 4), (5,)])  # layers "a" (fragment 0) and "b" (fragment 1)
    groups = [{"params": params, "names": ["a.weight", "b.weight"]}]
    optimizer = MTAdam(groups, lr=0.05, betas=(0.9,), omegas=(0.5,), beta2=0.95)
    communicator = ScriptedCommunicator([shifted] * 32, discard_at=discard_at)
    sync = LocalUpdateSync(
        optimizer,
        unified(K),
        communicator,
        delay=DELAY,
        fragments=FRAGMENTS,
        codecs=SyncCodecs.parse(["int8"], error_feedback=True),
        track_alignment=True,
    )
    return params, optimizer, sync


def local_step(params, optimizer, sync, step: int) -> None:
    set_gradients(params, step)
    sync.rounds.before_step()
    optimizer.step()


def held(params, optimizer, sync) -> dict:
    return {
        "params": [p.detach().clone() for p in params],
        "optimizer": copy.deepcopy(optimizer.state_dict()["state"]),
        "anchors": [a.clone() for a in sync.rounds.anchors],
        "residuals": dict(sync.rounds.plan.pseudo_gradients.residuals),
    }


def assert_same(before, after) -> None:
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_a_discarded_delayed_fragmented_int8_round_is_undone_and_the_next_ones_apply():
    # rounds open at every even step (D = 2 before the fragments' steps 4, 6, 8, ...), the
    # fragments taking turns; the second round of fragment 1 ("b") opens at 8 and lands at 10,
    # where it is the 4th round to commit
    params, optimizer, sync = make_engine(discard_at=4)
    b = 1  # the index of b.weight
    for step in range(1, 11):
        local_step(params, optimizer, sync, step)
        if step == 8:
            residual_before = sync.rounds.plan.pseudo_gradients.residuals[b].clone()
        if step == 10:
            break
        sync.rounds.after_step()
        if step == 8:
            assert [r.step for r in sync.rounds.pending.rounds] == [8]
            assert not torch.equal(sync.rounds.plan.pseudo_gradients.residuals[b], residual_before)
    before = held(params, optimizer, sync)
    events, alignment, sent = list(sync.events), list(sync.alignment), sync.traffic.bytes
    assert [e.step for e in events] == [2, 4, 6]

    with pytest.raises(RoundNotCommitted, match="scripted discard of round 4"):
        sync.rounds.after_step()  # the round of "b" lands and is discarded

    after = held(params, optimizer, sync)
    assert_same(before["params"], after["params"])  # local progress kept, nothing merged
    assert_same(before["optimizer"], after["optimizer"])
    assert_same(before["anchors"], after["anchors"])
    assert torch.equal(after["residuals"][b], residual_before)  # as before the round opened
    assert sync.events == events and sync.alignment == alignment  # recorded at commit only
    assert [r.step for r in sync.rounds.pending.rounds] == [
        10
    ]  # the round due at step 10 still opened
    assert sync.traffic.bytes > sent and sync.step_count == 10

    for step in (11, 12):  # on to the next rounds, which apply as usual
        local_step(params, optimizer, sync, step)
        if step == 12:
            stepped = [p.detach().clone() for p in params]
        sync.rounds.after_step()
    assert [e.step for e in sync.events] == [2, 4, 6, 10]
    assert not torch.equal(params[0].detach(), stepped[0])  # "a" merged its round
    assert torch.equal(params[1].detach(), stepped[1])  # "b" waits for its next round
    assert [r.step for r in sync.rounds.pending.rounds] == [12]


def test_an_undisturbed_run_records_every_round_at_its_commit():
    params, optimizer, sync = make_engine(discard_at=None)
    for step in range(1, 11):
        local_step(params, optimizer, sync, step)
        sync.rounds.after_step()
    assert [e.step for e in sync.events] == [2, 4, 6, 8]  # the round opened at 10 is in flight
    assert [r.step for r in sync.rounds.pending.rounds] == [10]
    sync.rounds.flush()
    assert [e.step for e in sync.events] == [2, 4, 6, 8, 10]


def test_a_round_carries_its_stage_and_refuses_a_move_out_of_order():
    params, optimizer, sync = make_engine(discard_at=4)
    stages = {}
    for step in range(1, 11):
        local_step(params, optimizer, sync, step)
        with contextlib.suppress(RoundNotCommitted):
            sync.rounds.after_step()
        for in_flight in sync.rounds.pending.rounds:
            stages.setdefault(in_flight.step, in_flight)
    by_step = {step: r.stage for step, r in stages.items()}
    assert by_step == {
        2: Stage.APPLIED,
        4: Stage.APPLIED,
        6: Stage.APPLIED,
        8: Stage.DISCARDED,  # the 4th round to land: the scripted discard
        10: Stage.IN_FLIGHT,
    }
    with pytest.raises(RuntimeError, match="opened at step 2 is applied: it cannot be landed"):
        stages[2].land()
    with pytest.raises(RuntimeError, match="opened at step 8 is discarded: it cannot be applied"):
        stages[8].applied()
