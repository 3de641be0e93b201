"""torchft's native servers (its Rust extension, ``torchft._torchft``) for a process that has not
imported torch: torchft's Python package imports torch on the way, 2 - 3 s of CPU that a
lighthouse, which needs only the extension's ``LighthouseServer``, need not spend. With
:mod:`mtdao.ft.security.torchft_internals`, the only module that imports torchft."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

NAME = "torchft._torchft"


def quiet_native_logs() -> None:
    """torchft's native side logs every quorum at INFO: keep the terminal for progress lines.
    Read once, when the extension loads: called on importing this module and by
    torchft_internals before it imports torchft."""
    os.environ.setdefault("RUST_LOG", "warn")


quiet_native_logs()


def native() -> ModuleType:
    """``torchft._torchft``: imported with torchft's package where torch already is (the
    package then costs little), else loaded from the package's folder without running its
    ``__init__``. Raises ModuleNotFoundError (named ``torchft``) without torchft."""
    if "torch" in sys.modules:
        importlib.import_module("torchft")
        return importlib.import_module(NAME)
    return sys.modules.get(NAME) or _load_alone()


def _load_alone() -> ModuleType:
    package = importlib.util.find_spec("torchft")  # finds the package, runs none of it
    folders = (package.submodule_search_locations or []) if package is not None else []
    for folder in folders:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder) / f"_torchft{suffix}"
            if path.is_file():
                loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
                spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
                module = importlib.util.module_from_spec(spec)
                loader.exec_module(module)
                # an extension initializes once per process: a later import takes this one
                sys.modules[NAME] = module
                return module
    raise ModuleNotFoundError(f"No module named {NAME!r}", name="torchft")
