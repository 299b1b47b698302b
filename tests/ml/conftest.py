"""Fixtures of the [ml] tests: the tiny predictor artifact, trained once per encoder mode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import build_tiny_artifact


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_artifact(encoder)``: the folder of a tiny artifact using that encoder mode
    ("full" or "static"), built on first use."""
    built: dict[str, Path] = {}

    def get(encoder: str) -> Path:
        if encoder not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{encoder}") / "tiny"
            build_tiny_artifact(folder, encoder=encoder)
            built[encoder] = folder
        return built[encoder]

    return get
