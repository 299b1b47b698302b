"""``prefixmesh up --schedulers 3 --nats-cluster 3 --edges 2 --tokenizers 2`` serves the
official ``openai`` client on every edge; a scheduler and a NATS node killed between two
rounds of requests fail none of the second round; ``--edges 2 --shared-port`` serves on one
address from both edges."""

from __future__ import annotations

import json
import signal
import urllib.request

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


def _served(metrics_url: str) -> float:
    """Completions an edge answered with 200, from its own /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("prefixmesh_edge_requests_total{")
               and 'route="/v1/completions"' in line and 'status="200"' in line)


def test_edges_sharing_one_port_each_take_connections(tmp_path, nats_server,
                                                      redis_server) -> None:
    """``--edges 2 --shared-port``: one address; connections, each new, land on both edges
    (the kernel spreads them), and each edge reports its own on its side port."""
    opts = mesh_options(nats_server, redis_server, tmp_path / "logs", edges=2,
                        shared_port=True, subject_prefix="sharedport")
    with LocalMesh(opts) as mesh:
        assert mesh.edge_urls == [mesh.url]
        sent = 24
        for i in range(sent):  # a new connection each: urllib does not keep them
            body = json.dumps({"model": MODEL, "prompt": f"connection {i}",
                               "max_tokens": 2}).encode()
            req = urllib.request.Request(mesh.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                # A simulated reply may end early, on its sampled length: "stop".
                assert json.loads(resp.read())["choices"][0]["finish_reason"] in ("length",
                                                                                  "stop")
        scrape = mesh.scrape_urls()
        served = [_served(scrape[name]) for name in ("edge", "edge-1")]
        # Both take a share (each of 24 connections lands on either; all on one edge has
        # odds of 2 in 16 million).
        assert sum(served) == sent and min(served) > 0, served
