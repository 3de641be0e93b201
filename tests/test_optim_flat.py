"""Parameters and states in flat buffers (``flat=True``; the CUDA default): views that stay views,
checkpoints that move between the flat and the per-tensor layouts, replaced tensors found and
copied back into their slots, and the same results as the per-tensor path (the literal
reference's float64 equality is in test_optim_reference.py, with every kernel).

On the CPU both layouts run the same C++ kernel, element by element.
"""

from __future__ import annotations

import copy
import gc
import io
import weakref
from functools import partial

import optimizer_cases as cases
import pytest
import torch
from torch import nn

from mtdao import MTAdam
from mtdao.optim import native
from mtdao.optim.flat import FLAT_BY_DEFAULT, fits_flat, flat_by_default
from mtdao.optim.fused import FUSED_MIN_NUMEL, fusing_pays
from mtdao.optim.reference import initial_state
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, SyncCodecs, unified

pytestmark = pytest.mark.usefixtures("one_thread")

N2 = dict(betas=(0.9, 0.99), omegas=(0.5, 0.3))
# one momentum for the compiled kernel: a spec test_optim_fused.py compiles too, so on a cold
# cache the run compiles it once
N1 = dict(betas=(0.9,), omegas=(0.5,))


# a scalar, small tensors and a transposed leaf (dense, not contiguous)
make_params = partial(
    cases.make_params, shapes=[(), (5,), (3, 4), (300,)], drawn_in=torch.float64, transposed=True
)
set_gradients = partial(cases.set_gradients, **cases.SPIKY)
train = partial(cases.train, changing_lr=True, **cases.SPIKY)


def clone_params(params) -> list[nn.Parameter]:
    """Copies with the same strides (a transposed leaf stays transposed)."""
    copies = []
    for p in params:
        copy_ = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype)
        copies.append(nn.Parameter(copy_.copy_(p.detach())))
    return copies


def make_optimizer(variant: str, params, momenta=N2, **options):
    case = cases.OPTIMIZER_CASES[variant]
    return case.optimizer_class(
        params, lr=1e-2, weight_decay=0.1, **momenta, **case.hyperparameters, **options
    )


def assert_same(params, optimizer, other_params, other_optimizer, **tolerance) -> None:
    """Bit for bit (both layouts put every element through the C++ kernel, a transposed one as a
    contiguous copy: the same operations in the same order), or within ``tolerance``."""
    tolerance = tolerance or dict(rtol=0.0, atol=0.0)
    for p, q in zip(params, other_params):
        torch.testing.assert_close(p.detach(), q.detach(), **tolerance)
        state, other = optimizer.state[p], other_optimizer.state[q]
        assert set(state) == set(other)
        for key, value in state.items():
            torch.testing.assert_close(value, other[key], **tolerance)


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def buckets(optimizer):
    return [b for flat_group in optimizer._flat_groups.values() for b in flat_group.buckets]


# --------------------------------------------------------------------------------------------
# Views
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(cases.OPTIMIZER_CASES))
def test_parameters_and_states_are_views_of_the_buffers_with_their_own_strides(variant):
    params = make_params()
    shapes_and_strides = [(p.shape, p.stride()) for p in params]
    optimizer = make_optimizer(variant, params, flat=True)
    train(optimizer, params, steps=2)
    (bucket,) = buckets(optimizer)
    for p, layout in zip(params, shapes_and_strides):
        assert (p.shape, p.stride()) == layout
        assert storage(p) == storage(bucket.param_buffer)
        state = optimizer.state[p]
        assert state["step"].item() == 2 and storage(state["step"]) == storage(bucket.steps)
        for key, buffer in bucket.state_buffers.items():
            assert storage(state[key]) == storage(buffer)
            assert (state[key].shape, state[key].stride()) == layout
    # every slot starts 256 bytes apart (from a buffer the allocator aligns)
    assert all((p.data_ptr() - bucket.param_buffer.data_ptr()) % 256 == 0 for p in params)


@pytest.mark.exact
@pytest.mark.parametrize("variant", sorted(cases.OPTIMIZER_CASES))
def test_flat_equals_per_tensor(variant):
    params, other = make_params(), make_params()
    flat, per_tensor = (
        make_optimizer(variant, ps, flat=f) for ps, f in ((params, True), (other, False))
    )
    train(flat, params, steps=12)
    train(per_tensor, other, steps=12)
    assert_same(params, flat, other, per_tensor)


def test_compiled_kernel_over_flat_buffers_matches_the_reference(monkeypatch):
    """The kernel CUDA takes (compiled), here on the CPU without the C++ kernel, against the
    literal reference in float64."""
    monkeypatch.setattr(native, "native_library", lambda: False)
    native.forget_native_checks()
    try:
        for variant, case in cases.OPTIMIZER_CASES.items():
            params = make_params()
            optimizer = make_optimizer(variant, params, N1, flat=True, fused=True)
            references = [
                (p.detach().clone(), initial_state(p.detach(), 1, variant != "sgd")) for p in params
            ]
            for step in range(8):
                lr = 1e-2 * (1.0 + 0.5 * (step % 3))
                optimizer.param_groups[0]["lr"] = lr
                set_gradients(params, step)
                hyper = dict(lr=lr, weight_decay=0.1, **N1, **case.hyperparameters)
                references = [
                    case.reference(x, p.grad, s, **hyper) for p, (x, s) in zip(params, references)
                ]
                optimizer.step()
            for p, (x, state) in zip(params, references):
                torch.testing.assert_close(p.detach(), x, rtol=1e-10, atol=1e-12)
                for key, value in state.items():
                    if key != "step":
                        torch.testing.assert_close(
                            optimizer.state[p][key], value, rtol=1e-10, atol=1e-12
                        )
    finally:
        native.forget_native_checks()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [True, False], ids=["compiled", "foreach"])
@pytest.mark.parametrize("variant", sorted(cases.OPTIMIZER_CASES))
def test_cuda_float32_matches_the_reference_and_the_per_tensor_path(variant, fused):
    case = cases.OPTIMIZER_CASES[variant]
    params = [nn.Parameter(p.detach().float().cuda()) for p in make_params()]
    per_tensor = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer = make_optimizer(variant, params, flat=True, fused=fused)
    other = make_optimizer(variant, per_tensor, flat=False, foreach=True)
    references = [
        (p.detach().double(), initial_state(p.detach().double(), 2, variant != "sgd"))
        for p in params
    ]
    for step in range(8):
        set_gradients(params, step)
        for p, q in zip(params, per_tensor):
            q.grad = p.grad.clone()
        hyper = dict(lr=1e-2, weight_decay=0.1, **N2, **case.hyperparameters)
        references = [
            case.reference(x, p.grad.double(), s, **hyper) for p, (x, s) in zip(params, references)
        ]
        optimizer.step()
        other.step()
    assert buckets(optimizer)
    for p, (x, _) in zip(params, references):
        torch.testing.assert_close(p.detach().double(), x, rtol=1e-4, atol=1e-5)
    assert_same(params, optimizer, per_tensor, other, rtol=1.3e-6, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def through_file(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.exact
def test_a_checkpoint_moves_from_flat_to_per_tensor_and_back():
    params = make_params()
    optimizer = make_optimizer("adam", params, flat=True)
    train(optimizer, params, steps=12)

    layouts = [True, False, True]  # 4 steps in each, a checkpoint through a file between
    resumed, resumed_optimizer, saved = None, None, None
    for index, flat in enumerate(layouts):
        if saved is None:
            resumed = make_params()
        else:
            resumed = clone_params(saved["params"])
        resumed_optimizer = make_optimizer("adam", resumed, flat=flat)
        if saved is not None:
            resumed_optimizer.load_state_dict(saved["optimizer"])
            resumed_optimizer.param_groups[0]["flat"] = flat  # the checkpoint brings its own
        train(resumed_optimizer, resumed, steps=4, first_step=4 * index)
        saved = through_file(
            {"params": [p.detach() for p in resumed], "optimizer": resumed_optimizer.state_dict()}
        )
        # per parameter: each state of each parameter is shaped like it
        for p, state in zip(resumed, saved["optimizer"]["state"].values()):
            assert all(v.shape == p.shape for k, v in state.items() if k != "step")
        assert bool(buckets(resumed_optimizer)) == flat
    assert_same(resumed, resumed_optimizer, params, optimizer)


@pytest.mark.exact
def test_load_state_dict_copies_into_the_buffers_it_has():
    params = make_params()
    optimizer = make_optimizer("adopt", params, flat=True)
    train(optimizer, params, steps=3)
    (bucket,) = buckets(optimizer)
    buffers = {key: buffer.data_ptr() for key, buffer in bucket.state_buffers.items()}
    other_params = make_params(seed=1)
    other = make_optimizer("adopt", other_params, flat=False)
    train(other, other_params, steps=5)

    optimizer.load_state_dict(through_file(other.state_dict()))
    assert buckets(optimizer) == [bucket]  # no second allocation
    for p, q in zip(params, other_params):
        state = optimizer.state[p]
        for key, buffer in bucket.state_buffers.items():
            assert state[key].data_ptr() - buffer.data_ptr() == state[key].data_ptr() - buffers[key]
            assert storage(state[key]) == storage(buffer)  # a view again
            assert torch.equal(state[key], other.state[q][key])
        assert state["step"].item() == 5
    for p, q in zip(params, other_params):
        p.data.copy_(q.detach())
    train(optimizer, params, steps=2, first_step=5)
    train(other, other_params, steps=2, first_step=5)
    assert_same(params, optimizer, other_params, other)


@pytest.mark.exact
def test_a_deep_copy_continues_as_the_original():
    params = make_params()
    optimizer = make_optimizer("adam", params, flat=True)
    train(optimizer, params, steps=3)
    copied_params, copied = copy.deepcopy((params, optimizer))
    train(optimizer, params, steps=3, first_step=3)
    train(copied, copied_params, steps=3, first_step=3)
    assert_same(params, optimizer, copied_params, copied)
    assert storage(copied_params[0]) != storage(params[0])


# --------------------------------------------------------------------------------------------
# Replaced tensors
# --------------------------------------------------------------------------------------------


def replace_some(params, optimizer) -> None:
    """What other code may do between steps: assign a state, a state dict, a parameter's data."""
    optimizer.state[params[1]]["exp_avg_0"] = torch.full((5,), 0.25, dtype=torch.float64)
    optimizer.state[params[2]] = {
        key: (value.clone() * 0.5 if key != "step" else value.clone())
        for key, value in optimizer.state[params[2]].items()
    }
    params[3].data = params[3].data.clone() + 1.0  # as model.to() or a checkpoint loader may


@pytest.mark.exact
def test_replaced_states_and_parameter_data_are_copied_into_their_slots():
    params, other = make_params(), make_params()
    flat = make_optimizer("adam", params, flat=True)
    per_tensor = make_optimizer("adam", other, flat=False)
    train(flat, params, steps=3)
    train(per_tensor, other, steps=3)
    (bucket,) = buckets(flat)
    replace_some(params, flat)
    replace_some(other, per_tensor)
    train(flat, params, steps=3, first_step=3)
    train(per_tensor, other, steps=3, first_step=3)
    assert_same(params, flat, other, per_tensor)
    assert buckets(flat) == [bucket]  # the same buffers, viewed again
    for p in params:
        assert storage(p) == storage(bucket.param_buffer)
        assert all(
            storage(v) in (storage(b) for b in (*bucket.state_buffers.values(), bucket.steps))
            for v in flat.state[p].values()
        )


def test_a_replacement_of_another_shape_is_a_clear_error():
    params = make_params()
    optimizer = make_optimizer("sgd", params, flat=True)
    train(optimizer, params, steps=2)
    optimizer.state[params[1]]["exp_avg_1"] = torch.zeros(7, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"exp_avg_1 of shape \(7,\) for a parameter of shape \(5,\)"
    ):
        train(optimizer, params, steps=1, first_step=2)


# --------------------------------------------------------------------------------------------
# Groups, gradients, dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.exact
def test_parameters_without_gradients_keep_their_own_steps():
    # params[1] frozen for the first steps (it joins the buffers later); params[3] skipped now and
    # then in the middle of the buffers (the update runs over the neighbours at each step)
    skip_at = {0: (1,), 1: (1,), 2: (1, 3), 5: (3,), 6: (0, 4)}
    params, other = make_params(), make_params()
    flat = make_optimizer("adam", params, flat=True)
    per_tensor = make_optimizer("adam", other, flat=False)
    train(flat, params, steps=9, skip_at=skip_at)
    train(per_tensor, other, steps=9, skip_at=skip_at)
    assert_same(params, flat, other, per_tensor)
    assert [flat.state[p]["step"].item() for p in params] == [8, 6, 9, 7, 8]
    assert len(buckets(flat)[0].params) == len(params)


def test_buffers_left_behind_are_freed():
    params = make_params()
    optimizer = make_optimizer("adam", params, flat=True)
    set_gradients(params, 0, skip=(2,))
    optimizer.step()
    (first,) = buckets(optimizer)
    storages = [b.untyped_storage() for b in (first.param_buffer, *first.state_buffers.values())]
    released = [weakref.ref(s) for s in storages]
    del first, storages
    train(optimizer, params, steps=1, first_step=1)  # params[2] joins: new buffers for all
    gc.collect()
    assert [r() for r in released] == [None] * len(released)
    assert len(buckets(optimizer)[0].params) == len(params)


@pytest.mark.exact
def test_groups_with_their_own_hyperparameters_and_number_of_momenta():
    def groups(params):
        return [
            {"params": params[:2], "lr": 3e-2, "betas": (0.9,), "omegas": (0.8,)},
            {
                "params": params[2:],
                "betas": (0.5, 0.99, 0.999),
                "omegas": (0.2, 0.3, 0.4),
                "weight_decay": 0.0,
            },
        ]

    params, other = make_params(), make_params()
    flat = MTAdam(groups(params), lr=1e-2, beta2=0.99, weight_decay=0.1, flat=True)
    per_tensor = MTAdam(groups(other), lr=1e-2, beta2=0.99, weight_decay=0.1, flat=False)
    for step in range(6):
        for optimizer, ps in ((flat, params), (per_tensor, other)):
            set_gradients(ps, step)
            optimizer.step()
    assert_same(params, flat, other, per_tensor)
    assert len(flat._flat_groups) == 2 and set(flat.state[params[4]]) == {
        "step",
        "exp_avg_0",
        "exp_avg_1",
        "exp_avg_2",
        "exp_avg_sq",
    }


@pytest.mark.exact
@pytest.mark.parametrize("variant", sorted(cases.OPTIMIZER_CASES))
def test_bfloat16_parameters_with_float32_states(variant):
    runs = []
    for flat in (True, False):
        params = make_params(torch.bfloat16)
        optimizer = make_optimizer(variant, params, flat=flat, fused=True)
        train(optimizer, params, steps=6)
        runs.append((params, optimizer))
    (params, flat), (other, per_tensor) = runs
    (bucket,) = buckets(flat)
    assert bucket.param_buffer.dtype == torch.bfloat16
    assert all(buffer.dtype == torch.float32 for buffer in bucket.state_buffers.values())
    assert_same(params, flat, other, per_tensor)


@pytest.mark.exact
def test_a_view_into_a_storage_laid_out_elsewhere_stays_where_it_is():
    """A parameter that views a larger storage (a framework's own flat buffer) keeps that view;
    the others go to the buffers, and the step is the same."""
    params = make_params()
    owner = torch.zeros(20, dtype=torch.float64)
    owner[2:7] = params[1].detach()
    params[1] = nn.Parameter(owner[2:7])
    other = clone_params(params)
    flat = make_optimizer("adopt", params, flat=True)
    per_tensor = make_optimizer("adopt", other, flat=False)
    train(flat, params, steps=4)
    train(per_tensor, other, steps=4)
    assert_same(params, flat, other, per_tensor)
    assert storage(params[1]) == storage(owner) and torch.equal(owner[2:7], params[1].detach())
    members = buckets(flat)[0].params
    assert all(p is not params[1] for p in members) and len(members) == 4


def test_a_new_optimizer_takes_over_parameters_an_earlier_one_laid_out():
    params = make_params()
    first = make_optimizer("sgd", params, flat=True)
    train(first, params, steps=2)
    assert all(fits_flat(p) for p in params)
    second = make_optimizer("sgd", params, flat=True)
    train(second, params, steps=1, first_step=2)
    (bucket,) = buckets(second)
    assert all(storage(p) == storage(bucket.param_buffer) for p in params)


@pytest.mark.parametrize("flat", [True, False])
def test_sparse_gradients_and_complex_parameters_are_refused(flat):
    p = nn.Parameter(torch.randn(4))
    optimizer = MTAdam([p], flat=flat)
    p.grad = torch.randn(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        optimizer.step()
    with pytest.raises(ValueError, match="does not support complex parameters"):
        MTAdam([nn.Parameter(torch.randn(3, dtype=torch.complex64))], flat=flat)


def test_invalid_flat_is_a_clear_error():
    with pytest.raises(ValueError, match="Invalid flat: 'yes'"):
        MTAdam([nn.Parameter(torch.randn(3))], flat="yes")


# --------------------------------------------------------------------------------------------
# The sync engine reads and writes the same states
# --------------------------------------------------------------------------------------------


def engine_run(flat: bool, delay: int, codecs: SyncCodecs | None):
    workers = 3
    generator = torch.Generator().manual_seed(0)
    weight = nn.Parameter(torch.randn(1, 4, 3, generator=generator).repeat(workers, 1, 1))
    bias = nn.Parameter(torch.randn(1, 4, generator=generator).repeat(workers, 1))
    optimizer = MTAdam([weight, bias], lr=1e-2, betas=(0.9, 0.99), omegas=(0.4, 0.5), flat=flat)
    sync = LocalUpdateSync(
        optimizer, unified(2), SimulatedWorkers(workers), delay=delay, codecs=codecs
    )
    for _ in range(8):  # rounds at steps 2, 4, 6 and 8
        inputs = torch.randn(workers, 8, 3, generator=generator)
        targets = torch.randn(workers, 8, 4, generator=generator)
        prediction = torch.einsum("wnd,wod->wno", inputs, weight) + bias.unsqueeze(1)
        optimizer.zero_grad()
        (prediction - targets).square().mean(dim=(1, 2)).sum().backward()
        sync.step()
    return [weight, bias], optimizer, sync


@pytest.mark.exact
@pytest.mark.parametrize(
    ("delay", "codecs"),
    [(0, None), (1, SyncCodecs(momenta="int8"))],
    ids=["blocking", "delayed-int8"],
)
def test_the_sync_engine_averages_the_flat_states(delay, codecs):
    params, flat, sync = engine_run(True, delay, codecs)
    other, per_tensor, other_sync = engine_run(False, delay, codecs)
    assert buckets(flat)
    assert_same(params, flat, other, per_tensor)
    assert sync.traffic.bytes == other_sync.traffic.bytes > 0
    for p in params:  # the workers' states agree after the last round (step 8)
        for key in ("exp_avg_0", "exp_avg_1", "exp_avg_sq"):
            state = flat.state[p][key]
            assert torch.equal(state, state[:1].expand_as(state)) or delay


# --------------------------------------------------------------------------------------------
# What fused=None, flat=None take
# --------------------------------------------------------------------------------------------


class FakeTensor:
    """The device and size of a tensor, which is all fusing_pays reads."""

    def __init__(self, numel: int, device: str) -> None:
        self.device, self._numel = torch.device(device), numel

    def numel(self) -> int:
        return self._numel


def test_the_defaults_table_per_device():
    assert FLAT_BY_DEFAULT == {"cuda": True}
    assert flat_by_default(torch.device("cuda")) and not flat_by_default(torch.device("cpu"))
    params = make_params(torch.float32)
    optimizer = MTAdam(params)
    train(optimizer, params, steps=1)
    assert optimizer._flat_groups == {}  # the CPU keeps its per-tensor buckets
    # on CUDA the compiled kernel pays over a flat buffer, not over many tensors
    assert fusing_pays([FakeTensor(FUSED_MIN_NUMEL, "cuda")])
    assert not fusing_pays([FakeTensor(FUSED_MIN_NUMEL // 100, "cuda")] * 100)
    assert not fusing_pays([FakeTensor(FUSED_MIN_NUMEL // 2, "cuda")])
