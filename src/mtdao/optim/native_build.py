"""Building and loading the hand-written CPU kernel (``csrc/multi_tensor_step.cpp``).

The kernel is compiled with ``torch.utils.cpp_extension`` the first time a process asks for it and
kept in torch's extensions folder (``TORCH_EXTENSIONS_DIR``, by default under ``~/.cache``), so a
machine compiles it once; later processes only load it. The folder's name carries a hash of the
source, the flags and the torch version, so a changed source or another torch never loads a stale
build. The build needs a C++ compiler and ``ninja`` (a dependency of this package). If anything
fails, :func:`native_library` warns once and returns False; the optimizers then take the compiled
(inductor) kernels or the foreach path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import warnings
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import torch

SOURCE = "multi_tensor_step.cpp"

# -O3 vectorizes the kernel's loops; -fno-math-errno lets sqrt vectorize (errno is never read);
# -ffp-contract=off keeps each multiply and add rounded on its own, as torch's eager kernels do;
# -fopenmp makes at::parallel_for use torch's OpenMP threads (libgomp, already loaded by torch).
BASE_FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]

# Vector instructions by what torch found the CPU to support (part of the build's name, so a
# build for one CPU is never loaded on another that lacks its instructions).
ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}

# Whether the library is loaded: None until the first request decides it.
_loaded: bool | None = None


def native_library() -> bool:
    """Build (once per machine) and load (once per process) the CPU kernel; False if impossible.

    Its operators are then ``torch.ops.mtdao_optim.{adam,adopt,sgd}_step``.
    """
    global _loaded
    if _loaded is None:
        try:
            _build_and_load()
            _loaded = True
        except Exception as error:  # no compiler, no ninja, a failed build: use another path
            warnings.warn(
                f"mtdao: the C++ optimizer kernel could not be built ({_first_line(error)}); "
                "falling back to compiled or foreach kernels, which are slower on the CPU.",
                RuntimeWarning,
                stacklevel=2,
            )
            _loaded = False
    return _loaded


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def build_flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    return BASE_FLAGS + ISA_FLAGS.get(capability, [])


def build_name(source: str, flags: list[str]) -> str:
    """The extension's name: one per source, flag set, torch and Python version."""
    key = "\n".join([source, *flags, torch.__version__, sys.version])
    return f"mtdao_optim_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _build_and_load() -> None:
    from torch.utils import cpp_extension  # imported on first use: it is slow to import

    source = resources.files("mtdao.optim").joinpath("csrc", SOURCE).read_text()
    flags = build_flags()
    with _ninja_on_path():
        cpp_extension.load_inline(
            name=build_name(source, flags),
            cpp_sources=[source],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            no_implicit_headers=True,  # the source includes only what it uses: a faster build
        )


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put the ``ninja`` of this Python environment on PATH for the build (torch runs ``ninja``
    by name, and an environment used without activating it has its scripts off PATH)."""
    scripts = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if scripts in path.split(os.pathsep):
        yield
        return
    os.environ["PATH"] = os.pathsep.join([scripts, path]) if path else scripts
    try:
        yield
    finally:
        os.environ["PATH"] = path


def forget_native_library() -> None:
    """Decide again at the next request (tests use it to simulate a failed build)."""
    global _loaded
    _loaded = None
