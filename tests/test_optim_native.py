"""The C++ kernel of the CPU fused step: the result of the element updates run eagerly, to float
rounding, for every variant, N and dtype; bit for bit the same whatever the thread count; clear
errors for bad input; and a build that fails gives one warning and a working optimizer, never a
crash.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import resources

import pytest
import torch

from mtdao import MTSGD, MTAdam, MTAdopt, native_build
from mtdao.optim import native
from mtdao.optim.fused import ADAM, ADOPT, SGD

RULES = {"adam": ADAM, "adopt": ADOPT, "sgd": SGD}
# Sizes that cross the kernel's chunk boundary (65536) and its threshold for threads (32768).
SIZES = [0, 1, 7, 1000, 65536 + 5]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not native_build.native_library():
        pytest.fail("the C++ kernel does not build on this machine (see the warning above)")


def tensor_sets(rule, num_momenta: int, param_dtype, state_dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def random(n, dtype, low=-1.0, high=1.0):
        values = torch.rand(n, generator=generator, dtype=torch.float64)
        return (low + (high - low) * values).to(dtype)

    xs = [random(n, param_dtype) for n in SIZES]
    gs = [random(n, param_dtype) * 3.0 for n in SIZES]  # beyond ADOPT's clip for some elements
    momenta = [[random(n, state_dtype) for n in SIZES] for _ in range(num_momenta)]
    vs = [random(n, state_dtype, 0.0, 1e-3) for n in SIZES] if rule.second_moment else []
    coefficients = torch.linspace(0.95, 0.05, 2 * num_momenta + rule.extra_coefficients)
    return xs, gs, momenta, vs, coefficients.to(torch.float64)


def eager_update(rule, xs, gs, momenta, vs, c) -> None:
    for i, (x, g) in enumerate(zip(xs, gs)):
        rule.update(x, g, [u[i] for u in momenta], vs[i] if vs else None, c)


def flat(sets) -> list[torch.Tensor]:
    xs, _, momenta, vs, _ = sets
    return xs + [u for per_momentum in momenta for u in per_momentum] + vs


DTYPES = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("num_momenta", [1, 2, 3, 5])  # 5: the general loop (1-4 are unrolled)
@pytest.mark.parametrize("variant", sorted(RULES))
def test_kernel_equals_the_eager_element_update(variant, num_momenta, dtypes):
    rule = RULES[variant]
    native_sets = tensor_sets(rule, num_momenta, *dtypes)
    eager_sets = tensor_sets(rule, num_momenta, *dtypes)
    before = [t.clone() for t in flat(native_sets)]
    native.run_native(rule.native_op, *native_sets)
    eager_update(rule, *eager_sets)
    for got, expected, old in zip(flat(native_sets), flat(eager_sets), before):
        assert got.dtype == expected.dtype
        # float rounding: torch's vectorized sqrt is not always correctly rounded, the kernel's is
        torch.testing.assert_close(got, expected)  # torch's tolerances for the dtype
        assert old.numel() == 0 or not torch.equal(got, old)  # the kernel wrote it


@pytest.mark.exact
@pytest.mark.parametrize("variant", sorted(RULES))
def test_result_is_the_same_for_every_thread_count(variant, one_thread):
    rule = RULES[variant]
    results = []
    for threads in (1, 2, 3, 1):
        torch.set_num_threads(threads)  # one_thread restores the count afterwards
        sets = tensor_sets(rule, 2, torch.float32, torch.float32)
        native.run_native(rule.native_op, *sets)
        results.append(flat(sets))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_bad_input_is_a_clear_error():
    xs, gs, momenta, vs, c = tensor_sets(ADAM, 1, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="a gradient has 6 elements, its parameter 7"):
        native.run_native("adam_step", xs, gs[:2] + [gs[2][:-1]] + gs[3:], momenta, vs, c)
    with pytest.raises(RuntimeError, match="expected 8 float64 coefficients"):
        native.run_native("adam_step", xs, gs, momenta, vs, c[:-1])
    with pytest.raises(RuntimeError, match="no kernel for Float parameters with Double state"):
        native.run_native("adam_step", xs, gs, [[u.double() for u in momenta[0]]], vs, c)
    mixed = [momenta[0][:3] + [momenta[0][3].double()] + momenta[0][4:]]
    with pytest.raises(RuntimeError, match="a momentum has dtype Double, expected Float"):
        native.run_native("adam_step", xs, gs, mixed, vs, c)


@pytest.mark.exact
@pytest.mark.parametrize("optimizer_class", [MTAdam, MTAdopt, MTSGD])
def test_transposed_parameters_take_the_kernel_on_a_copy_in_the_same_step(optimizer_class):
    # a transposed leaf is not contiguous: the kernel updates a contiguous copy, so bit for bit as
    # a contiguous parameter (the eager element update's sqrt is not always correctly rounded:
    # with a few thousand elements some would differ)
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(60, 40, generator=generator)
    transposed = weights.t().requires_grad_(True)
    contiguous = weights.t().contiguous().requires_grad_(True)
    optimizers = [optimizer_class([p], lr=0.1, fused=True) for p in (transposed, contiguous)]
    for _ in range(3):
        grad = torch.randn(transposed.shape, generator=generator)
        for p, optimizer in zip((transposed, contiguous), optimizers):
            p.grad = grad.clone()
            optimizer.step()
    assert not transposed.is_contiguous() and torch.equal(transposed, contiguous)
    for key, value in optimizers[0].state[transposed].items():
        assert torch.equal(value, optimizers[1].state[contiguous][key]), key


def test_the_source_ships_with_the_package():
    source = resources.files("mtdao.optim").joinpath("csrc", native_build.SOURCE)
    assert "TORCH_LIBRARY(mtdao_optim" in source.read_text()


def test_a_failed_build_warns_once_and_the_optimizer_still_steps(tmp_path):
    script = textwrap.dedent(
        """
        import warnings, torch
        from mtdao import MTAdam
        from mtdao.optim.compilation import _kernels
        params = [torch.ones(64, requires_grad=True)]
        optimizer = MTAdam(params, lr=0.1)  # the default: the fastest path available
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                params[0].grad = torch.ones(64)
                optimizer.step()
        messages = [str(w.message) for w in caught if "C++ optimizer kernel" in str(w.message)]
        print(len(messages), len(_kernels), float(params[0][0]))
        print(messages[0] if messages else "")
        """
    )
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-compiler"),
        TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"),  # no build from before
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    counts, message = result.stdout.strip().split("\n")
    warnings_seen, compiled, value = counts.split()
    assert warnings_seen == "1", result.stdout
    assert compiled == "0"  # a small model does not try compiling either: the foreach path
    assert float(value) < 1.0  # it stepped
    assert message.startswith("mtdao: the C++ optimizer kernel could not be built (")
    assert "no-such-compiler: not found" in message  # the cause, not the compiler's command line
    assert "-MMD" not in message


def test_a_broken_library_and_a_dead_builders_lock_lead_to_a_new_build(tmp_path, monkeypatch):
    # what a build killed while linking leaves: a truncated library and cpp_extension's lock file
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = resources.files("mtdao.optim").joinpath("csrc", native_build.SOURCE).read_text()
    name = native_build.build_name(source, native_build.build_flags())
    directory = tmp_path / name
    directory.mkdir()
    (directory / f"{name}.so").write_bytes(b"cut short")
    (directory / "lock").touch()
    builds = []

    def build(name, source, flags, directory, kernel):  # stands in for the real (slow) build
        assert not (directory / f"{name}.so").exists()
        assert not (directory / "lock").exists()
        builds.append(name)

    monkeypatch.setattr(native_build, "_build", build)
    native_build._build_and_load()
    assert len(builds) == 1
