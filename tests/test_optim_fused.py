"""The fused step, by both kernels (the C++ one of the CPU and the compiled one that serves CUDA
and CPUs without the C++ build): equal to the foreach path to float rounding, no recompilation as
the learning rate, step or tensor sizes change, reproducible, and a clean fallback where it cannot
compile. Float64 equality with the literal reference is in test_optim_reference.py; the C++
kernel's own properties are in test_optim_native.py.

Every compiled kernel costs seconds on a cold cache (15-20 s on a busy 2-core machine), so the
tests share a few kernel specs: every variant at N = 1 in float64 and at N = 3 in float32 (the
momentum loop traced once and thrice, each float width), bfloat16 at N = 1. The C++ kernel, which
costs nothing more per spec, runs every variant at every N and dtype.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from functools import partial

import optimizer_cases as cases
import pytest
import torch

from mtdao import MTAdam
from mtdao.optim import compilation, native
from mtdao.optim.fused import ADAM, FUSED_MIN_MEAN_NUMEL, FUSED_MIN_NUMEL
from mtdao.optim.launch import PARALLEL_MIN_NUMEL, SLOTS

STEPS = 12
# (N, dtype) of the compiled kernels the tests share; the C++ kernel runs the whole product
COMPILED_SPECS = [(1, torch.float64), (3, torch.float32)]

# One intra-op thread except where a test says otherwise: on a busy 2-core machine a second thread
# turns each sub-millisecond step into tens of milliseconds of waiting (see conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


# a scalar, small tensors, one large enough for the multi-threaded branch and a non-contiguous
# one (a transposed leaf: its tensors take the eager branch)
make_params = partial(
    cases.make_params,
    shapes=[(), (5,), (3, 4), (PARALLEL_MIN_NUMEL + 3,)],
    drawn_in=torch.float64,
    transposed=True,
)
set_gradients = partial(cases.set_gradients, **cases.SPIKY)
train = partial(cases.train, steps=STEPS, changing_lr=True, **cases.SPIKY)


def make_optimizer(variant: str, num_momenta: int, params, **options):
    case = cases.OPTIMIZER_CASES[variant]
    betas, omegas = cases.MOMENTA[num_momenta]
    return case.optimizer_class(
        params,
        lr=1e-2,
        betas=betas,
        omegas=omegas,
        weight_decay=0.1,
        **case.hyperparameters,
        **options,
    )


def run(variant, num_momenta, dtype, pull: float = 0.5, **options):
    params = make_params(dtype)
    optimizer = make_optimizer(variant, num_momenta, params, **options)
    train(optimizer, params, pull=pull)
    return params, optimizer


def assert_same_run(actual, expected, **tolerance) -> None:
    (params, optimizer), (expected_params, expected_optimizer) = actual, expected
    for p, q in zip(params, expected_params):
        torch.testing.assert_close(p, q, **tolerance)
        state, expected_state = optimizer.state[p], expected_optimizer.state[q]
        assert set(state) == set(expected_state)
        for key, value in state.items():
            assert value.dtype == expected_state[key].dtype, key
            torch.testing.assert_close(value, expected_state[key], **tolerance)


@pytest.fixture
def fresh_kernels():
    """An empty kernel cache for the test, the shared one restored afterwards."""
    saved = dict(compilation._kernels)
    compilation.forget_compiled_kernels()
    yield
    compilation.forget_compiled_kernels()
    compilation._kernels.update(saved)


@pytest.fixture
def compiled_only(monkeypatch):
    """The compiled kernels only, as on a machine where the C++ kernel cannot be built."""
    monkeypatch.setattr(native, "native_library", lambda: False)
    native.forget_native_checks()
    yield
    native.forget_native_checks()


# compiling takes seconds: slow, so the file starts early in the suite (conftest.py)
COMPILED = pytest.param("compiled", marks=pytest.mark.slow)


@pytest.fixture(params=["native", COMPILED])
def kernel(request) -> Iterator[str]:
    """Each test that takes it runs with the C++ kernel, then with the compiled ones."""
    if request.param == "compiled":
        request.getfixturevalue("compiled_only")
        yield request.param
        return
    with warnings.catch_warnings():  # a C++ kernel that fails its check must fail the test
        warnings.filterwarnings("error", message="mtdao: the C\\+\\+ optimizer kernel")
        yield request.param


# --------------------------------------------------------------------------------------------
# Equality with the foreach path
# --------------------------------------------------------------------------------------------


def fused_cases() -> list:
    """(kernel, variant, N, dtype): the C++ kernel at every N and dtype, the compiled kernels at
    the shared specs."""
    params = []
    for kernel in ("native", "compiled"):
        for variant in sorted(cases.OPTIMIZER_CASES):
            for num_momenta in cases.MOMENTA:
                for dtype in (torch.float32, torch.float64):
                    if kernel == "native" or (num_momenta, dtype) in COMPILED_SPECS:
                        name = f"{kernel}-{variant}-{num_momenta}-{str(dtype)[6:]}"
                        case = (kernel, variant, num_momenta, dtype)
                        marks = [pytest.mark.slow] if kernel == "compiled" else []
                        params.append(pytest.param(*case, id=name, marks=marks))
    return params


@pytest.mark.parametrize(
    ("kernel", "variant", "num_momenta", "dtype"), fused_cases(), indirect=["kernel"]
)
def test_fused_matches_foreach(kernel, variant, num_momenta, dtype):
    fused = run(variant, num_momenta, dtype, fused=True)
    foreach = run(variant, num_momenta, dtype, foreach=True)
    initial = make_params(dtype)
    assert all(not torch.equal(p, x) for p, x in zip(fused[0], initial))  # everything moved
    assert_same_run(fused, foreach)  # torch's float32 / float64 rounding tolerances


@pytest.mark.parametrize("variant", sorted(cases.OPTIMIZER_CASES))
def test_bfloat16_params_with_float32_state_match_foreach(kernel, variant):
    # Gradients independent of the parameters: a parameter that rounds to the neighbouring
    # bfloat16 value on one path would otherwise feed different gradients to the states.
    fused = run(variant, 1, torch.bfloat16, pull=0.0, fused=True)
    foreach = run(variant, 1, torch.bfloat16, pull=0.0, foreach=True)
    for p, q in zip(fused[0], foreach[0]):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, q)  # both round the float32 result once: bfloat16 rounding
        for key, value in fused[1].state[p].items():
            assert key == "step" or value.dtype == torch.float32
            torch.testing.assert_close(value, foreach[1].state[q][key])  # float32 rounding


def test_many_tensors_share_calls_of_the_many_tensor_kernel(compiled_only):
    # 11 small and 9 large tensors: each group fills one call of SLOTS and pads a second
    generator = torch.Generator().manual_seed(3)
    sizes = [5 + 7 * i for i in range(11)] + [PARALLEL_MIN_NUMEL + 9 * i for i in range(9)]
    initial = [torch.randn(n, generator=generator) for n in sizes]
    runs = []
    for options in (dict(fused=True), dict(foreach=True)):
        params = [x.clone().requires_grad_(True) for x in initial]
        optimizer = make_optimizer("adam", 1, params, **options)
        train(optimizer, params, steps=4)
        runs.append((params, optimizer))
    assert_same_run(*runs)
    many = [spec for spec in compilation._kernels if spec.slots == SLOTS and spec.num_momenta == 1]
    assert any(compilation._kernels[spec] is not None for spec in many)


# --------------------------------------------------------------------------------------------
# One compilation per kernel spec, whatever changes between steps
# --------------------------------------------------------------------------------------------


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_nothing_recompiles_as_lr_step_omegas_and_sizes_change(kernel):
    params = make_params(torch.float32)
    optimizer = make_optimizer("adam", 3, params, fused=True)
    train(optimizer, params, steps=2)  # compiled (or loaded) here
    before = compiled_graphs()
    train(optimizer, params, steps=3, first_step=2)  # new lr and bias corrections every step
    optimizer.param_groups[0]["omegas"] = (0.1, 0.2, 0.3)
    optimizer.param_groups[0]["lr"] = torch.tensor(3e-3)  # a tensor lr
    train_with_tensor_lr(optimizer, params, steps=2)
    others = [torch.randn(n, requires_grad=True) for n in (1, 7, 3 * PARALLEL_MIN_NUMEL + 5)]
    optimizer.add_param_group({"params": others})  # new sizes, same dtype and N
    set_gradients(params + others, 0)
    optimizer.step()
    assert compiled_graphs() == before


def train_with_tensor_lr(optimizer, params, steps: int) -> None:
    for step in range(steps):
        optimizer.param_groups[0]["lr"].fill_(1e-3 * (step + 1))  # as an LR scheduler does
        set_gradients(params, step)
        optimizer.step()


@pytest.mark.parametrize("path", ["fused", "foreach"])
def test_tensor_lr_gives_the_float_lr_result(kernel, path):
    runs = []
    for as_tensor in (False, True):
        params = make_params(torch.float32)
        optimizer = make_optimizer("adam", 3, params, **{path: True})
        for step in range(5):
            lr = 1e-2 / (step + 1)
            as_given = torch.tensor(lr, dtype=torch.float64) if as_tensor else lr
            optimizer.param_groups[0]["lr"] = as_given
            set_gradients(params, step)
            optimizer.step()
        runs.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*runs))


# --------------------------------------------------------------------------------------------
# Reproducibility and checkpoints
# --------------------------------------------------------------------------------------------


def test_bit_for_bit_reproducible_and_independent_of_threads(kernel):
    results = []
    for count in (2, 1, 2):
        torch.set_num_threads(count)  # the one_thread fixture restores the count afterwards
        results.append(run("adopt", 3, torch.float32, fused=True)[0])
    for other in results[1:]:
        assert all(torch.equal(p, q) for p, q in zip(results[0], other))


@pytest.mark.parametrize("resume_with", ["fused", "foreach"])
def test_state_dict_round_trip(kernel, resume_with):
    params = make_params(torch.float32)
    optimizer = make_optimizer("adam", 3, params, fused=True)
    train(optimizer, params, steps=4)
    saved = copy.deepcopy(optimizer.state_dict())
    snapshot = [p.detach().clone() for p in params]
    train(optimizer, params, steps=4, first_step=4)

    resumed = [x.clone().requires_grad_(True) for x in snapshot]
    path = dict(fused=True) if resume_with == "fused" else dict(foreach=True)
    resumed_optimizer = make_optimizer("adam", 3, resumed, **path)
    resumed_optimizer.load_state_dict(saved)  # restores the saved options too: choose again
    group = resumed_optimizer.param_groups[0]
    group["fused"], group["foreach"] = path.get("fused"), path.get("foreach")
    train(resumed_optimizer, resumed, steps=4, first_step=4)
    tolerance = dict(rtol=0, atol=0) if resume_with == "fused" else {}  # bit for bit, or rounding
    assert_same_run((resumed, resumed_optimizer), (params, optimizer), **tolerance)


# --------------------------------------------------------------------------------------------
# Choosing the path
# --------------------------------------------------------------------------------------------


def assert_paths(large, too_few, too_small, expected_paths) -> None:
    state = torch.zeros(1)
    for options, on_large, elsewhere in expected_paths:
        optimizer = MTAdam(large, betas=(0.9, 0.99), omegas=(0.5, 0.5), **options)
        group = optimizer.param_groups[0]
        assert optimizer._path(group, large, state) == on_large, options
        assert optimizer._path(group, too_few, state) == elsewhere, options
        assert optimizer._path(group, too_small, state) == elsewhere, options


def buckets_of_each_size():
    large = [torch.zeros(FUSED_MIN_NUMEL // 2, requires_grad=True) for _ in range(2)]
    too_few = large[:1]  # large tensors, but too few elements in all to earn a compile back
    too_small = [
        torch.zeros(FUSED_MIN_MEAN_NUMEL // 2)
        for _ in range(2 * FUSED_MIN_NUMEL // FUSED_MIN_MEAN_NUMEL)
    ]
    return large, too_few, too_small


def test_default_takes_the_cpp_kernel_for_every_bucket():
    assert_paths(
        *buckets_of_each_size(),
        [
            ({}, "fused", "fused"),
            ({"fused": True}, "fused", "fused"),
            ({"foreach": True}, "foreach", "foreach"),
            ({"fused": False}, "foreach", "foreach"),
            ({"foreach": False}, "loop", "loop"),
        ],
    )


def test_default_takes_compiled_kernels_for_large_buckets_of_large_tensors_only(compiled_only):
    assert_paths(
        *buckets_of_each_size(),
        [
            ({}, "fused", "foreach"),
            ({"fused": True}, "fused", "fused"),
            ({"foreach": True}, "foreach", "foreach"),
            ({"fused": False}, "foreach", "foreach"),
            ({"foreach": False}, "loop", "loop"),
        ],
    )


def test_fused_and_foreach_together_is_an_error():
    with pytest.raises(ValueError, match="fused=True and foreach=True"):
        MTAdam([torch.zeros(3, requires_grad=True)], fused=True, foreach=True)


# --------------------------------------------------------------------------------------------
# Fallback where compiling fails
# --------------------------------------------------------------------------------------------


def failing_compile(function, **options):
    raise RuntimeError("simulated: no C++ compiler")


def wrong_compile(function, **options):
    return lambda *args: None  # "compiles", but computes nothing


@pytest.mark.parametrize(
    ("compile_function", "reason"),
    [(failing_compile, "no C++ compiler"), (wrong_compile, "not close")],
    ids=["compile-error", "wrong-result"],
)
def test_falls_back_to_foreach_with_one_warning(
    compiled_only, fresh_kernels, monkeypatch, compile_function, reason
):
    monkeypatch.setattr(compilation, "torch_compile", compile_function)
    params = make_params(torch.float32)
    optimizer = make_optimizer("sgd", 2, params, fused=True)
    with pytest.warns(RuntimeWarning, match="using the slower foreach path") as caught:
        train(optimizer, params, steps=1)
    (warning,) = [w for w in caught if "fused optimizer step" in str(w.message)]
    assert reason in str(warning.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second warning, no second attempt
        train(optimizer, params, steps=STEPS - 1, first_step=1)
    expected = run("sgd", 2, torch.float32, foreach=True)
    assert_same_run((params, optimizer), expected, rtol=0, atol=0)


def test_no_compiler_in_a_fresh_process_falls_back(tmp_path):
    script = textwrap.dedent(
        """
        import warnings, torch
        from mtdao import MTSGD
        torch.manual_seed(0)
        params = [torch.randn(64, requires_grad=True)]
        optimizer = MTSGD(params, lr=0.1, fused=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                params[0].grad = params[0].detach().clone()
                optimizer.step()
        messages = [str(w.message) for w in caught]
        native = [m for m in messages if "C++ optimizer kernel could not be built" in m]
        compiled = [m for m in messages if "fused optimizer step" in m]
        print(len(native), len(compiled), compiled[0] if compiled else "")
        """
    )
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-compiler"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
        TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"),  # no C++ kernel built before
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    native_warnings, compiled_warnings, message = result.stdout.strip().split(" ", 2)
    assert (native_warnings, compiled_warnings) == ("1", "1"), result.stdout
    assert "foreach path" in message


def test_availability_is_decided_once_per_spec(compiled_only, fresh_kernels, monkeypatch):
    calls = []

    def counting_compile(function, **options):
        calls.append(function.__name__)
        return torch.compile(function, **options)

    monkeypatch.setattr(compilation, "torch_compile", counting_compile)
    like = torch.zeros(1, dtype=torch.float64)  # a shared spec: on disk once compiled
    for _ in range(3):
        assert ADAM.available(1, like, like)
    assert len(calls) == 1
