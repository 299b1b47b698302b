"""Every engine backend implements the whole ``Engine`` protocol (engine/base.py), and the
worker service picks one by name only (engine/registry.py)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from prefixmesh.services.worker.engine.base import Engine
from prefixmesh.services.worker.engine.registry import BACKENDS, backend

ROOT = Path(__file__).resolve().parents[2]
CLASSES = {"sim": "LiveSimEngine", "hf": "HfEngine", "vllm": "VllmEngine"}


def _members(proto: type) -> set[str]:
    names = set()
    for klass in proto.__mro__:
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
        names |= set(getattr(klass, "__annotations__", {}))
    return names


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_implements_the_engine_protocol(name: str) -> None:
    module = importlib.import_module(BACKENDS[name])  # imports no torch / vllm at load
    klass = getattr(module, CLASSES[name])
    source = inspect.getsource(klass)
    missing = [m for m in sorted(_members(Engine))
               if not hasattr(klass, m) and f"self.{m}" not in source]
    assert not missing, f"{klass.__name__} lacks {missing}"
    assert inspect.iscoroutinefunction(klass.run)
    assert inspect.iscoroutinefunction(module.open_engine)
    assert callable(module.missing_dependencies)


def test_protocol_members_are_found() -> None:
    """The check above sees the protocol's own members and its EngineView part."""
    members = _members(Engine)
    assert {"add", "abort", "run", "stats", "tokenizer", "num_free_blocks",
            "cached_prefix_tokens"} <= members


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(SystemExit, match="use sim, hf, vllm"):
        backend("tpu")


def test_worker_service_does_not_know_engine_classes() -> None:
    tree = ast.parse((ROOT / "services/worker/service.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names}
    assert not (names | imported) & {"SimEngine", "LiveSimEngine", "HfEngine", "VllmEngine"}
