"""Layering: services stand apart, ``shared`` stands below them, no module imports in a circle.

- A service package (``services/<name>/``) imports its own modules, ``shared`` and
  third-party code, never another service's package nor ``loadgen`` (services scale and
  ship on their own; tooling must not become a dependency of a running service).
- ``shared`` imports neither ``services`` nor ``loadgen``.
- The launcher modules directly under ``services/`` (``cli``, ``up``) start everything, so
  they may import any part.
- No two modules import each other, directly or through others (imports under
  ``TYPE_CHECKING`` count: a circle for the type checker is a circle for the reader).
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
    assert "prefixmesh.shared.openai.http" in _imports(MODULES["prefixmesh.services.edge.app"], False)
