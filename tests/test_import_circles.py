"""No two modules of the package import each other, directly or around a circle of several,
counting every import statement wherever it stands: a function-level import that only hides a
circle from Python's start-up is a circle all the same, and so is one under ``if
TYPE_CHECKING:`` (a reader follows it as Python would; a protocol names what is used instead)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the module ``name`` at ``path`` imports. ``from pkg
    import x`` imports ``pkg.x`` when that is a module, else ``pkg`` (its ``__init__``)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            targets = [t for t in targets[:-1] if t in modules] or [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = {module_name(path, root): path for path in root.rglob("*.py")}
    modules = set(paths)
    return {name: imported_modules(path, name, modules) for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_module_of_the_package_is_in_an_import_circle():
    graph = import_graph(SRC)
    assert len(graph) > 100 and graph["mtdao.train.trainer"]  # the whole package was read
    assert circles(graph) == []


def test_a_circle_behind_a_function_level_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "study").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "study" / "__init__.py").write_text("")
    (package / "study" / "run.py").write_text(
        "from pkg.study.grid import Grid\n\ndef main():\n    from pkg.study import summary\n"
    )
    (package / "study" / "summary.py").write_text("from .run import main\n")
    (package / "study" / "grid.py").write_text("Grid = list\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.study.run"] == {"pkg.study.grid", "pkg.study.summary"}
    assert circles(graph) == [["pkg.study.run", "pkg.study.summary"]]


def test_a_circle_behind_a_type_checking_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text("from pkg.state import State\n")
    (package / "state.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.engine import Engine\n"
    )
    assert circles(import_graph(tmp_path)) == [["pkg.engine", "pkg.state"]]


def test_the_engine_imports_nothing_of_the_fault_tolerance_wing_nor_the_wing_of_the_harness():
    """The wing reaches the engine through the Communicator protocol (mtdao.sync.communicator):
    sync/ imports nothing of mtdao.ft, nor torchft; the wing imports nothing of mtdao.train."""
    graph = import_graph(SRC)
    wing = {name for name in graph if name == "mtdao.ft" or name.startswith("mtdao.ft.")}
    assert {"mtdao.ft.replicas", "mtdao.ft.security.proven_manager"} <= wing  # the wing was read
    for name, targets in sorted(graph.items()):
        if name.startswith("mtdao.sync"):
            assert not targets & wing, f"{name} imports {sorted(targets & wing)}"
            torchft = {t for t in imported_names(SRC, name) if t.split(".")[0] == "torchft"}
            assert not torchft, f"{name} imports {sorted(torchft)}"
        if name in wing:
            harness = {t for t in targets if t.startswith("mtdao.train")}
            assert not harness, f"{name} imports {sorted(harness)}"


def imported_names(root: Path, name: str) -> set[str]:
    """Every module name the module ``name`` imports, inside the package or not."""
    path = root / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = root / name.replace(".", "/") / "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names
