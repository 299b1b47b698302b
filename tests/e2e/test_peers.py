"""Third-party routers in front of standalone HTTP sim workers (loadgen/compare.py's parts).

Skipped where the `peers` extra (sglang-router, vllm-router) is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import OpenAI

from prefixmesh.loadgen.compare import Contender, WorkerGroup, main, start_contender
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve
from tests.helpers import need

pytestmark = pytest.mark.timeout(240)

need("peers", "sglang_router")


@pytest.fixture(scope="module")
def workers(nats_server: str, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("peer-workers")
    with WorkerGroup(2, "fcfs", "mistral-7b-a6000", nats_server, "e2epeers", logs) as group:
        yield group


def test_sglang_router_in_front_of_http_workers(workers: WorkerGroup, tmp_path: Path) -> None:
    c = Contender.parse("sglang-cache_aware")
    router = start_contender(c, workers, {}, 1, tmp_path)
    try:
        with OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                    timeout=30) as client:
            doc = " ".join(f"Paragraph {i} of a shared document." for i in range(80))
            for q in range(4):
                r = client.completions.create(model=MODEL, prompt=f"{doc} Question {q}?",
                                              max_tokens=4, extra_body={"ignore_eos": True})
                assert r.choices[0].text and r.usage.completion_tokens == 4
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                stream=True)
            assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            # cache_aware sent the shared document to one worker, whose cache now holds it.
            r = client.completions.create(model=MODEL, prompt=f"{doc} Question 9?", max_tokens=1)
            assert r.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        router.stop()
    workers.flush()


@pytest.mark.slow
def test_compare_runner_smoke(nats_server: str, redis_server: str, tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    main(["--workers", "2", "--workload", "toolbench", "--rates", "2", "--duration", "3",
          "--contenders", "prefixmesh-round_robin,sglang-round_robin", "--nats-url",
          nats_server, "--redis-url", redis_server, "--cache-pressure", "3",
          "--json", str(out)])
    result = json.loads(out.read_text())
    # The workers ran on a pool sized for the pressure (their --sim-kv-blocks).
    assert result["meta"]["cache_pressure"] == 3.0 and result["meta"]["kv_blocks"] > 0
    rows = {r["policy"]: r for r in result["runs"]}
    assert set(rows) == {"prefixmesh-round_robin", "sglang-round_robin"}
    assert all(r["completed"] == r["requests"] > 0 for r in rows.values())
    assert {o["contender"] for o in result["overhead"]} == set(rows)
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
