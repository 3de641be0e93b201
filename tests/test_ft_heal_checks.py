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


def records(replica_id: int, step: int, settings: dict | None = None) -> dict:
    """The records a replica tracks first (ReplicaGroups' identity, fault_tolerant_replica's
    shared config), as an honest one holds them."""
    return {
        "replica": {"replica_id": replica_id, "step": step, "final": False},
        "config": {"replica_id": replica_id, "config": settings or {"lr": 0.01, "model": "micro"}},
    }


def heal_state(sync: LocalUpdateSync) -> dict:
    """What a source sends: torchft's progress and every tracked state."""
    engine_state = HealedState(TrainedState(sync)).state_dict()
    user = {**records(0, sync.step_count), "engine": engine_state}
    return {"torchft": {"step": COMMITS, "batches_committed": 6}, "user": user}


def own(sync: LocalUpdateSync) -> dict:
    return {**records(1, sync.step_count), "engine": HealedState(TrainedState(sync)).state_dict()}


def problem(received: dict, receiver: LocalUpdateSync, **options) -> str | None:
    return heal_problem(received, own(receiver), COMMITS, STEP, **options)


@pytest.mark.parametrize("receiver_steps", [0, STEP], ids=["a joiner", "a replica behind"])
def test_a_sound_state_passes(receiver_steps):
    assert problem(heal_state(engine(STEP)), engine(receiver_steps)) is None


def test_a_sound_state_with_rounds_in_flight_and_residuals_passes():
    options = dict(delay=1, codecs=SyncCodecs.parse(["int8"], error_feedback=True))
    source = engine(STEP + 1, **options)  # a round in flight, residuals kept
    received = heal_state(source)
    received["user"]["engine"]["sync"]["step"] = received["user"]["replica"]["step"] = STEP
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
    assert problem(received, engine(0)) == "replica.step is 4, its sender proved step 6"
    received["user"]["replica"]["step"] = STEP
    assert problem(received, engine(0)) == "engine.sync.step is 4, its sender proved step 6"
    assert problem({"user": {}}, engine(0)).startswith("the state is not a heal state")


@pytest.mark.parametrize(
    "record, change, refusal",
    [
        ("replica", {"replica_id": "x"}, "replica.replica_id is a str, here an int"),
        ("replica", {"step": float("inf")}, "replica.step is a float, here an int"),
        (
            "replica",
            {"step": 10**30},
            "replica.step is an int of 100 bits, its sender proved step 6",
        ),
        ("replica", {"final": None}, "replica.final is None, here a bool"),
        ("config", {"config": 5}, "config.config is an int, here a dict"),
        ("config", {"config": {"lr": torch.ones(2)}}, "config holds tensors, here none"),
    ],
)
def test_a_record_not_like_the_receivers_own_is_refused(record, change, refusal):
    """The records loaded first, by code that trusts them, are checked as the tensors are: a
    replica id "x" once stopped the healthy receiver (ValueError, read as its own refusal), a
    step of inf with an OverflowError, a config of 5 with a TypeError."""
    received = heal_state(engine(STEP))
    received["user"][record].update(change)
    assert problem(received, engine(0)) == refusal
    received["user"][record] = {
        k: v for k, v in own(engine(0))[record].items() if k != "replica_id"
    }
    assert problem(received, engine(0)).startswith(f"{record} is not a record like this replica's")


def test_a_config_record_must_agree_with_the_config_digest_its_sender_claimed():
    """Claimed the receiver's config, it must hold the receiver's settings (else the receiver
    would be refused for a difference its peer made); claimed another, it must hold others (its
    other records and tensors are then the receiver's config check's to refuse)."""
    received = heal_state(engine(STEP))
    received["user"]["config"]["config"]["lr"] = 0.1
    assert problem(received, engine(0)) == (
        "config.config differs from this replica's settings, though its sender claimed the "
        "same config digest"
    )
    received["user"]["engine"] = {}  # another config: the receiver's check refuses it, not this
    assert problem(received, engine(0), same_config=False) is None
    received = heal_state(engine(STEP))
    assert problem(received, engine(0), same_config=False) == (
        "config.config holds this replica's settings, though its sender claimed another "
        "config digest"
    )


def test_torchfts_record_holds_the_two_ints_its_manager_loads():
    received = heal_state(engine(STEP))
    received["torchft"]["step"] = float(COMMITS)
    assert problem(received, engine(0)) == "torchft.step is a float, here an int"
    received["torchft"] = {"step": COMMITS}  # a KeyError in torchft's load_state_dict
    assert problem(received, engine(0)) == "torchft.batches_committed is None, here an int"
