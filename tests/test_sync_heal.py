"""``on_non_finite="skip"`` heals a worker left out of a round: it takes the others' average of
every tensor it holds (parameters and every optimizer state, due or not), so it rejoins at once.

Three simulated workers under DES-LOC periods (parameters every 2 steps, first momentum every 6,
second moment every 12), so most states are not due when a worker is left out.
"""

from __future__ import annotations

import pytest
import torch
from test_sync_engine import EXACT, STATE_KEYS, backward, init_params, named_groups
from torch.testing import assert_close

from mtdao import MTAdam
from mtdao.sync import LocalUpdateSync, NonFiniteError, SimulatedWorkers
from mtdao.sync.policy import desloc, unified

WORKERS = 3


def skip_run():
    params = init_params(WORKERS)
    optimizer = MTAdam(named_groups(params), lr=1e-2, betas=(0.9,), omegas=(1.0,))
    sync = LocalUpdateSync(optimizer, desloc(2), SimulatedWorkers(WORKERS), on_non_finite="skip")
    return params, optimizer, sync


def held(params, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor a worker holds, by name (clones)."""
    tensors = {}
    for name, p in zip(("weight", "bias"), params):
        tensors[name] = p.detach().clone()
        for key in STATE_KEYS:
            tensors[f"{key} of {name}"] = optimizer.state[p][key].clone()
    return tensors


def step(params, optimizer, sync, number: int) -> dict[str, torch.Tensor]:
    """One step; returns every held tensor as it was after the optimizer step, before syncing."""
    backward(params, range(WORKERS), number, optimizer)
    sync.rounds.before_step()
    optimizer.step()
    local = held(params, optimizer)
    sync.rounds.after_step()
    return local


def test_a_worker_left_out_receives_the_average_of_every_state_due_or_not():
    params, optimizer, sync = skip_run()
    step(params, optimizer, sync, 0)
    step(params, optimizer, sync, 1)  # a parameter round at step 2
    optimizer.state[params[0]]["exp_avg_sq"][1, 0, 0] = float("nan")  # not due before step 12
    step(params, optimizer, sync, 2)  # worker 1's update is NaN now
    local = step(params, optimizer, sync, 3)  # round at step 4: parameters only are due

    others = [0, 2]
    after = held(params, optimizer)
    for name, now in after.items():
        assert torch.isfinite(now).all(), name
        assert_close(now[1], local[name][others].mean(0), **EXACT)  # healed: the others' average
        if name in ("weight", "bias"):  # averaged as usual, worker 1 left out
            assert torch.equal(now[0], now[1]) and torch.equal(now[2], now[1])
        else:  # not due: the healthy workers keep their own
            assert torch.equal(now[others], local[name][others]), name

    (skipped,) = sync.skipped_rounds
    assert skipped["step"] == 4 and skipped["workers"] == [1]
    assert skipped["healed_tensors"] == 4  # two states of each of the two parameters
    # the heal is counted: one worker's copy of every state, sent once
    state_bytes = sum(t[0].numel() * t.element_size() for n, t in after.items() if " of " in n)
    assert sync.traffic.bytes_by_kind["heal"] == state_bytes
    heals = [(e.step, e.kinds, e.bytes) for e in sync.events if "heal" in e.kinds]
    assert heals == [(4, ["heal"], state_bytes)]
    # healed at once: never left out again, through the momentum and second-moment rounds
    for number in range(4, 14):
        step(params, optimizer, sync, number)
    assert len(sync.skipped_rounds) == 1


def test_heal_now_makes_the_state_finite_and_costs_nothing_when_it_is():
    params, optimizer, sync = skip_run()
    step(params, optimizer, sync, 0)
    assert sync.rounds.heal_non_finite_workers() == [] and "heal" not in sync.traffic.bytes_by_kind

    optimizer.state[params[1]]["exp_avg_0"][2, 1] = float("inf")
    before = held(params, optimizer)
    assert sync.rounds.heal_non_finite_workers() == [2]
    for name, now in held(params, optimizer).items():
        assert torch.equal(now[:2], before[name][:2]), name  # workers 0 and 1 untouched
        assert_close(now[2], before[name][:2].mean(0), **EXACT)
    assert sync.skipped_rounds[-1]["workers"] == [2]
    assert sync.traffic.bytes_by_kind["heal"] > 0


def test_heal_refuses_when_every_worker_is_non_finite():
    params, optimizer, sync = skip_run()
    step(params, optimizer, sync, 0)
    params[0].data[:, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="no worker is left to average"):
        sync.rounds.heal_non_finite_workers()


def quantized_skip_run(policy=None, dtypes=("int8",)):
    """The DES-LOC run above (or ``policy``), its parameters sent as int8 (or ``dtypes``)
    pseudo-gradients with error feedback (each worker keeps a residual of what quantization
    lost)."""
    from mtdao.sync.codecs.compression import SyncCodecs

    params = init_params(WORKERS)
    optimizer = MTAdam(named_groups(params), lr=1e-2, betas=(0.9,), omegas=(1.0,))
    codecs = SyncCodecs.parse(list(dtypes), error_feedback=True)
    communicator = SimulatedWorkers(WORKERS)
    sync = LocalUpdateSync(
        optimizer, policy or desloc(2), communicator, on_non_finite="skip", codecs=codecs
    )
    return params, optimizer, sync


CASES = {
    # the round at step 4 leaves worker 1 out and heals the states not due
    "in a round": (desloc(2), "round"),
    # every tensor is due at step 4: the round itself gives worker 1 everything
    "in a round of everything": (unified(2), "round"),
    # a round sends worker 1's NaN pseudo-gradient (a delayed one heals nobody), then the heal
    # a checkpoint does
    "before a checkpoint": (desloc(2), "heal now"),
}


TOP_K = ("params=top8", "momenta=top8", "second-moment=int8")  # top-k gathered whole


@pytest.mark.parametrize("dtypes", [("int8",), TOP_K], ids=["int8", "top-k"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_healed_worker_forgets_its_error_feedback_residual(case, dtypes):
    """A NaN parameter makes the worker's pseudo-gradient, so its residual, NaN; healed, the
    worker holds the others' values, and what it had not yet sent is gone with its own: its
    residual is reset to zero, the others keep theirs, and the next rounds go on."""
    policy, how = CASES[case]
    params, optimizer, sync = quantized_skip_run(policy, dtypes)
    for number in range(2):
        step(params, optimizer, sync, number)  # a round at step 2: every worker has a residual
    residuals = sync.rounds.plan.pseudo_gradients.residuals
    assert residuals and all(bool(r[1].abs().sum() > 0) for r in residuals.values())
    params[0].data[1, 0, 0] = float("nan")  # worker 1, between rounds
    if how == "heal now":
        sync.rounds.plan.pseudo_gradients.payload(0, sync.rounds.anchors[0], params[0].detach())
        assert not bool(torch.isfinite(residuals[0][1]).all())
        assert sync.rounds.heal_non_finite_workers() == [1]
    else:
        step(params, optimizer, sync, 2)
        step(params, optimizer, sync, 3)
        assert [s["workers"] for s in sync.skipped_rounds] == [[1]]
    assert_residuals_reset(residuals, worker=1)
    for number in range(4, 10):  # no round blames an overflow of finite values
        step(params, optimizer, sync, number)
    assert len(sync.skipped_rounds) == 1
    for index, residual in residuals.items():
        assert torch.isfinite(residual).all(), index


def test_a_worker_whose_residual_alone_is_non_finite_is_healed():
    """Finite values can overflow the codec (a pseudo-gradient beyond its range): the residual
    is then NaN/inf while parameters and states are finite. It is part of the worker's state:
    found, and the worker healed, instead of a checkpoint refused or the next round blaming
    "an overflow although every worker's values are finite"."""
    params, optimizer, sync = quantized_skip_run()
    for number in range(2):
        step(params, optimizer, sync, number)
    residuals = sync.rounds.plan.pseudo_gradients.residuals
    residuals[1][2, 0] = float("inf")  # worker 2's residual of the bias
    assert sync.rounds.heal_non_finite_workers() == [2]
    assert "error-feedback residual of bias" in sync.skipped_rounds[-1]["tensors"]
    assert_residuals_reset(residuals, worker=2)
    assert sync.rounds.heal_non_finite_workers() == []
    for number in range(2, 6):
        step(params, optimizer, sync, number)
    assert len(sync.skipped_rounds) == 1


def assert_residuals_reset(residuals: dict, worker: int) -> None:
    for index, residual in residuals.items():
        assert torch.equal(residual[worker], torch.zeros_like(residual[worker])), index
        assert torch.isfinite(residual).all(), index
