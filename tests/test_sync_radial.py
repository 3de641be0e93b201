"""Radial-directional averaging against a literal reference: parameters and momenta, zero norms,
the outer step on top, delayed rounds, the traffic of the norms and a resume."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from mtdao.sync import (
    LocalUpdateSync,
    NonFiniteError,
    OuterOptimizerConfig,
    SimulatedWorkers,
    SyncCodecs,
    SyncPolicy,
    SyncRule,
    explicit,
    keep_local,
    unified,
)

EXACT = dict(rtol=1e-12, atol=1e-12)
WORKERS = 4


def radial_reference(updates: list[list[float]]) -> list[float]:
    """mean(||d_w||) * u / ||u||, u = mean(d_w / ||d_w||), written out element by element."""
    norms = [math.sqrt(sum(v * v for v in update)) for update in updates]
    units = [[v / n if n > 0 else 0.0 for v in update] for update, n in zip(updates, norms)]
    mean_unit = [sum(column) / len(units) for column in zip(*units)]
    mean_norm = sum(norms) / len(norms)
    length = math.sqrt(sum(v * v for v in mean_unit))
    return [mean_norm * v / length if length > 0 else 0.0 for v in mean_unit]


def reference(updates: Tensor) -> Tensor:
    """The reference of each worker's flattened update ([workers, *shape] -> [*shape])."""
    rows = updates.reshape(updates.shape[0], -1).tolist()
    return torch.tensor(radial_reference(rows), dtype=updates.dtype).view(updates.shape[1:])


def deltas(seed: int, *shape: int) -> Tensor:
    return torch.randn(
        WORKERS, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )


def stacked(x: Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(x.expand(WORKERS, *x.shape).clone())


def params_sync(policy: SyncPolicy, x0: list[Tensor], **options):
    """Workers at ``x0`` whose SGD step (lr 1) moves worker w by minus its gradient."""
    params = [stacked(x) for x in x0]
    optimizer = torch.optim.SGD(params, lr=1.0)
    sync = LocalUpdateSync(
        optimizer, policy, SimulatedWorkers(WORKERS), radial_directional=("params",), **options
    )
    return params, sync


def step_with(sync: LocalUpdateSync, params, grads: list[Tensor]) -> None:
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    sync.step()


def test_parameters_take_the_mean_norm_along_the_mean_direction_per_tensor():
    x0 = [torch.randn(3, 2, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    params, sync = params_sync(SyncPolicy(params=SyncRule(1)), x0)
    d = [deltas(1, 3, 2), deltas(2, 5)]
    step_with(sync, params, d)  # pseudo-gradient of worker w: d[w]
    x1 = [x - reference(delta) for x, delta in zip(x0, d)]
    for param, expected in zip(params, x1):
        assert_close(param.detach(), expected.expand_as(param), **EXACT)
    # the second round's anchor is the first round's result
    e = [deltas(3, 3, 2), deltas(4, 5)]
    step_with(sync, params, e)
    for param, x, delta in zip(params, x1, e):
        assert_close(param.detach(), (x - reference(delta)).expand_as(param), **EXACT)
    # the norms, one float64 per tensor, are counted per round
    assert sync.traffic.bytes_by_kind["norms"] == 2 * 2 * 8
    assert sync.traffic.bytes_by_kind["params"] == 2 * (6 + 5) * 8


def test_radial_update_is_longer_than_the_plain_mean_of_spread_updates():
    x0 = [torch.zeros(64, dtype=torch.float64)]
    params, sync = params_sync(SyncPolicy(params=SyncRule(1)), x0)
    d = deltas(5, 64)
    step_with(sync, params, [d])
    radial_norm = params[0][0].norm()
    assert_close(radial_norm, d.norm(dim=1).mean(), **EXACT)
    assert radial_norm > 1.5 * d.mean(dim=0).norm()


def test_outer_step_takes_the_radial_pseudo_gradient():
    x0 = [torch.randn(4, dtype=torch.float64)]
    policy = SyncPolicy(params=SyncRule(1), outer=OuterOptimizerConfig(lr=0.7, momentum=0.9))
    params, sync = params_sync(policy, x0)
    d = deltas(6, 4)
    step_with(sync, params, [d])
    expected = x0[0] - 0.7 * 1.9 * reference(d)  # buffer = delta, step = delta + 0.9 delta
    assert_close(params[0].detach(), expected.expand_as(params[0]), **EXACT)


def test_zero_updates_add_a_zero_norm_and_cancelling_directions_move_nothing():
    x0 = [torch.randn(3, dtype=torch.float64)]
    params, sync = params_sync(SyncPolicy(params=SyncRule(1)), x0)
    d = deltas(7, 3)
    d[0] = 0.0  # worker 0 did not move
    step_with(sync, params, [d])
    x1 = x0[0] - reference(d)
    assert_close(params[0].detach(), x1.expand_as(params[0]), **EXACT)
    assert_close(reference(d).norm(), d.norm(dim=1).sum() / WORKERS, **EXACT)

    step_with(sync, params, [torch.zeros(WORKERS, 3, dtype=torch.float64)])  # nobody moved
    assert_close(params[0].detach(), x1.expand_as(params[0]), **EXACT)

    v = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    step_with(sync, params, [torch.stack([v, -v, 2 * v, -2 * v])])  # the directions cancel
    assert_close(params[0].detach(), x1.expand_as(params[0]), **EXACT)


def test_identical_updates_give_the_plain_mean():
    x0 = [torch.randn(6, dtype=torch.float64)]
    params, sync = params_sync(SyncPolicy(params=SyncRule(1)), x0)
    v = torch.randn(6, dtype=torch.float64)
    step_with(sync, params, [v.expand(WORKERS, 6)])
    assert_close(params[0].detach(), (x0[0] - v).expand_as(params[0]), **EXACT)


def test_momenta_average_their_change_since_their_last_sync():
    params = [stacked(torch.randn(5, dtype=torch.float64))]
    x0 = params[0].detach().clone()
    optimizer = torch.optim.SGD(params, lr=0.0, momentum=0.5)  # buffer = 0.5 buffer + grad
    policy = explicit(None, states={"momentum_buffer": 1})
    sync = LocalUpdateSync(
        optimizer, policy, SimulatedWorkers(WORKERS), radial_directional=("momenta",)
    )
    g1 = deltas(8, 5)
    step_with(sync, params, [g1])  # each buffer starts at zero: its change is g1[w]
    m1 = reference(g1)
    buffer = optimizer.state[params[0]]["momentum_buffer"]
    assert_close(buffer, m1.expand_as(buffer), **EXACT)

    g2 = deltas(9, 5)
    step_with(sync, params, [g2])  # worker w: 0.5 m1 + g2[w], a change of g2[w] - 0.5 m1
    m2 = m1 + reference(0.5 * m1 + g2 - m1)
    assert_close(buffer, m2.expand_as(buffer), **EXACT)
    assert_close(params[0].detach(), x0, **EXACT)  # lr 0: the parameters never moved
    assert sync.traffic.bytes_by_kind["norms"] == 2 * 8
    (saved,) = sync.state_dict()["radial"]["state_anchors"]
    assert saved[:2] == ["momentum_buffer", 0]
    assert_close(saved[2], m2, **EXACT)


def test_one_worker_keeps_its_own_values():
    param = torch.nn.Parameter(torch.randn(1, 4, dtype=torch.float64))
    optimizer = torch.optim.SGD([param], lr=1.0, momentum=0.5)
    sync = LocalUpdateSync(
        optimizer, unified(1), SimulatedWorkers(1), radial_directional=("params", "momenta")
    )
    for seed in range(3):
        param.grad = torch.randn(
            1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
        )
        before = (
            param.detach()
            - param.grad
            - 0.5 * optimizer.state.get(param, {}).get("momentum_buffer", torch.zeros_like(param))
        )
        sync.step()
        assert_close(param.detach(), before, **EXACT)


def least_squares_run(steps: int, state: dict | None = None, **options):
    """Adam on per-worker least squares, radial on both kinds; resumes from ``state``."""
    gen = torch.Generator().manual_seed(0)
    weight = stacked(torch.randn(3, 4, dtype=torch.float64, generator=gen))
    optimizer = torch.optim.Adam([weight], lr=0.05)
    sync = LocalUpdateSync(
        optimizer,
        unified(2),
        SimulatedWorkers(WORKERS),
        radial_directional=("params", "momenta"),
        **options,
    )
    first = 0
    if state is not None:
        weight.data.copy_(state["weight"])
        optimizer.load_state_dict(state["optimizer"])
        sync.load_state_dict(state["engine"])
        first = sync.step_count
    for step in range(first, steps):
        inputs = torch.randn(
            WORKERS, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step)
        )
        targets = torch.randn(
            WORKERS, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(99 + step)
        )
        optimizer.zero_grad()
        loss = (torch.einsum("wnd,wod->wno", inputs, weight) - targets).square().mean()
        loss.backward()
        sync.step()
    saved = {
        "weight": weight.detach().clone(),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "engine": copy.deepcopy(sync.state_dict()),
    }
    return saved


@pytest.mark.parametrize("delay", [0, 1])
def test_resume_continues_bit_identically(delay):
    whole = least_squares_run(7, delay=delay)
    halfway = least_squares_run(3, delay=delay)  # (with delay 1 a round is in flight at step 3)
    resumed = least_squares_run(7, state=halfway, delay=delay)
    assert torch.equal(resumed["weight"], whole["weight"])
    assert resumed["engine"]["radial"]["state_anchors"]
    for (k1, o1, a1), (k2, o2, a2) in zip(
        resumed["engine"]["radial"]["state_anchors"], whole["engine"]["radial"]["state_anchors"]
    ):
        assert (k1, o1) == (k2, o2) and torch.equal(a1, a2)


def test_radial_changes_training_only_where_asked():
    plain = least_squares_run(4)
    # the same run without radial averaging differs: the option is not a no-op
    gen = torch.Generator().manual_seed(0)
    weight = stacked(torch.randn(3, 4, dtype=torch.float64, generator=gen))
    optimizer = torch.optim.Adam([weight], lr=0.05)
    sync = LocalUpdateSync(optimizer, unified(2), SimulatedWorkers(WORKERS))
    for step in range(4):
        inputs = torch.randn(
            WORKERS, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step)
        )
        targets = torch.randn(
            WORKERS, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(99 + step)
        )
        optimizer.zero_grad()
        (torch.einsum("wnd,wod->wno", inputs, weight) - targets).square().mean().backward()
        sync.step()
    assert not torch.allclose(weight.detach(), plain["weight"])
    assert "norms" not in sync.traffic.bytes_by_kind
    assert sync.state_dict()["radial"] is None


@pytest.mark.parametrize(
    "policy, radial, options, message",
    [
        (unified(1), ("second-moment",), {}, "unknown kind 'second-moment'"),
        (keep_local(), ("params",), {}, "never averages the parameters"),
        (
            unified(1),
            ("params",),
            dict(codecs=SyncCodecs(params="int8", error_feedback=True)),
            "drop `error_feedback`",
        ),
    ],
)
def test_bad_settings_are_refused(policy, radial, options, message):
    param = torch.nn.Parameter(torch.zeros(WORKERS, 2))
    with pytest.raises(ValueError, match=message):
        LocalUpdateSync(
            torch.optim.SGD([param], lr=0.1),
            policy,
            SimulatedWorkers(WORKERS),
            radial_directional=radial,
            **options,
        )


def test_a_worker_left_out_for_nan_is_left_out_of_norms_and_directions():
    x0 = [torch.randn(4, dtype=torch.float64)]
    params, sync = params_sync(SyncPolicy(params=SyncRule(1)), x0, on_non_finite="skip")
    d = deltas(10, 4)
    d[1, 2] = float("nan")
    step_with(sync, params, [d])
    kept = d[[0, 2, 3]]
    expected = x0[0] - reference(kept)
    assert_close(params[0].detach(), expected.expand_as(params[0]), **EXACT)
    assert sync.skipped_rounds[0]["workers"] == [1]


def test_a_nan_worker_is_named_by_its_tensor_not_by_its_norm():
    params, sync = params_sync(
        SyncPolicy(params=SyncRule(1)), [torch.zeros(4, dtype=torch.float64)]
    )
    d = deltas(11, 4)
    d[2, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="worker 2: param 0 of group 0"):
        step_with(sync, params, [d])
