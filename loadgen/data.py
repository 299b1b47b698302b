"""Where the real data sets live: ``loadgen/datasets`` (shipped in the package), or
``$PREFIXMESH_DATA`` when set (a folder with the same layout)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "PREFIXMESH_DATA"
# The data sets ship inside the package (loadgen/datasets/README.md names their sources).
DEFAULT_DIR = Path(__file__).resolve().with_name("datasets")


class DataMissing(FileNotFoundError):
    """A data file the workload needs is not where it should be."""


def data_dir() -> Path:
    """The data folder: ``$PREFIXMESH_DATA`` or the shipped ``loadgen/datasets``."""
    return Path(os.environ.get(ENV_VAR, DEFAULT_DIR))


def data_file(*parts: str) -> Path:
    """Path of one data file; a clear error naming the path when it is missing."""
    path = data_dir().joinpath(*parts)
    if not path.is_file():
        raise DataMissing(f"data file not found: {path} (set {ENV_VAR} to the data folder)")
    return path
