"""The whole mesh as processes, once per module.

A module changes the mesh by overriding ``mesh_config`` (``MeshOptions`` fields beyond
``tests.helpers.mesh_options``' defaults), or by parametrizing ``mesh`` indirectly with such
a dict.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from prefixmesh.services.up import LocalMesh
from tests.helpers import mesh_options


@pytest.fixture(scope="module")
def mesh_config() -> dict[str, Any]:
    """MeshOptions fields of this module's mesh (override in the module)."""
    return {}


@pytest.fixture(scope="module")
def mesh(request: pytest.FixtureRequest, mesh_config: dict[str, Any], nats_server: str,
         redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    """Edge, tokenizer, scheduler, predictor, metrics and sim workers as processes on the
    session's nats-server and redis-server, under a subject prefix of the module's own
    (``mesh.opts.subject_prefix``)."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    fields = {"subject_prefix": f"e2e-{module}", "log_dir": tmp_path_factory.mktemp("mesh"),
              **mesh_config, **getattr(request, "param", {})}
    with LocalMesh(mesh_options(nats_server, redis_server, **fields)) as m:
        yield m
