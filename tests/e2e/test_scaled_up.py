"""``prefixmesh up --schedulers 3 --nats-cluster 3 --edges 2 --tokenizers 2`` serves the
official ``openai`` client on every edge; a scheduler and a NATS node killed between two
rounds of requests fail none of the second round."""

from __future__ import annotations

import signal

import pytest
from openai import OpenAI

from prefixmesh.services.up import LocalMesh
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL
from tests.helpers import mesh_options

pytestmark = pytest.mark.timeout(180)


def _round(urls: list[str], tag: str) -> list[str]:
    """A completion and a streamed chat on every edge; the texts answered."""
    texts = []
    for i, url in enumerate(urls):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        done = client.completions.create(model=MODEL, prompt=f"{tag} edge {i}: once upon",
                                         max_tokens=8)
        assert done.choices[0].finish_reason in ("length", "stop")
        texts.append(done.choices[0].text)
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{tag} hello edge {i}"}],
            max_tokens=8, stream=True)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] in ("length", "stop")
    return texts


def test_scaled_mesh_serves_the_openai_client(tmp_path, redis_server) -> None:
    opts = mesh_options("nats://127.0.0.1:1", redis_server, tmp_path / "logs", workers=2,
                        schedulers=3, edges=2, tokenizers=2, nats_cluster=3,
                        subject_prefix="scaled")
    with LocalMesh(opts) as mesh:
        assert mesh.nats_cluster is not None and len(mesh.nats_url.split(",")) == 3
        assert len(mesh.edge_urls) == 2
        assert all(t for t in _round(mesh.edge_urls, "first"))
        next(p for p in mesh.services if p.name == "scheduler-1").signal(signal.SIGKILL)
        mesh.nats_cluster.nodes[2].signal(signal.SIGKILL)
        # One scheduler and one NATS node fewer: every request is still served.
        assert all(t for t in _round(mesh.edge_urls, "second"))
