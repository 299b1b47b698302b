"""Layering: services stand apart, ``shared`` stands below them, no module imports in a circle.

- A service package (``services/<name>/``) imports its own modules, ``shared`` and
  third-party code, never another service's package nor ``loadgen`` (services scale and
  ship on their own; tooling must not become a dependency of a running service).
- ``shared`` imports neither ``services`` nor ``loadgen``.
- The launcher modules directly under ``services/`` (``cli``, ``up``) start everything, so
  they may import any part.
- No two modules import each other, directly or through others (imports under
  ``TYPE_CHECKING`` count: a circle for the type checker is a circle for the reader).
- Under ``tests/`` no module imports a test module: what tests share lives in
  ``tests/helpers.py`` (a helper module) or in a ``conftest.py`` (fixtures), and no other
  module sits beside the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("services", "shared", "loadgen")
LAUNCHERS = {"prefixmesh.services.cli", "prefixmesh.services.up"}


def _modules() -> dict[str, Path]:
    out = {}
    for top in TOP:
        for path in (ROOT / top).rglob("*.py"):
            parts = ["prefixmesh", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path, module_level: bool) -> set[str]:
    """The prefixmesh modules ``path`` imports (``module_level``: only those run at import
    time, including ``if TYPE_CHECKING:`` blocks; else every import, lazy ones too)."""
    tree = ast.parse(path.read_text(), str(path))
    if module_level:
        nodes = []
        for node in tree.body:
            nodes += node.body if isinstance(node, ast.If) else [node]
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in MODULES else node.module)
    return {m for m in found if m.startswith("prefixmesh.")}


def _owner(module: str) -> str:
    """The part a module belongs to: ``services.<name>``, ``shared`` or ``loadgen``."""
    parts = module.split(".")
    return ".".join(parts[1:3]) if parts[1] == "services" else parts[1]


def test_services_shared_and_tooling_stay_apart() -> None:
    bad = []
    for module, path in MODULES.items():
        if module in LAUNCHERS:
            continue
        mine = _owner(module)
        for dep in _imports(path, module_level=False):
            theirs = _owner(dep)
            if theirs in (mine, "shared") or mine == "loadgen":
                continue
            if mine == "shared" or theirs == "loadgen" or theirs.startswith("services."):
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports across parts:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    graph = {m: {d for d in _imports(p, module_level=True) if d in MODULES and d != m}
             for m, p in MODULES.items()}
    assert _cycles(graph) == []


def test_the_checks_see_a_violation() -> None:
    """The two checks above reject what they are meant to reject."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _owner("prefixmesh.services.edge.app") == "services.edge"
    assert _owner("prefixmesh.shared.wire") == "shared"
    edge_app = MODULES["prefixmesh.services.edge.app"]
    assert "prefixmesh.shared.openai.http" in _imports(edge_app, False)


# --------------------------------------------------------------------------- the tests themselves

TESTS = ROOT / "tests"
# What a module under tests/ may import from tests/: the helper module (and the packages).
SHARED_TEST_MODULES = {"tests.helpers"}


def _test_tree_module(name: str) -> bool:
    """Whether ``name`` (``tests.x.y``) is a module file under tests/ (not a package)."""
    return ROOT.joinpath(*name.split(".")).with_suffix(".py").is_file()


def _test_tree_imports(source: str, package: tuple[str, ...]) -> set[str]:
    """Modules under tests/ that ``source`` imports (absolute ``tests.`` imports and relative
    ones, resolved from ``package``, e.g. ``("tests", "unit")``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "tests"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "tests":
                continue
            for a in node.names:
                full = f"{module}.{a.name}"
                found.add(full if _test_tree_module(full) else module)
    return {m for m in found if _test_tree_module(m)}


def test_no_test_module_imports_another() -> None:
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        package = ("tests", *path.parent.relative_to(TESTS).parts)
        for dep in sorted(_test_tree_imports(path.read_text(), package) - SHARED_TEST_MODULES):
            bad.append(f"{path.relative_to(ROOT)} -> {dep}")
    assert not bad, ("a module under tests/ imports a test module (share through "
                     "tests/helpers.py or a conftest.py fixture):\n" + "\n".join(bad))


def test_tests_hold_only_tests_fixtures_and_the_helper_module() -> None:
    allowed = {"__init__.py", "conftest.py"}
    stray = [str(p.relative_to(ROOT)) for p in TESTS.rglob("*.py")
             if p.name not in allowed and not p.name.startswith("test_")
             and p != TESTS / "helpers.py"]
    assert not stray, f"helpers belong in tests/helpers.py or a conftest.py: {sorted(stray)}"


def test_modules_do_not_restate_their_folder_marker() -> None:
    """tests/conftest.py marks every test by its folder (unit, integration, e2e, ml, gpu);
    a module's own ``pytestmark`` adds only what the folder does not say."""
    bad = []
    for path in sorted(TESTS.glob("*/test_*.py")):
        folder = path.parent.name
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
                marks = {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)}
                if folder in marks:
                    bad.append(str(path.relative_to(ROOT)))
    assert not bad, f"pytestmark restates the folder's marker: {bad}"


def test_the_test_import_check_sees_a_violation() -> None:
    unit = ("tests", "unit")
    assert _test_tree_imports("from tests.unit.test_e2 import make", unit) == {
        "tests.unit.test_e2"}
    assert _test_tree_imports("from tests.unit import test_wire", unit) == {
        "tests.unit.test_wire"}
    assert _test_tree_imports("from .test_e2 import make", unit) == {"tests.unit.test_e2"}
    assert _test_tree_imports("from . import test_e2", unit) == {"tests.unit.test_e2"}
    assert _test_tree_imports("import tests.unit.test_e2", unit) == {"tests.unit.test_e2"}
    assert _test_tree_imports("from ..conftest import tok", unit) == {"tests.conftest"}
    assert _test_tree_imports("from tests.helpers import eventually", unit) == {"tests.helpers"}
    assert _test_tree_imports("from tests import helpers", unit) == {"tests.helpers"}
    assert _test_tree_imports("import pytest\nfrom prefixmesh.shared import wire", unit) == set()
