"""The one seam between mtdao and torchft's private parts (mtdao.ft.security.torchft_internals):
the torchft installed, and the one constraints.txt pins, are versions the seam was written
against, and every private name the seam uses still exists on that torchft. An upgrade of
torchft fails here, naming what moved, before any replica runs."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import re
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torchft")

import torchft._torchft  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402

from mtdao.ft.security import torchft_internals  # noqa: E402
from mtdao.ft.security.torchft_internals import (  # noqa: E402
    WRITTEN_AGAINST,
    GlooGroup,
    ManagerInternals,
)

ROOT = Path(__file__).resolve().parents[1]


def pinned_version() -> str:
    pins = re.findall(r"^torchft==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert len(pins) == 1, "constraints.txt pins torchft once"
    return pins[0]


def assigned_attributes(cls: type, bases: bool = True) -> set[str]:
    """The attributes ``self.<name> = ...`` sets anywhere in ``cls`` or its Python bases."""
    names = set()
    for klass in cls.__mro__ if bases else [cls]:
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # a native or builtin class
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return names


def test_the_installed_and_pinned_torchft_are_versions_the_seam_was_written_against():
    installed = importlib.metadata.version("torchft")
    assert pinned_version() in WRITTEN_AGAINST, (
        f"constraints.txt pins torchft {pinned_version()}; mtdao.ft.security.torchft_internals "
        f"was written against {WRITTEN_AGAINST}: check each private name it uses on the new one"
    )
    assert installed in WRITTEN_AGAINST, f"torchft {installed} is installed, not {WRITTEN_AGAINST}"


def test_every_private_attribute_of_the_manager_the_seam_uses_exists():
    used = ManagerInternals.attributes()
    assert {"commits": "_step", "server": "_manager", "store": "_store"}.items() <= used.items()
    missing = sorted(set(used.values()) - assigned_attributes(Manager))
    assert not missing, f"torchft's Manager no longer sets {missing}"


@pytest.mark.parametrize(
    ("cls", "methods"), [(Manager, ManagerInternals.METHODS), (ProcessGroupGloo, GlooGroup.METHODS)]
)
def test_every_private_method_the_seam_overrides_or_calls_has_the_same_parameters(cls, methods):
    for name, parameters in methods.items():
        assert hasattr(cls, name), f"torchft's {cls.__name__} has no {name} any more"
        signature = inspect.signature(getattr(cls, name))
        assert tuple(signature.parameters)[1:] == parameters, f"{cls.__name__}.{name}{signature}"


def test_every_private_attribute_of_the_gloo_group_the_seam_uses_exists():
    missing = sorted(set(GlooGroup.PRIVATE) - assigned_attributes(ProcessGroupGloo))
    assert not missing, f"torchft's ProcessGroupGloo no longer sets {missing}"


def test_the_native_servers_and_the_manager_s_server_name_exist():
    for name in torchft_internals.NATIVE:
        assert hasattr(torchft._torchft, name), f"torchft._torchft has no {name}"
    # the name torchft's Manager starts its server by: what replace_manager_server replaces
    source = inspect.getsource(Manager.__init__)
    assert "ManagerServer(" in source, "torchft's Manager no longer starts a ManagerServer"


BY_NAME = ("import_module", "find_spec", "__import__")  # what reaches a module named in a string


def test_no_other_module_of_the_package_imports_torchft():
    """An import statement or a module named to importlib."""
    importers = []
    for path in sorted((ROOT / "src" / "mtdao").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif (
                isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            ):
                function = node.func
                called = function.attr if isinstance(function, ast.Attribute) else ""
                called = function.id if isinstance(function, ast.Name) else called
                names = [str(node.args[0].value)] if called in BY_NAME else []
            if any(name.split(".")[0] == "torchft" for name in names):
                importers.append(str(path.relative_to(ROOT / "src")))
    assert sorted(set(importers)) == ["mtdao/ft/security/torchft_internals.py"]


def test_a_private_attribute_torchft_no_longer_sets_is_named():
    class Moved:
        def __init__(self) -> None:
            self._renamed_step = 0

    assert "_step" not in assigned_attributes(Moved)
    assert "_renamed_step" in assigned_attributes(Moved)


@pytest.mark.parametrize("name", ["proven_manager.ProvenManager", "torchft_internals.GlooGroup"])
def test_mtdao_s_subclasses_of_torchft_s_classes_shadow_nothing_but_what_the_seam_names(name):
    """A private name torchft adds later under one of mtdao's would change either side
    silently (overriding a public method is the public API's business)."""
    module, _, class_name = name.rpartition(".")
    cls = getattr(__import__(f"mtdao.ft.security.{module}", fromlist=[class_name]), class_name)
    ours = [k for k in cls.__mro__ if k.__module__.startswith("mtdao.")]
    theirs = next(k for k in cls.__mro__ if not k.__module__.startswith("mtdao."))
    names = {n for k in ours for n in [*vars(k), *assigned_attributes(k, bases=False)]}
    private = {n for n in names if n.startswith("_") and not n.startswith("__")}
    named = {*ManagerInternals.METHODS, *GlooGroup.METHODS, *GlooGroup.PRIVATE}
    shadowed = sorted((private - named) & (set(dir(theirs)) | assigned_attributes(theirs)))
    assert not shadowed, f"{name} shadows torchft's {shadowed}"
