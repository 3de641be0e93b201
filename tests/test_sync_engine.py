"""The sync engine on simulated, recording and scripted communicators: exact equivalences, call
counts, the outer step's sign and scale, non-finite guards, events, checkpoints and alignment."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from mtdao import MTAdam
from mtdao.methods import SyncConfig, method_parts
from mtdao.methods.optimizers import build_optimizer
from mtdao.sync import (
    LocalUpdateSync,
    NonFiniteError,
    OuterOptimizerConfig,
    SimulatedWorkers,
    SyncPolicy,
    SyncRule,
    explicit,
    gradient_averaging,
    half_life_policy,
    state_decays,
    unified,
)
from mtdao.sync.policy import communication_per_step
from mtdao.sync.testing import PeerFailure, RecordingCommunicator, ScriptedCommunicator
from mtdao.train.config import TrainConfig, resolve

D_IN, D_OUT, BATCH = 4, 3, 8
EXACT = dict(rtol=1e-12, atol=1e-12)
STATE_KEYS = ("exp_avg_0", "exp_avg_sq")


# -- a least-squares problem where worker w has its own data ------------------------------------


def batch(worker: int, step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 * worker + step)
    inputs = torch.randn(BATCH, D_IN, generator=gen, dtype=torch.float64)
    targets = torch.randn(BATCH, D_OUT, generator=gen, dtype=torch.float64)
    return inputs, targets


def stacked_batch(workers: Sequence[int], step: int) -> tuple[Tensor, Tensor]:
    pairs = [batch(w, step) for w in workers]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def loss_fn(weight: Tensor, bias: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
    """Sum over workers of each worker's mean squared error (with or without a worker dim)."""
    prediction = torch.einsum("...nd,...od->...no", inputs, weight) + bias.unsqueeze(-2)
    return 0.5 * (prediction - targets).square().mean(dim=(-2, -1)).sum()


def init_params(num_workers: int | None = None, bias_dtype=torch.float64) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(D_OUT, D_IN, generator=gen, dtype=torch.float64)
    bias = torch.randn(D_OUT, generator=gen, dtype=torch.float64).to(bias_dtype)
    if num_workers is not None:
        weight = weight.expand(num_workers, *weight.shape).clone()
        bias = bias.expand(num_workers, *bias.shape).clone()
    return [torch.nn.Parameter(weight), torch.nn.Parameter(bias)]


def named_groups(params: list[Tensor]) -> list[dict]:
    return [{"params": params, "names": ["weight", "bias"]}]


def backward(params: list[Tensor], workers: Sequence[int], step: int, optimizer) -> None:
    optimizer.zero_grad()
    weight, bias = params
    inputs, targets = stacked_batch(workers, step)
    loss_fn(weight, bias.double(), inputs, targets).backward()


# -- 1. SGD averaged every step is SGD on the mean gradient ------------------------------------


def test_sgd_with_params_averaged_every_step_is_sgd_on_the_mean_gradient():
    workers, lr = 4, 0.2
    params = init_params(workers)
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.0)
    sync = LocalUpdateSync(optimizer, unified(1), SimulatedWorkers(workers))
    reference = [p.detach()[0].clone().requires_grad_() for p in params]
    for step in range(10):
        backward(params, range(workers), step, optimizer)
        sync.step()
        mean_loss = sum(loss_fn(*reference, *batch(w, step)) for w in range(workers)) / workers
        grads = torch.autograd.grad(mean_loss, reference)
        with torch.no_grad():
            for ref, grad in zip(reference, grads):
                ref.sub_(lr * grad)
        for param, ref in zip(params, reference):
            for w in range(workers):
                assert_close(param[w], ref, **EXACT)
    assert sync.communicator.traffic.rounds == 10


# -- 4. which states travel when, and what it costs --------------------------------------------


EXPLICIT_PERIODS = dict(params=2, states={"exp_avg_0": 3, "exp_avg_sq": 6})
# Steps 1..12 at which each kind is due (K_x = 2, K_u = 3, K_v = 6).
DUE = {
    2: ["params"],
    3: ["exp_avg_0"],
    4: ["params"],
    6: ["params", "exp_avg_0", "exp_avg_sq"],
    8: ["params"],
    9: ["exp_avg_0"],
    10: ["params"],
    12: ["params", "exp_avg_0", "exp_avg_sq"],
}


def expected_call(kinds: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    shapes = {"weight": (D_OUT, D_IN), "bias": (D_OUT,)}
    call = [("params", shape) for shape in shapes.values()] if "params" in kinds else []
    for shape in shapes.values():  # states follow the params, per parameter, keys sorted
        call += [(kind, shape) for kind in kinds if kind != "params"]
    return call


def averaged(calls) -> list[list[tuple[str, tuple[int, ...]]]]:
    return [list(zip(c.kinds, c.shapes)) for c in calls if c.method == "average"]


def test_recording_communicator_pins_which_states_are_due_at_each_step():
    params = init_params()
    optimizer = MTAdam(params, lr=1e-2, betas=(0.9,), omegas=(1.0,))
    communicator = RecordingCommunicator()
    sync = LocalUpdateSync(optimizer, explicit(**EXPLICIT_PERIODS), communicator)
    for step in range(1, 13):
        before = len(communicator.calls)
        backward(params, [0], step, optimizer)
        sync.step()
        new_calls = averaged(communicator.calls[before:])
        if step in DUE:
            assert new_calls == [expected_call(DUE[step])], f"step {step}"
        else:
            assert new_calls == [], f"step {step}"
    assert [(e.step, e.kinds) for e in sync.events] == [(step, DUE[step]) for step in DUE]


def test_one_simulated_worker_sends_nothing():
    """A simulation of one worker has no one to send to: its rounds count, their bytes do not."""
    params = init_params(1)
    optimizer = MTAdam(params, lr=1e-2, betas=(0.9,), omegas=(1.0,))
    sync = LocalUpdateSync(optimizer, explicit(**EXPLICIT_PERIODS), SimulatedWorkers(1))
    for step in range(12):
        backward(params, [0], step, optimizer)
        sync.step()
    traffic = sync.communicator.traffic
    assert traffic.rounds == 8 and traffic.bytes == traffic.collectives == 0
    assert traffic.reduction_vs_ddp() is None and str(traffic).startswith("0 B sent per worker")


@pytest.mark.parametrize("bias_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("simulated", [True, False])
def test_traffic_counts_collectives_and_bytes_per_kind(simulated, bias_dtype):
    workers = 3 if simulated else None
    params = init_params(workers, bias_dtype=bias_dtype)
    optimizer = MTAdam(params, lr=1e-2, betas=(0.9,), omegas=(1.0,))
    communicator = SimulatedWorkers(workers) if simulated else RecordingCommunicator()
    policy = explicit(**EXPLICIT_PERIODS)
    sync = LocalUpdateSync(optimizer, policy, communicator)
    for step in range(12):
        backward(params, range(workers or 1), step, optimizer)
        sync.step()
    model_bytes = D_OUT * D_IN * 8 + D_OUT * bias_dtype.itemsize
    traffic = communicator.traffic
    assert traffic.rounds == 8  # steps 2, 3, 4, 6, 8, 9, 10, 12
    assert traffic.collectives == 8 * (1 if bias_dtype == torch.float64 else 2)
    assert traffic.bytes_by_kind == {
        "params": 6 * model_bytes,
        "exp_avg_0": 4 * model_bytes,
        "exp_avg_sq": 2 * model_bytes,
    }
    assert traffic.bytes == 12 * model_bytes
    keys = sorted(optimizer.state[params[0]])
    assert traffic.bytes / (12 * model_bytes) == pytest.approx(communication_per_step(policy, keys))
    # the engine's record of each round adds up to the traffic account
    assert sum(e.bytes for e in sync.events) == traffic.bytes
    assert sum(e.collectives for e in sync.events) == traffic.collectives
    assert [e.bytes for e in sync.events if e.step == 12] == [3 * model_bytes]


# -- 5. the outer step: sign and scale ----------------------------------------------------------


def test_outer_step_sign_and_scale_with_a_mocked_collective():
    x0 = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    param = torch.nn.Parameter(x0.clone())
    d = torch.tensor([0.5, 0.25, -1.0], dtype=torch.float64)
    communicator = ScriptedCommunicator([[x0 - d]])  # the workers moved by -d on average
    policy = SyncPolicy(params=SyncRule(1), outer=OuterOptimizerConfig())
    sync = LocalUpdateSync(torch.optim.SGD([param], lr=0.0), policy, communicator)
    param.grad = torch.zeros_like(param)
    sync.step()
    x1 = x0 - 0.7 * 1.9 * d  # buffer = d, Nesterov step = d + 0.9 d
    assert_close(param.detach(), x1, **EXACT)
    assert_close(sync.rounds.anchors[0], x1, **EXACT)


def test_outer_momentum_warm_up_starts_each_run_at_its_start_value():
    """W = 1 from 0: the first outer step has no momentum, the second the configured one."""
    workers = 3
    x0 = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(x0.expand(workers, 5).clone())
    optimizer = torch.optim.SGD([param], lr=1.0)  # worker w moves to x - grad_w
    outer = OuterOptimizerConfig(lr=0.7, momentum=0.9, momentum_warmup=1, momentum_start=0.0)
    sync = LocalUpdateSync(
        optimizer, SyncPolicy(params=SyncRule(2), outer=outer), SimulatedWorkers(workers)
    )
    gen = torch.Generator().manual_seed(2)
    d, e = (torch.randn(workers, 5, dtype=torch.float64, generator=gen) for _ in range(2))
    for grad in (d, torch.zeros_like(d)):  # the round of steps 1-2 moves each worker by -d
        param.grad = grad.clone()
        sync.step()
    x1 = x0 - 0.7 * d.mean(dim=0)  # momentum 0: buffer = step = the pseudo-gradient
    assert_close(param.detach(), x1.expand(workers, 5), **EXACT)
    for grad in (e, torch.zeros_like(e)):
        param.grad = grad.clone()
        sync.step()
    buffer = 0.9 * d.mean(dim=0) + e.mean(dim=0)
    x2 = x1 - 0.7 * (e.mean(dim=0) + 0.9 * buffer)
    assert_close(param.detach(), x2.expand(workers, 5), **EXACT)


def test_outer_step_on_simulated_workers_two_rounds():
    workers = 3
    x0 = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(x0.expand(workers, 5).clone())
    optimizer = torch.optim.SGD([param], lr=1.0)  # worker w moves to x - grad_w
    policy = SyncPolicy(params=SyncRule(1), outer=OuterOptimizerConfig(lr=0.7, momentum=0.9))
    sync = LocalUpdateSync(optimizer, policy, SimulatedWorkers(workers))
    gen = torch.Generator().manual_seed(2)

    d = torch.randn(workers, 5, dtype=torch.float64, generator=gen)
    param.grad = d.clone()
    sync.step()
    d_mean = d.mean(dim=0)
    x1 = x0 - 0.7 * (d_mean + 0.9 * d_mean)
    assert_close(param.detach(), x1.expand(workers, 5), **EXACT)

    e = torch.randn(workers, 5, dtype=torch.float64, generator=gen)
    param.grad = e.clone()
    sync.step()
    e_mean = e.mean(dim=0)
    buffer = 0.9 * d_mean + e_mean
    x2 = x1 - 0.7 * (e_mean + 0.9 * buffer)
    assert_close(param.detach(), x2.expand(workers, 5), **EXACT)

    state = sync.state_dict()
    (saved_buffer,) = state["outer"]["momentum_buffers"]
    assert saved_buffer.shape == x0.shape  # one global buffer: identical on every worker
    assert_close(saved_buffer, buffer, **EXACT)
    assert_close(state["anchors"][0], x2, **EXACT)


# -- 7. torch's own AdamW -----------------------------------------------------------------------


def test_torch_adamw_attached_with_identical_data_is_plain_adamw():
    workers, steps = 2, 9
    params = init_params(workers)
    optimizer = torch.optim.AdamW(params, lr=0.05, betas=(0.9, 0.999), weight_decay=0.1)
    policy = half_life_policy(2, state_decays(optimizer))
    assert policy.periods() == {
        "params": 2,
        "exp_avg": 6,
        "exp_avg_sq": 32,
        "other states": 2,
    }
    sync = LocalUpdateSync(optimizer, policy, SimulatedWorkers(workers))
    reference = init_params()
    plain = torch.optim.AdamW(reference, lr=0.05, betas=(0.9, 0.999), weight_decay=0.1)
    with sync.attached(final_round=False):  # the rounds the periods make, no more
        for step in range(steps):
            backward(params, [0] * workers, step, optimizer)
            optimizer.step()
            backward(reference, [0], step, plain)
            plain.step()
    assert sync.step_count == steps
    assert sync.communicator.traffic.bytes_by_kind.keys() == {"params", "exp_avg"}
    backward(params, [0] * workers, steps, optimizer)
    optimizer.step()  # hooks are gone after the block
    assert sync.step_count == steps
    for param in params:
        assert torch.equal(param[0], param[1])
    backward(reference, [0], steps, plain)
    plain.step()
    for param, ref in zip(params, reference):
        assert_close(param[0], ref.detach(), **EXACT)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(optimizer.state[param][key][1], plain.state[ref][key], **EXACT)


def test_torch_adamw_state_keys_follow_their_own_periods():
    workers = 3
    params = init_params(workers)
    optimizer = torch.optim.AdamW(params, lr=0.05)
    policy = explicit(params=None, states={"exp_avg": 2}, other_states=None)
    sync = LocalUpdateSync(optimizer, policy, SimulatedWorkers(workers))
    with sync.attached():
        for step in range(2):
            backward(params, range(workers), step, optimizer)
            optimizer.step()
    for param in params:
        state = optimizer.state[param]
        assert torch.equal(state["exp_avg"][0], state["exp_avg"][2])
        assert not torch.equal(state["exp_avg_sq"][0], state["exp_avg_sq"][2])
        assert not torch.equal(param[0], param[2])

    wrong = LocalUpdateSync(
        torch.optim.AdamW(init_params(workers), lr=0.05),
        explicit(params=1, states={"exp_avg_0": 2}),
        SimulatedWorkers(workers),
    )
    for param in wrong.params:
        param.grad = torch.ones_like(param)
    with pytest.raises(ValueError, match=r"\['exp_avg', 'exp_avg_sq'\]"):
        wrong.step()


# -- 8. non-finite values -----------------------------------------------------------------------


def nan_run(policy, on_non_finite="raise", workers=3):
    params = init_params(workers)
    optimizer = MTAdam(named_groups(params), lr=1e-2, betas=(0.9,), omegas=(1.0,))
    sync = LocalUpdateSync(
        optimizer, policy, SimulatedWorkers(workers), on_non_finite=on_non_finite
    )
    return params, optimizer, sync


def test_nan_in_one_worker_raises_naming_worker_tensor_and_step():
    params, optimizer, sync = nan_run(unified(2))
    backward(params, range(3), 0, optimizer)
    sync.step()
    backward(params, range(3), 1, optimizer)
    params[1].grad[1, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 2 in worker 1: bias\b") as error:
        sync.step()
    assert "worker 0" not in str(error.value) and "worker 2" not in str(error.value)
    assert torch.isfinite(params[1][0]).all()  # nothing was averaged into the good workers


def test_nan_in_an_optimizer_state_names_the_state_key():
    policy = explicit(params=None, states={"exp_avg_sq": 2})
    params, optimizer, sync = nan_run(policy)
    backward(params, range(3), 0, optimizer)
    sync.step()
    optimizer.state[params[0]]["exp_avg_sq"][2, 0, 0] = float("nan")
    backward(params, range(3), 1, optimizer)
    with pytest.raises(NonFiniteError, match=r"step 2 in worker 2: exp_avg_sq of weight"):
        sync.step()


def test_skip_leaves_the_bad_worker_out_and_training_continues():
    params, optimizer, sync = nan_run(unified(1), on_non_finite="skip")
    for step in range(6):
        backward(params, range(3), step, optimizer)
        if step == 2:
            params[0].grad[1].fill_(float("inf"))
        sync.rounds.before_step()
        optimizer.step()
        local = {
            name: [p.detach().clone()] + [optimizer.state[p][key].clone() for key in STATE_KEYS]
            for name, p in zip(("weight", "bias"), params)
        }
        sync.rounds.after_step()
        good = [0, 2] if step == 2 else [0, 1, 2]
        for param, name in zip(params, ("weight", "bias")):
            synced = [param.detach()] + [optimizer.state[param][key] for key in STATE_KEYS]
            for now, before in zip(synced, local[name]):
                assert torch.isfinite(now).all()
                assert_close(now, before[good].mean(0).expand_as(now), **EXACT)
    assert len(sync.skipped_rounds) == 1
    skipped = sync.skipped_rounds[0]
    assert skipped["step"] == 3 and skipped["workers"] == [1]
    assert "weight" in skipped["tensors"]
    assert all(torch.isfinite(t).all() for p in params for t in optimizer.state[p].values())


def test_nan_gradient_under_gradient_averaging_is_caught():
    params, optimizer, sync = nan_run(gradient_averaging())
    backward(params, range(3), 0, optimizer)
    params[0].grad[0, 1, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 1 in worker 0: gradient of weight"):
        sync.step()
    assert sync.step_count == 0 and "step" not in optimizer.state[params[0]]

    params, optimizer, sync = nan_run(gradient_averaging(), on_non_finite="skip")
    backward(params, range(3), 0, optimizer)
    params[0].grad[0, 1, 1] = float("nan")
    expected = [p.grad[1:].mean(0) for p in params]
    sync.step()
    for param, grad in zip(params, expected):
        assert_close(param.grad, grad.expand_as(param), **EXACT)
        assert torch.isfinite(param).all() and torch.equal(param[0], param[2])
    assert sync.skipped_rounds[0]["workers"] == [0]


# -- 9. checkpoints -----------------------------------------------------------------------------


def checkpoint_run(method: str, params: list[Tensor], broadcast_initial: bool = True):
    config = resolve(TrainConfig.of(method=method, optimizer="adam", lr=2e-2, weight_decay=0.0))
    optimizer = build_optimizer(
        named_groups(params), config.sync, config.lr_schedule.lr, config.training.weight_decay
    )
    policy = method_parts(SyncConfig(method=method, sync_period=4), optimizer).sync_policy()
    sync = LocalUpdateSync(
        optimizer, policy, SimulatedWorkers(3), broadcast_initial=broadcast_initial
    )
    return optimizer, sync


@pytest.mark.exact
@pytest.mark.parametrize("method", ["diloco", "mtdao"])
def test_state_dict_round_trip_mid_round_continues_identically(method):
    steps, split = 11, 6  # rounds at 4 and 8: the checkpoint falls inside a round
    params = init_params(3)
    original_optimizer, original_sync = checkpoint_run(method, params)
    for step in range(steps):
        backward(params, range(3), step, original_optimizer)
        original_sync.step()

    first = init_params(3)
    optimizer, sync = checkpoint_run(method, first)
    for step in range(split):
        backward(first, range(3), step, optimizer)
        sync.step()
    saved = copy.deepcopy(
        {
            "params": [p.detach() for p in first],
            "optimizer": optimizer.state_dict(),
            "sync": sync.state_dict(),
        }
    )
    del first, optimizer, sync

    resumed = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    optimizer, sync = checkpoint_run(method, resumed, broadcast_initial=False)
    optimizer.load_state_dict(saved["optimizer"])
    sync.load_state_dict(saved["sync"])
    for step in range(split, steps):
        backward(resumed, range(3), step, optimizer)
        sync.step()

    for param, original in zip(resumed, params):
        assert torch.equal(param, original)
        for key, value in original_optimizer.state[original].items():
            assert torch.equal(optimizer.state[param][key], value), key
    assert sync.state_dict()["traffic"] == original_sync.state_dict()["traffic"]
    assert sync.state_dict()["events"] == original_sync.state_dict()["events"]
    assert [e["step"] for e in sync.state_dict()["events"]] == [4, 8]
    if sync.rounds.outer is not None:
        for buffer, other in zip(
            sync.rounds.outer.momentum_buffers, original_sync.rounds.outer.momentum_buffers
        ):
            assert torch.equal(buffer, other)
    assert sync.state_dict()["traffic"]["bytes"] > 0
    if method == "diloco":
        assert sync.state_dict()["outer"] is not None


# -- 10. alignment ------------------------------------------------------------------------------


@pytest.mark.parametrize("identical", [True, False])
def test_alignment_of_pseudo_gradients(identical):
    workers = 4
    params = init_params(workers)
    optimizer = MTAdam(params, lr=1e-2, betas=(0.9,), omegas=(1.0,))
    sync = LocalUpdateSync(optimizer, unified(3), SimulatedWorkers(workers), track_alignment=True)
    data_workers = [0] * workers if identical else list(range(workers))
    for step in range(9):
        backward(params, data_workers, step, optimizer)
        sync.step()
    assert [entry["step"] for entry in sync.alignment] == [3, 6, 9]
    for entry in sync.alignment:
        assert len(entry["cosine"]) == len(entry["drift"]) == workers
        if identical:
            assert entry["cosine"] == pytest.approx([1.0] * workers, abs=1e-6)
            assert entry["drift"] == [0.0] * workers
        else:
            assert all(-1.0 <= c < 0.999 for c in entry["cosine"])
            assert all(d > 0.0 for d in entry["drift"])


def test_alignment_gathers_are_waited_for_only_when_read():
    """The gathers travel behind the next steps (on a process group): no round waits for them."""
    workers, waits = 4, []
    communicator = SimulatedWorkers(workers)
    gather_later = communicator.layout.gather_later

    class Counted:
        def __init__(self, values):
            self.work = gather_later(values)

        def wait(self):
            waits.append(1)
            return self.work.wait()

    communicator.layout.gather_later = Counted
    params = init_params(workers)
    optimizer = MTAdam(params, lr=1e-2, betas=(0.9,), omegas=(1.0,))
    sync = LocalUpdateSync(optimizer, unified(3), communicator, track_alignment=True)
    for step in range(9):
        backward(params, list(range(workers)), step, optimizer)
        sync.step()
    assert waits == []
    assert [entry["step"] for entry in sync.alignment] == [3, 6, 9]
    assert len(waits) == 3  # one gather per sync, waited for once
    assert [entry["step"] for entry in sync.alignment] == [3, 6, 9]
    assert len(waits) == 3


def test_states_of_a_zero_dim_parameter_are_averaged_like_any_other():
    """A real process group holds a scalar parameter as a 0-dim tensor; its states must travel."""
    scale = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    optimizer = MTAdam([scale], lr=1e-2, betas=(0.9,), omegas=(1.0,))
    communicator = RecordingCommunicator()
    sync = LocalUpdateSync(optimizer, unified(1), communicator)
    scale.grad = torch.tensor(0.5, dtype=torch.float64)
    sync.step()
    assert averaged(communicator.calls) == [[("params", ()), ("exp_avg_0", ()), ("exp_avg_sq", ())]]


# -- 11. the step sequence: gradient hooks, failed rounds ---------------------------------------


@pytest.mark.parametrize("attached", [False, True])
def test_gradient_hook_sees_averaged_gradients_and_the_step_sees_its_changes(attached):
    workers, lr = 3, 0.5
    params = init_params(workers)
    optimizer = torch.optim.SGD(params, lr=lr)
    sync = LocalUpdateSync(optimizer, gradient_averaging(), SimulatedWorkers(workers))
    seen = []

    def halve_gradients():
        seen.append([p.grad.clone() for p in params])
        for p in params:
            p.grad.mul_(0.5)

    handle = sync.register_gradient_hook(halve_gradients)
    backward(params, range(workers), 0, optimizer)
    local = [p.grad.clone() for p in params]
    before = [p.detach().clone() for p in params]
    if attached:
        with sync.attached():
            optimizer.step()
    else:
        sync.step()
    for grad, local_grad in zip(seen[0], local):
        assert_close(grad, local_grad.mean(0).expand_as(grad), **EXACT)  # averaged first
    for param, start, grad in zip(params, before, seen[0]):
        assert_close(param.detach(), start - lr * 0.5 * grad, **EXACT)  # then halved, then stepped
    handle.remove()
    backward(params, range(workers), 1, optimizer)
    sync.step()
    assert len(seen) == 1 and sync.step_count == 2


def test_a_round_that_fails_overwrites_nothing():
    params = init_params()
    optimizer = MTAdam(params, lr=1e-2, betas=(0.9,), omegas=(1.0,))
    communicator = ScriptedCommunicator(fail_at=2)
    sync = LocalUpdateSync(optimizer, unified(1), communicator)
    backward(params, [0], 0, optimizer)
    sync.step()
    backward(params, [0], 1, optimizer)
    optimizer.step()
    local = [p.detach().clone() for p in params]
    with pytest.raises(PeerFailure):
        sync.rounds.after_step()
    assert [c.method for c in communicator.calls[-2:]] == ["assign", "average"]
    assert all(torch.equal(p, value) for p, value in zip(params, local))
    assert [e.step for e in sync.events] == [1]


def test_traffic_reads_in_units_and_against_ddp():
    params = init_params(2)
    optimizer = torch.optim.SGD(params, lr=0.1)
    sync = LocalUpdateSync(optimizer, unified(4), SimulatedWorkers(2))
    for step in range(8):
        backward(params, range(2), step, optimizer)
        sync.step()
    model_bytes = (D_OUT * D_IN + D_OUT) * 8
    assert sync.traffic.ddp_bytes == 8 * model_bytes and sync.traffic.bytes == 2 * model_bytes
    text = str(sync.traffic)
    assert text.startswith("240 B sent per worker in 2 rounds (2 collectives) over 8 steps")
    assert text.endswith("DDP would send 960 B: 4.0x more")
