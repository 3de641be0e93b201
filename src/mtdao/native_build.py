"""Building and loading the package's hand-written CPU kernels (the optimizer's and the link
codecs'), with ``torch.utils.cpp_extension`` the first time a machine needs one, into a folder
named by a hash of the source, flags, torch and Python (never a stale build). Builds are
serialized by a lock the OS drops when its holder dies. If anything fails, :func:`native_library`
warns once and returns False, and the caller takes another path."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch


@dataclass(frozen=True)
class Kernel:
    """One C++ source of the package, built into a library of its own."""

    package: str
    """The package whose ``csrc`` folder holds the source."""
    source: str
    prefix: str
    """The start of the library's name (its operators' namespace is the same)."""
    what: str
    """What it is, for the messages: "the C++ optimizer kernel"."""
    fallback: str
    """What runs when it cannot be built, for the warning."""
    build_seconds: str
    """How long a first build takes, for the message that it is building."""


SOURCE = "multi_tensor_step.cpp"
OPTIMIZER = Kernel(
    "mtdao.optim",
    SOURCE,
    "mtdao_optim",
    "the C++ optimizer kernel",
    "falling back to compiled or foreach kernels, which are slower on the CPU",
    # measured: 6-7 CPU seconds, 9-22 s of wall time on 2 busy cores
    "about 10-20 s",
)

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

# Whether each kernel's library is loaded; a kernel is missing until the first request decides.
_loaded: dict[Kernel, bool] = {}


def native_library(kernel: Kernel = OPTIMIZER) -> bool:
    """Build (once per machine) and load (once per process) a CPU kernel; False if impossible.

    The optimizer's operators are then ``torch.ops.mtdao_optim.{adam,adopt,sgd}_step``.
    """
    if kernel not in _loaded:
        try:
            _build_and_load(kernel)
            _loaded[kernel] = True
        except Exception as error:  # no compiler, no ninja, a failed build: use another path
            warnings.warn(
                f"mtdao: {kernel.what} could not be built ({_first_line(error)}); "
                f"{kernel.fallback}.",
                RuntimeWarning,
                stacklevel=2,
            )
            _loaded[kernel] = False
    return _loaded[kernel]


def _first_line(error: BaseException) -> str:
    """The line of a failed build that names its cause (the compiler's or the shell's error rather
    than the command line ninja echoes), else the first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [
        line
        for line in lines
        if not line.startswith(("[", "FAILED", "ninja:", "Error building extension"))
        and any(word in line.lower() for word in ("error", "not found", "no such file"))
    ]
    line = (causes or lines or [""])[0]
    return f"{type(error).__name__}: {line[:200]}"


def build_flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    return BASE_FLAGS + ISA_FLAGS.get(capability, [])


def build_name(source: str, flags: list[str], prefix: str = OPTIMIZER.prefix) -> str:
    """The extension's name: one per source, flag set, torch and Python version."""
    key = "\n".join([source, *flags, torch.__version__, sys.version])
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def extensions_root() -> Path:
    """Where torch keeps JIT-built extensions (its own default on Linux, without importing
    ``torch.utils.cpp_extension``, which takes a few hundred ms)."""
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "torch_extensions"


def _build_and_load(kernel: Kernel = OPTIMIZER) -> None:
    source = resources.files(kernel.package).joinpath("csrc", kernel.source).read_text()
    flags = build_flags()
    name = build_name(source, flags, kernel.prefix)
    directory = extensions_root() / name
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"
    with _exclusive(directory / "build.lock"):
        if library.exists():
            try:
                torch.ops.load_library(str(library))
                return
            except OSError:  # a build cut short (its process killed while linking): build again
                library.unlink()
        (directory / "lock").unlink(missing_ok=True)  # cpp_extension's own, left by a dead build
        _build(name, source, flags, directory, kernel)


def _build(
    name: str, source: str, flags: list[str], directory: Path, kernel: Kernel = OPTIMIZER
) -> None:
    from torch.utils import cpp_extension  # imported only to build: it is slow to import

    # the first step of a machine's first run waits for this: say why
    print(
        f"mtdao: building {kernel.what} once for this machine ({kernel.build_seconds}; later "
        f"runs load it from {directory})",
        file=sys.stderr,
        flush=True,
    )

    # cpp_extension logs a page-long ABI warning for any compiler not named g++; a failed build
    # is reported by native_library in one line, a wrong result by the check against eager
    quiet = logging.getLogger(cpp_extension.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with _ninja_on_path():
            cpp_extension.load_inline(
                name=name,
                cpp_sources=[source],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                no_implicit_headers=True,  # the source includes only what it uses: a faster build
            )
    finally:
        quiet.setLevel(level)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (released by the OS if this process dies)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: builds are not serialized
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
