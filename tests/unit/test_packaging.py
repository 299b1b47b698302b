"""Packaging: one ``prefixmesh.*`` namespace, every package in the wheel, no generic names."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("services", "shared", "loadgen")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    data = set(setuptools["package-data"])
    found = {"prefixmesh." + ".".join(p.parent.relative_to(ROOT).parts)
             for top in TOP for p in (ROOT / top).rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found <= data, "listed packages without __init__.py must be data folders"
    for name in listed:
        assert name.startswith("prefixmesh."), name
        assert (ROOT / Path(*name.split(".")[1:])).is_dir(), f"{name} has no folder"


def test_package_dir_maps_the_top_folders() -> None:
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert mapping == {f"prefixmesh.{t}": t for t in TOP}


def test_code_imports_only_the_namespace() -> None:
    """``import services...`` would work from a checkout but not from an installed wheel."""
    bad = []
    for top in (*TOP, "tests"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                        if n.split(".")[0] in TOP]
    assert not bad, "import through prefixmesh.*: " + ", ".join(bad)
