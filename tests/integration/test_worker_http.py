"""The worker's standalone HTTP front (services/worker/http.py) over a real sim engine."""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.http import serve_http
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve
from prefixmesh.shared.runtime.servers import free_port
from tests.helpers import eventually, running

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(300, 300 + 96))


@pytest.fixture
async def http():
    port = free_port()
    cfg = WorkerConfig(mesh=False, http_port=port, worker_id="h0", local_policy="fcfs",
                       max_model_len=4096)
    async with running(WorkerService(cfg, serve_http)) as worker:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            yield session, worker


async def _sse(resp: aiohttp.ClientResponse) -> list:
    """Data events of a server-sent event stream, ``[DONE]`` as the string."""
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    out = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def test_info_routes(http) -> None:
    s, _ = http
    for path in ("/health", "/health_generate"):
        async with s.get(path) as r:
            assert r.status == 200
    for path in ("/server_info", "/get_server_info"):
        async with s.get(path) as r:
            info = await r.json()
        assert info["model_path"] == MODEL and info["page_size"] == 16
        assert info["max_total_num_tokens"] > 0 and info["local_policy"] == "fcfs"
    for path in ("/model_info", "/get_model_info"):
        async with s.get(path) as r:
            info = await r.json()
        assert info["model_path"] == MODEL and info["is_generation"] is True
    async with s.get("/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    async with s.get("/get_load") as r:
        load = await r.json()
    assert load["load"] == 0 and load["num_waiting_reqs"] == 0


async def test_a_sim_worker_runs_on_the_kv_pool_it_is_given() -> None:
    port = free_port()
    cfg = WorkerConfig(mesh=False, http_port=port, worker_id="h1", local_policy="fcfs",
                       sim_kv_blocks=20)
    async with running(WorkerService(cfg, serve_http)) as worker:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            async with s.get("/server_info") as r:
                assert (await r.json())["max_total_num_tokens"] == 20 * 16
            # A 310-token prompt and its token take all 20 blocks: the second prompt
            # evicts the first, which then misses.
            first, second = list(range(1000, 1310)), list(range(2000, 2310))
            cached = []
            for prompt in (first, second, first):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                async with s.post("/v1/completions", json=body) as r:
                    usage = (await r.json())["usage"]
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            assert cached == [0, 0, 0]
            async with s.post("/v1/completions", json=body) as r:  # ``first`` again, cached
                assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert worker.engine.num_blocks == 20


def test_a_negative_sim_kv_pool_is_refused_by_name() -> None:
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-m", "prefixmesh.services.cli", "worker",
                          "--backend", "sim", "--no-mesh", "--http", str(free_port()),
                          "--sim-kv-blocks", "-1"], capture_output=True, text=True, timeout=60)
    assert got.returncode != 0
    assert "--sim-kv-blocks must be at least 0" in got.stderr and "Traceback" not in got.stderr


async def test_completion_token_ids_and_text(http) -> None:
    s, _ = http
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    async with s.post("/v1/completions", json=body) as r:
        first = await r.json()
    assert first["object"] == "text_completion" and first["choices"][0]["text"].strip()
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["prompt_tokens"] == len(PROMPT)
    assert first["usage"]["completion_tokens"] == 4
    async with s.post("/v1/completions", json=body) as r:
        again = await r.json()
    # The second time the engine's prefix cache holds the prompt's full blocks.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80
    # ignore_eos: without it the sim samples each output's length, which may end at EOS.
    body = {"model": MODEL, "prompt": ["Hello there", "General Kenobi"], "max_tokens": 2, "n": 2,
            "ignore_eos": True}
    async with s.post("/v1/completions", json=body) as r:
        multi = await r.json()
    assert sorted(c["index"] for c in multi["choices"]) == [0, 1, 2, 3]
    assert multi["usage"]["completion_tokens"] == 8


async def test_completion_streaming(http) -> None:
    s, _ = http
    body = {"model": MODEL, "prompt": "Stream me some words", "max_tokens": 5,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with s.post("/v1/completions", json=body) as r:
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 0
    chunks = events[:-2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks).strip()


async def test_chat_streaming_and_not(http) -> None:
    s, _ = http
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with s.post("/v1/chat/completions", json=body) as r:
        resp = await r.json()
    assert resp["object"] == "chat.completion"
    assert resp["choices"][0]["message"]["role"] == "assistant"
    assert resp["choices"][0]["message"]["content"]
    async with s.post("/v1/chat/completions", json={**body, "stream": True}) as r:
        events = await _sse(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] is not None
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


async def test_sglang_generate(http) -> None:
    s, _ = http
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    async with s.post("/generate", json=body) as r:
        out = await r.json()
    assert len(out["output_ids"]) == 3 and out["text"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    async with s.post("/generate", json={"text": ["a b", "c d"],
                                         "sampling_params": {"max_new_tokens": 2}}) as r:
        batch = await r.json()
    assert isinstance(batch, list) and len(batch) == 2
    async with s.post("/generate", json={**body, "stream": True}) as r:
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    # SGLang streams cumulative text: each event extends the previous one.
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


async def test_tokenize_detokenize_and_render(http) -> None:
    s, _ = http
    async with s.post("/tokenize", json={"prompt": "Hello world"}) as r:
        tok = await r.json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 4096
    async with s.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
        chat_tok = await r.json()
    assert chat_tok["count"] > tok["count"]
    async with s.post("/detokenize", json={"tokens": tok["tokens"]}) as r:
        assert (await r.json())["prompt"] == "Hello world"
    body = {"model": MODEL, "prompt": ["Hello world", "Bye"], "max_tokens": 7}
    async with s.post("/v1/completions/render", json=body) as r:
        rendered = await r.json()
    assert isinstance(rendered, list) and len(rendered) == 2
    assert rendered[0]["token_ids"] == tok["tokens"]
    assert rendered[0]["sampling_params"]["max_tokens"] == 7
    assert rendered[0]["model"] == MODEL and rendered[0]["request_id"].startswith("cmpl-")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with s.post("/v1/chat/completions/render", json=body) as r:
        chat = await r.json()
    assert isinstance(chat, dict) and chat["token_ids"] == chat_tok["tokens"]
    assert chat["stream"] is True


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4096}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "text"),
    ("/generate", {"input_ids": [-1]}, 400, "input_ids"),
    ("/v1/completions/render", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/no/such/route", {}, 404, None),
])
async def test_bad_input_gets_openai_errors(http, path, body, status, param) -> None:
    s, _ = http
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with s.post(path, **kw) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


async def test_get_load_reflects_queue_and_disconnect_aborts(http) -> None:
    s, worker = http
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}

    async def call() -> None:
        async with s.post("/v1/completions", json=body) as r:
            await r.read()

    calls = [asyncio.create_task(call()) for _ in range(3)]
    loads: list[dict] = []

    async def poll() -> bool:
        async with s.get("/get_load") as r:
            loads.append(await r.json())
        return loads[-1]["load"] == 3

    for _ in range(100):
        if await poll():
            break
        await asyncio.sleep(0.05)
    assert loads[-1]["load"] == 3 and loads[-1]["num_tokens"] > 0
    for t in calls:  # the clients go away: the worker must abort their requests
        t.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    await eventually(lambda: not worker.live, timeout=5)
    async with s.get("/get_load") as r:
        assert (await r.json())["load"] == 0


async def test_flush_cache(http) -> None:
    s, _ = http
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    async with s.post("/v1/completions", json=body) as r:
        await r.read()
    async with s.post("/flush_cache") as r:
        assert r.status == 200
    async with s.post("/v1/completions", json=body) as r:
        usage = (await r.json())["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_time_scale_paces_steps_k_times_slower() -> None:
    """A worker with ``time_scale`` 4 sleeps each step 4x its modelled time (a lower bound
    on the wall time), reports the planned and late time in ``step_lag``, and a flush
    starts the count afresh."""
    port = free_port()
    cfg = WorkerConfig(mesh=False, http_port=port, worker_id="h1", local_policy="fcfs",
                       max_model_len=4096, time_scale=4.0)
    async with running(WorkerService(cfg, serve_http)) as worker:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
            t0 = asyncio.get_running_loop().time()
            async with s.post("/v1/completions", json=body) as r:
                assert r.status == 200
            wall = asyncio.get_running_loop().time() - t0
            # One step: the whole 96-token prompt, which samples the only output token.
            modelled = worker.cost.step_time([(len(PROMPT), len(PROMPT))])
            async with s.get("/server_info") as r:
                info = await r.json()
            assert info["time_scale"] == 4.0
            lag = info["step_lag"]
            assert lag["steps"] == 1
            assert lag["planned_s"] == pytest.approx(4.0 * modelled)
            assert wall >= 4.0 * modelled
            async with s.post("/flush_cache") as r:
                assert r.status == 200
            async with s.get("/server_info") as r:
                assert (await r.json())["step_lag"]["steps"] == 0


async def test_logprobs_and_allowed_tokens_reach_the_engine(http) -> None:
    """The worker's OpenAI layer is the edge's: logprobs and allowed_token_ids are passed
    on (the sim's pseudo log-probabilities), streamed and not."""
    s, _ = http
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "logprobs": 2,
            "allowed_token_ids": [300, 301]}
    async with s.post("/v1/completions", json=body) as r:
        lp = (await r.json())["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 1 and len(lp["top_logprobs"][0]) == 2
    async with s.post("/v1/completions", json={**body, "stream": True}) as r:
        events = await _sse(r)
    streamed = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0]["logprobs"]]
    assert streamed and streamed[0]["top_logprobs"][0] == lp["top_logprobs"][0]


async def test_prompt_plus_max_tokens_beyond_the_context_is_refused(http) -> None:
    s, worker = http
    limit = worker.model.context_length  # 4096 in this fixture
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": limit - len(PROMPT) + 1}
    async with s.post("/v1/completions", json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["code"] == "context_length_exceeded" and f"is {limit} tokens" in err["message"]
    async with s.post("/v1/completions", json={**body, "max_tokens": limit - len(PROMPT)}) as r:
        assert r.status == 200
