"""A heal state is checked against the receiving replica's own state before anything is loaded.

A member with the run's secret may still be faulty: a state holding NaN used to be applied (the
next step stopped with "training loss is NaN/inf ... lower --lr"), an int64 tensor was cast into a
float32 state, a state of the wrong shape stopped the healthy receiver with a line of ~3000
characters. Each is refused here in one short line naming the first offending key."""

from __future__ import annotations

import pytest
import torch

from mtdao import MTAdam
from mtdao.sync import LocalUpdateSync, unified
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.trained_state import TrainedState

pytest.importorskip("torchft")

from mtdao.ft.healing import HealedState  # noqa: E402
from mtdao.ft.security.heal_checks import heal_problem  # noqa: E402

COMMITS, STEP = 3, 6
P0, P1 = "param 0 of group 0", "param 1 of group 0"  # the engine's names of its parameters


def engine(steps: int, **options) -> LocalUpdateSync:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)) for _ in range(2)]
    sync = LocalUpdateSync(MTAdam(params, lr=1e-2), unified(2), **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        sync.step()
    return sync


def heal_state(sync: LocalUpdateSync) -> dict:
    """What a source sends: torchft's progress and every tracked state."""
    user = {"replica": {"replica_id": 0}, "engine": HealedState(TrainedState(sync)).state_dict()}
    return {"torchft": {"step": COMMITS, "batches_committed": 6}, "user": user}


def own(sync: LocalUpdateSync) -> dict:
    return {"replica": {"replica_id": 1}, "engine": HealedState(TrainedState(sync)).state_dict()}


def problem(received: dict, receiver: LocalUpdateSync, **options) -> str | None:
    return heal_problem(received, own(receiver), COMMITS, STEP, **options)


@pytest.mark.parametrize("receiver_steps", [0, STEP], ids=["a joiner", "a replica behind"])
def test_a_sound_state_passes(receiver_steps):
    assert problem(heal_state(engine(STEP)), engine(receiver_steps)) is None


def test_a_sound_state_with_rounds_in_flight_and_residuals_passes():
    options = dict(delay=1, codecs=SyncCodecs.parse(["int8"], error_feedback=True))
    source = engine(STEP + 1, **options)  # a round in flight, residuals kept
    received = heal_state(source)
    received["user"]["engine"]["sync"]["step"] = STEP
    assert received["user"]["engine"]["sync"]["pending"]
    assert problem(received, engine(0, **options)) is None


def corrupted(change) -> dict:
    received = heal_state(engine(STEP))
    change(received["user"]["engine"])
    return received


def test_a_state_holding_nan_is_refused_unless_the_run_allows_it():
    received = corrupted(lambda e: e["params"][P0].__setitem__((0, 0), float("nan")))
    assert problem(received, engine(0)) == f"engine.params.{P0} holds NaN/inf"
    assert problem(received, engine(0), allow_non_finite=True) is None
    received = corrupted(lambda e: e["optimizer"]["state"][1]["exp_avg_sq"].fill_(float("inf")))
    assert problem(received, engine(STEP)) == "engine.optimizer.state.1.exp_avg_sq holds NaN/inf"


def test_an_int64_tensor_where_float32_belongs_is_refused():
    received = corrupted(lambda e: e["params"].__setitem__(P1, e["params"][P1].long()))
    assert problem(received, engine(0)) == f"engine.params.{P1} is int64, here float32"
    received = corrupted(
        lambda e: e["optimizer"]["state"][0].__setitem__("exp_avg_0", torch.zeros(3, 4).long())
    )
    assert (
        problem(received, engine(STEP))
        == "engine.optimizer.state.0.exp_avg_0 is int64, here float32"
    )
    assert "is int64, its parameter float32" in problem(received, engine(0))  # no state here yet


def test_a_state_of_the_wrong_shape_is_refused_in_one_short_line():
    received = corrupted(lambda e: e["params"].__setitem__(P0, torch.zeros(3, 5)))
    line = problem(received, engine(STEP))
    assert line == f"engine.params.{P0} has shape (3, 5), here (3, 4)"
    received = corrupted(
        lambda e: e["optimizer"]["state"][0].__setitem__("exp_avg_0", torch.zeros(7))
    )
    assert problem(received, engine(0)) == (
        "engine.optimizer.state.0.exp_avg_0 has shape (7,), its parameter (3, 4)"
    )


def test_a_missing_or_foreign_key_is_named():
    received = corrupted(lambda e: e["params"].pop(P1))
    assert problem(received, engine(0)) == f"engine.params.{P1} is missing"
    received = heal_state(engine(STEP))
    received["user"].pop("engine")
    assert problem(received, engine(0)) == "engine is missing"
    received["user"]["engine"], received["user"]["extra"] = own(engine(STEP))["engine"], {}
    assert problem(received, engine(0)) == "extra is no part of this replica's state"


def test_a_state_at_another_step_than_its_sender_proved_is_refused():
    received = heal_state(engine(STEP))
    received["torchft"]["step"] = COMMITS + 5
    assert problem(received, engine(0)) == "torchft.step is 8, its sender proved 3 commits"
    received = heal_state(engine(STEP - 2))
    assert problem(received, engine(0)) == "engine.sync.step is 4, its sender proved step 6"
    assert problem({"user": {}}, engine(0)).startswith("the state is not a heal state")
