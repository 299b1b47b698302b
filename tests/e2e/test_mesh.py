"""The whole mesh as processes (sim workers), driven with the official openai client."""

from __future__ import annotations

import json
import urllib.request

import pytest
from openai import OpenAI

from prefixmesh.services.up import LocalMesh
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve

pytestmark = pytest.mark.timeout(180)

LONG_DOC = " ".join(f"Section {i}: the mesh routes prompts that share a prefix to the "
                    f"replica that already holds it." for i in range(120))


@pytest.fixture(scope="module")
def client(mesh: LocalMesh):
    with OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_mesh_reused_the_session_servers(mesh: LocalMesh) -> None:
    assert mesh.infra == []  # NATS and Redis were reachable: nothing extra started


def test_completion_non_streaming(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Write a haiku about caches.",
                                  max_tokens=12, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text.strip()
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_with_token_ids_prompt(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=list(range(100, 164)), max_tokens=4,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 64
    assert r.usage.completion_tokens == 4


def test_completion_streaming_with_usage(client: OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt="Stream me some words.", max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip()
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_non_streaming_and_streaming(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a prime number."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 6
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content.strip()
    assert stream[-1].choices[0].finish_reason == "length"


def test_repeated_long_prompt_reports_cached_tokens(client: OpenAI) -> None:
    prompt = LONG_DOC + "\n\nQuestion: what does the mesh do?"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                      extra_body={"ignore_eos": True})
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens > 1000
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Everything but the trailing partial block (and at least the last token) is reused.
    assert cached >= first.usage.prompt_tokens - 32


def test_n_and_multiple_prompts(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["one", "two"], n=2, max_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12


def test_bench_verb_against_the_mesh(mesh: LocalMesh, tmp_path) -> None:
    from prefixmesh.loadgen.bench import main as bench_main

    out = tmp_path / "bench.json"
    assert bench_main(["--url", mesh.url, "--workload", "toolbench", "--prefixes", "2",
                       "--rate", "8",
                       "--duration", "2", "--no-progress", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["runs"][0]
    assert row["requests"] == 16 and row["completed"] == 16 and row["failed"] == 0
    assert row["cache_hit_ratio"] > 0.5  # 16 prompts over 2 tool sets share most tokens
    assert 0 < row["ttft_avg_s"] <= row["latency_avg_s"]


def test_metrics_service_sees_every_worker(mesh: LocalMesh) -> None:
    with urllib.request.urlopen(mesh.metrics_url + "/cluster", timeout=5) as r:
        view = json.loads(r.read())
    assert {w["worker_id"] for w in view["workers"]} == {"w0", "w1"}
    assert view["completed_total"] > 0
    with urllib.request.urlopen(mesh.metrics_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'prefixmesh_worker_running_requests{worker="w0"}' in text
