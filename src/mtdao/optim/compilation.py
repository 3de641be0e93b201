"""Compiling the fused update kernels (``torch.compile``, inductor: C++/OpenMP on CPU, Triton on
CUDA) once per process and kernel spec. Every size is symbolic and every hyperparameter lives in
the coefficient tensor, so one compilation serves every tensor, learning rate and step. The first
request for a spec checks it against the same function run eagerly; a failure marks the spec
unavailable with one warning, and the optimizer takes its foreach path."""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# Scratch size of the first-use check. Inductor decides from the size it sees whether a CPU loop is
# worth spreading over threads; a small size would give a single-threaded kernel for all sizes.
PROBE_NUMEL = 1 << 16

INDUCTOR_OPTIONS = {
    # the kernel takes its thread count from torch.set_num_threads at each call (by default
    # inductor fixes the count it saw when compiling)
    "cpp.dynamic_threads": True,
    # trust the CPU's reported vector ISA instead of test-compiling a program for each candidate
    # (5-20 s on a cold cache); the check against eager below catches a compiler that cannot
    "cpp.vec_isa_ok": True,
}

# Called as torch_compile(function, **options); a test replaces it to simulate a failing compiler.
torch_compile = torch.compile

ElementUpdate = Callable[..., None]
# kernel(xs, gs, momenta, vs, c): lists of `slots` tensor sets (momenta[i] is the i-th set's list
# of N momenta, vs[i] its second moment or None) and the shared coefficients
Kernel = Callable[[list, list, list, list, Tensor], None]


@dataclass(frozen=True)
class KernelSpec:
    """What one compiled kernel is specialized to (everything else is a runtime value)."""

    update: ElementUpdate
    num_momenta: int
    num_coefficients: int
    second_moment: bool
    param_dtype: torch.dtype
    state_dtype: torch.dtype
    device: torch.device
    slots: int = 1  # tensor sets per call

    def describe(self) -> str:
        return (
            f"{self.update.__name__} with {self.num_momenta} momenta, "
            f"{self.param_dtype} parameters on {self.device}, {self.slots} tensors per call"
        )


# spec -> compiled kernel, or None where compiling failed (the caller falls back)
_kernels: dict[KernelSpec, Kernel | None] = {}


def compiled_kernel(spec: KernelSpec) -> Kernel | None:
    """The compiled kernel of ``spec`` (compiled and checked on first request), or None."""
    if spec not in _kernels:
        try:
            with warnings.catch_warnings():  # torch's own deprecation noise on first import
                warnings.simplefilter("ignore", DeprecationWarning)
                kernel = _compile(spec)
                _check_against_eager(kernel, spec)
        except Exception as error:  # any failure of the toolchain means: use the foreach path
            warnings.warn(
                f"mtdao: no fused optimizer step for {spec.describe()} ({_root_cause(error)}); "
                "using the slower foreach path. Pass fused=False to choose it explicitly.",
                RuntimeWarning,
                stacklevel=4,
            )
            kernel = None
        _kernels[spec] = kernel
    return _kernels[spec]


def _root_cause(error: BaseException) -> str:
    """``Type: first line`` of the innermost cause (torch wraps compiler errors several times)."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def _slotted(update: ElementUpdate, slots: int) -> Kernel:
    def kernel(xs: list, gs: list, momenta: list, vs: list, c: Tensor) -> None:
        for i in range(slots):  # unrolled when compiled: one loop over memory per tensor set
            update(xs[i], gs[i], momenta[i], vs[i], c)

    return kernel


def _compile(spec: KernelSpec) -> Kernel:
    kernel = _slotted(spec.update, spec.slots)
    # torch.compile keeps its cache of compiled graphs on the Python code object and stops
    # compiling after a few variants of one code object (then it runs eagerly); a code object of
    # its own per spec keeps every spec at one cache entry and one guard check per call.
    name = f"{spec.update.__name__}_{spec.num_momenta}_{spec.param_dtype}_{spec.slots}"
    name = "".join(ch if ch.isalnum() else "_" for ch in f"{name}_{spec.device}")
    code = kernel.__code__.replace(co_name=name)
    unique = types.FunctionType(code, kernel.__globals__, name, None, kernel.__closure__)
    return torch_compile(unique, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS)


def probe_inputs(spec: KernelSpec, slots: int | None = None, numel: int = PROBE_NUMEL) -> tuple:
    """Scratch tensor sets (``slots`` of them, by default the spec's, of about ``numel`` elements
    each) and coefficients."""
    generator = torch.Generator().manual_seed(0)

    def random(slot: int, dtype: torch.dtype, low: float = -1.0, high: float = 1.0) -> Tensor:
        # a different size per slot, so that the kernel does not assume equal sizes
        values = torch.rand(numel + 16 * slot, generator=generator, dtype=torch.float64)
        return (low + (high - low) * values).to(device=spec.device, dtype=dtype)

    slots = range(spec.slots if slots is None else slots)
    xs = [random(i, spec.param_dtype) for i in slots]
    gs = [random(i, spec.param_dtype) for i in slots]
    momenta = [[random(i, spec.state_dtype) for _ in range(spec.num_momenta)] for i in slots]
    vs = [random(i, spec.state_dtype, 0.0, 1.0) if spec.second_moment else None for i in slots]
    # plausible coefficients: decays, weights and step sizes all lie in (0, 1) in magnitude
    coefficients = torch.linspace(0.9, 0.1, spec.num_coefficients, dtype=torch.float64)
    return xs, gs, momenta, vs, coefficients.to(spec.device)


def _clone(inputs: tuple) -> tuple:
    xs, gs, momenta, vs, c = inputs
    momenta = [[u.clone() for u in set_momenta] for set_momenta in momenta]
    vs = [None if v is None else v.clone() for v in vs]
    return [x.clone() for x in xs], gs, momenta, vs, c


def written_tensors(inputs: tuple) -> list[Tensor]:
    xs, _, momenta, vs, _ = inputs
    momenta = [u for set_momenta in momenta for u in set_momenta]
    return xs + momenta + [v for v in vs if v is not None]


@torch.no_grad()
def _check_against_eager(kernel: Kernel, spec: KernelSpec) -> None:
    """Compile (first call) and compare one update with the same function run eagerly."""
    inputs = probe_inputs(spec)
    # the coefficient count is fixed per spec: a static size halves the time dynamo takes to trace
    torch._dynamo.mark_static(inputs[-1])
    compiled_run, eager_run = _clone(inputs), _clone(inputs)
    with _no_size_specialization():
        kernel(*compiled_run)
    _slotted(spec.update, spec.slots)(*eager_run)
    for got, expected in zip(written_tensors(compiled_run), written_tensors(eager_run)):
        torch.testing.assert_close(got, expected)


def _no_size_specialization():
    """Compile sizes 0 and 1 into the general kernel too (torch otherwise specializes on them and
    compiles again for a one-element parameter)."""
    try:
        from torch.fx.experimental import _config as symbolic_shapes_config

        return symbolic_shapes_config.patch(backed_size_oblivious=True)
    except (ImportError, AttributeError):  # older torch: at worst one more compilation
        return contextlib.nullcontext()


def forget_compiled_kernels() -> None:
    """Drop every compiled kernel and failure record (tests use it to force a fresh decision)."""
    _kernels.clear()
