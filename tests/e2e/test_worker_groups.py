"""Several sim engines per worker process (``prefixmesh up --workers-per-process K``):
each engine is a worker of its own to the scheduler, the edge and the metrics."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from openai import OpenAI

from prefixmesh.services.up import LocalMesh
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL

pytestmark = pytest.mark.timeout(180)

WORKERS = 8


@pytest.fixture(scope="module")
def mesh_config() -> dict:
    # Round robin: every worker gets requests whatever the load, so all 8 must answer.
    return {"workers": WORKERS, "workers_per_process": 4, "policy": "round_robin"}


def _completed(mesh: LocalMesh) -> dict[str, int]:
    with urllib.request.urlopen(mesh.metrics_url + "/cluster", timeout=5) as r:
        view = json.load(r)
    return {w["worker_id"]: w["completed"] for w in view["workers"]}


def test_two_processes_serve_eight_workers_and_requests_reach_all(mesh: LocalMesh) -> None:
    procs = [p for p in mesh.services if p.name.startswith("worker")]
    assert len(procs) == 2 and len({p.pid for p in procs}) == 2
    with OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        for i in range(3 * WORKERS):
            r = c.completions.create(model=MODEL, prompt=f"Request {i} to the fleet.",
                                     max_tokens=3, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 3
    deadline = time.monotonic() + 10
    done = _completed(mesh)
    while time.monotonic() < deadline and (len(done) < WORKERS or min(done.values()) == 0):
        time.sleep(0.2)
        done = _completed(mesh)
    assert sorted(done) == [f"w{i}" for i in range(WORKERS)]
    assert min(done.values()) >= 1 and sum(done.values()) >= 3 * WORKERS

