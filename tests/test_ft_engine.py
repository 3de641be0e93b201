"""What the engine promises a communicator whose rounds can fail (fault-tolerant replicas), pinned
with the scripted doubles: a discarded round changes no tensor and leaves no record, commit comes
between checking and applying, and ``sync.rounds.due`` says in advance exactly which steps have a
round."""

from __future__ import annotations

import copy
from functools import partial

import optimizer_cases as cases
import pytest
import torch
from optimizer_cases import set_gradients

from mtdao import MTAdam
from mtdao.sync import (
    LocalUpdateSync,
    OuterOptimizerConfig,
    SimulatedWorkers,
    desloc,
    explicit,
    gradient_averaging,
    unified,
)
from mtdao.sync.communicator import FinalRoundNotCommitted, RoundNotCommitted
from mtdao.sync.engine import FINAL_ROUND_TRIES
from mtdao.sync.testing import RecordingCommunicator, ScriptedCommunicator

make_params = partial(cases.make_params, shapes=[(3, 4), (3,)], drawn_in=torch.float64)


def shifted(tensors):
    """A scripted 'average' that differs from every input, so an applied round shows."""
    return [t + 1.0 for t in tensors]


def snapshot(sync: LocalUpdateSync) -> dict:
    state = {
        "params": [p.detach().clone() for p in sync.params],
        "grads": [None if p.grad is None else p.grad.clone() for p in sync.params],
        "optimizer": copy.deepcopy(sync.optimizer.state_dict()),
        "engine": copy.deepcopy(sync.state_dict()),
    }
    return state


def assert_same(before, after, where="state") -> None:
    """Bitwise equal, through nested dicts and lists."""
    if isinstance(before, torch.Tensor):
        assert torch.equal(before, after), where
    elif isinstance(before, dict):
        assert before.keys() == after.keys(), where
        for key in before:
            assert_same(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after), where
        for index, (b, a) in enumerate(zip(before, after)):
            assert_same(b, a, f"{where}[{index}]")
    else:
        assert before == after, where


POLICIES = {
    "unified": lambda: unified(2),
    "diloco": lambda: explicit(2, outer=OuterOptimizerConfig()),
    "ddp": gradient_averaging,
}


@pytest.mark.parametrize("name", POLICIES)
def test_a_discarded_round_changes_nothing_and_the_next_one_applies(name):
    params = make_params()
    optimizer = MTAdam(params, lr=0.1, betas=(0.9,), omegas=(0.5,))
    policy = POLICIES[name]()
    communicator = ScriptedCommunicator([shifted] * 8, discard_at=2)
    sync = LocalUpdateSync(optimizer, policy, communicator, track_alignment=True)
    gradient_rounds = policy.average_gradients
    steps_to_second_round = 1 if gradient_rounds else 3  # rounds at steps 1, 2 or 2, 4
    for step in range(steps_to_second_round):
        set_gradients(params, step)
        sync.step()
    set_gradients(params, 99)
    rounds_sent = sync.traffic.rounds
    if gradient_rounds:  # the round comes before the optimizer step, which then does not happen
        before = snapshot(sync)
        with pytest.raises(RoundNotCommitted, match="round 2"):
            sync.step()
    else:  # the local step happened; the round after it is discarded
        sync.rounds.before_step()
        optimizer.step()
        before = snapshot(sync)
        before["engine"]["step"] += 1  # the step counts, the round does not
        with pytest.raises(RoundNotCommitted, match="round 2"):
            sync.rounds.after_step()
    assert sync.traffic.rounds == rounds_sent + 1  # what was sent is counted as sent
    before["engine"]["traffic"] = sync.state_dict()["traffic"]
    assert_same(before, snapshot(sync))
    assert len(sync.events) == 1 and len(sync.alignment) == (0 if gradient_rounds else 1)

    for step in range(2):  # on to the next round, which applies as usual
        set_gradients(params, 100 + step)
        sync.rounds.before_step()
        optimizer.step()
        stepped = [p.detach().clone() for p in params]
        sync.rounds.after_step()
        if len(sync.events) == 2:
            break
    assert len(sync.events) == 2
    if name == "unified":  # the scripted average: every tensor + 1
        torch.testing.assert_close([p.detach() for p in params], [t + 1 for t in stepped])


def test_commit_comes_after_the_average_and_before_anything_is_written():
    params = make_params()
    optimizer = MTAdam(params, lr=0.1, betas=(0.9,), omegas=(0.5,))
    communicator = RecordingCommunicator()
    sync = LocalUpdateSync(optimizer, unified(2), communicator)
    for step in range(4):
        set_gradients(params, step)
        sync.step()
    methods = [call.method for call in communicator.calls if call.method != "broadcast_from_first"]
    assert methods == ["average", "commit", "assign", "assign"] * 2


ROUND_POLICIES = {
    "unified": lambda: unified(3),
    "desloc": lambda: desloc(2),
    "states only, every step": lambda: explicit(None, other_states=1),
    "per-state periods": lambda: explicit(4, {"exp_avg_0": 6}, other_states=None),
    "diloco": lambda: explicit(3, outer=OuterOptimizerConfig()),
    "ddp": gradient_averaging,
}


@pytest.mark.parametrize("name", ROUND_POLICIES)
def test_round_due_says_in_advance_which_steps_average(name):
    params = [torch.nn.Parameter(p.detach().expand(2, *p.shape).clone()) for p in make_params()]
    optimizer = MTAdam(params, lr=0.1, betas=(0.9,), omegas=(0.5,))
    communicator = RecordingCommunicator(SimulatedWorkers(2))
    sync = LocalUpdateSync(optimizer, ROUND_POLICIES[name](), communicator)
    predicted, happened = [], []
    for step in range(1, 25):
        predicted.append(sync.rounds.due(step))
        calls = len(communicator.average_kinds())
        set_gradients(params, step)
        sync.step()
        happened.append(len(communicator.average_kinds()) > calls)
    assert predicted == happened
    assert any(happened)


def final_round_engine(discards: tuple[int, ...], delay: int = 0):
    """An engine one step past its round at step 2 (a round in flight with ``delay``), whose
    communicator discards the rounds numbered ``discards`` (round 1: the one at step 2)."""
    params = make_params()
    optimizer = MTAdam(params, lr=0.1, betas=(0.9,), omegas=(0.5,))
    communicator = ScriptedCommunicator([shifted] * 16, discard_at=discards)
    sync = LocalUpdateSync(optimizer, unified(2), communicator, delay=delay)
    for step in range(3 if not delay else 2):
        set_gradients(params, step)
        sync.step()
    return params, sync, communicator


@pytest.mark.parametrize("delay", [0, 1], ids=["blocking", "a round in flight"])
def test_a_discarded_final_round_is_formed_again_until_it_commits(delay):
    discards = tuple(range(2, 2 + FINAL_ROUND_TRIES - 1))  # every try but the last
    params, sync, communicator = final_round_engine(discards, delay)
    before = [p.detach().clone() for p in params]
    event = sync.finish()
    assert event is not None and event.final
    commits = [call for call in communicator.calls if call.method == "commit"]
    assert len(commits) == 1 + FINAL_ROUND_TRIES  # the round at step 2, then every try
    assert [r["reason"] for r in sync.discarded_rounds] == [
        f"scripted discard of round {n}" for n in discards
    ]
    # the try that committed applied its average once: the scripted one, every tensor + 1
    torch.testing.assert_close([p.detach() for p in params], [b + 1 for b in before])


def test_a_final_round_no_try_commits_ends_in_one_line_and_each_keeps_its_own_model():
    discards = tuple(range(2, 2 + FINAL_ROUND_TRIES))
    params, sync, communicator = final_round_engine(discards)
    before = snapshot(sync)
    seen: list[str] = []
    with pytest.raises(FinalRoundNotCommitted) as failed:
        sync.finish(on_discarded=lambda failure: seen.append(str(failure)))
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"the final round was discarded {FINAL_ROUND_TRIES} times")
    assert f"scripted discard of round {discards[-1]}" in message
    assert seen == [f"scripted discard of round {n}" for n in discards]
    commits = [call for call in communicator.calls if call.method == "commit"]
    assert len(commits) == 1 + FINAL_ROUND_TRIES  # bounded: no fourth try
    before["engine"]["traffic"] = sync.state_dict()["traffic"]
    assert_same(before, snapshot(sync))  # every try undone


def test_attached_raises_when_no_try_of_the_final_round_commits():
    params = make_params()
    optimizer = MTAdam(params, lr=0.1, betas=(0.9,), omegas=(0.5,))
    discards = tuple(range(2, 2 + FINAL_ROUND_TRIES))
    sync = LocalUpdateSync(optimizer, unified(2), ScriptedCommunicator(discard_at=discards))
    with pytest.raises(FinalRoundNotCommitted), sync.attached():
        for step in range(3):
            set_gradients(params, step)
            optimizer.step()
    assert len(sync.discarded_rounds) == FINAL_ROUND_TRIES
