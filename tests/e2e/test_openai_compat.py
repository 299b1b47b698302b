"""OpenAI compatibility of the edge, driven by the official ``openai`` client over the whole
mesh (sim workers): every parameter the edge claims, streamed and not, plus tenants.

What the sim backend returns for logprobs and scores is deterministic pseudo-data
(services/worker/engine/sim_logprobs.py); these tests check shapes and invariants, not values.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from prefixmesh.services.up import LocalMesh
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve

pytestmark = pytest.mark.timeout(180)

KEYS = {"alpha": "sk-alpha-0123", "beta": "sk-beta-4567", "limited": "sk-limited-89"}
KEY_FILE = f"""
[tenants.alpha]
keys = ["{KEYS['alpha']}"]
[tenants.beta]
keys = ["{KEYS['beta']}"]
[tenants.limited]
keys = ["{KEYS['limited']}"]
rate_rps = 0.2
burst = 2
"""
LONG_DOC = " ".join(f"Clause {i}: tenants never share cached prefixes with each other."
                    for i in range(80))
BOTH = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])


@pytest.fixture(scope="module")
def mesh_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    keys = tmp_path_factory.mktemp("compat") / "keys.toml"
    keys.write_text(KEY_FILE)
    return {"extra_env": {"PM_API_KEYS_FILE": str(keys)}}


@pytest.fixture(scope="module", autouse=True)
def close_clients(mesh: LocalMesh):
    yield
    for c in _CLIENTS:  # their pooled connections, closed before the mesh's sockets are gone
        c.close()


# Every client the tests open, closed at the end of the module (an unclosed one leaves a
# socket for the garbage collector, a ResourceWarning that fails whichever test runs then).
_CLIENTS: list[OpenAI] = []


def _client(mesh: LocalMesh, tenant: str = "alpha", key: str | None = None) -> OpenAI:
    c = OpenAI(base_url=mesh.url + "/v1", api_key=KEYS[tenant] if key is None else key,
               max_retries=0, timeout=60)
    _CLIENTS.append(c)
    return c


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> OpenAI:
    return _client(mesh)


def _complete(client: OpenAI, stream: bool, **kw) -> tuple[list[str], list[str | None], dict]:
    """Texts and finish reasons per choice, and usage, streamed or not."""
    if not stream:
        r = client.completions.create(model=MODEL, **kw)
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        reasons = [c.finish_reason for c in sorted(r.choices, key=lambda c: c.index)]
        return texts, reasons, r.usage.model_dump()
    n = kw.get("n", 1)
    texts, reasons, usage = [""] * n, [None] * n, {}
    for c in client.completions.create(model=MODEL, stream=True,
                                       stream_options={"include_usage": True}, **kw):
        if c.usage is not None:
            usage = c.usage.model_dump()
        for ch in c.choices:
            texts[ch.index] += ch.text
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    return texts, reasons, usage


def _chat(client: OpenAI, stream: bool, **kw) -> tuple[list[str], list[str | None], dict]:
    if not stream:
        r = client.chat.completions.create(model=MODEL, **kw)
        ch = sorted(r.choices, key=lambda c: c.index)
        return [c.message.content for c in ch], [c.finish_reason for c in ch], \
            r.usage.model_dump()
    n = kw.get("n", 1)
    texts, reasons, usage = [""] * n, [None] * n, {}
    for c in client.chat.completions.create(model=MODEL, stream=True,
                                            stream_options={"include_usage": True}, **kw):
        if c.usage is not None:
            usage = c.usage.model_dump()
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    return texts, reasons, usage


# --------------------------------------------------------------------------- parameters


@BOTH
def test_max_tokens_ignore_eos_n_and_usage(client: OpenAI, stream: bool) -> None:
    texts, reasons, usage = _complete(client, stream, prompt="Count the caches.", n=3,
                                      max_tokens=5, extra_body={"ignore_eos": True})
    assert len(texts) == 3 and all(t.strip() for t in texts)
    assert reasons == ["length"] * 3
    assert usage["completion_tokens"] == 15
    assert usage["total_tokens"] == usage["prompt_tokens"] + 15


@BOTH
def test_chat_roles_max_completion_tokens_and_user(client: OpenAI, stream: bool) -> None:
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "system", "content": "You are a cache."},
                {"role": "user", "content": "Hello?"},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "text", "text": "What is "},
                                             {"type": "text", "text": "a prefix?"}]}]
    texts, reasons, usage = _chat(client, stream, messages=messages, max_completion_tokens=4,
                                  n=2, user="user-42", extra_body={"ignore_eos": True})
    assert all(t for t in texts) and reasons == ["length", "length"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 10


@BOTH
def test_stop_sequence_cuts_the_text(client: OpenAI, stream: bool) -> None:
    kw = dict(prompt="Tell me about stops.", max_tokens=12, seed=7,
              extra_body={"ignore_eos": True})
    (full,), _, _ = _complete(client, stream, **kw)
    words = full.split()
    assert len(words) >= 6
    stop = words[4]
    expected = full[:full.find(stop)]
    (cut,), (reason,), usage = _complete(client, stream, stop=[stop, "never-there"], **kw)
    assert cut == expected and reason == "stop"
    assert 0 < usage["completion_tokens"] < 12


@BOTH
def test_seed_and_temperature_zero_are_reproducible(client: OpenAI, stream: bool) -> None:
    kw = dict(prompt="Reproducible?", max_tokens=8, extra_body={"ignore_eos": True})
    a, _, _ = _complete(client, stream, seed=123, **kw)
    b, _, _ = _complete(client, stream, seed=123, **kw)
    c, _, _ = _complete(client, stream, seed=124, **kw)
    assert a == b and a != c
    g1, _, _ = _complete(client, stream, temperature=0.0, top_p=0.5, **kw)
    g2, _, _ = _complete(client, stream, temperature=0.0, top_p=0.9, **kw)
    assert g1 == g2


def test_sampling_bounds_are_400(client: OpenAI) -> None:
    for bad in ({"top_p": 0.0}, {"temperature": 2.5}, {"max_tokens": 0}, {"n": 99},
                {"logprobs": 50}, {"stop": ["a", "b", "c", "d", "e"]}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", **bad)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)


@BOTH
def test_completion_logprobs(client: OpenAI, stream: bool) -> None:
    kw = dict(model=MODEL, prompt="Log me.", max_tokens=4, logprobs=3,
              extra_body={"ignore_eos": True})
    if stream:
        entries = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        text = ""
        for c in client.completions.create(stream=True, **kw):
            for ch in c.choices:
                text += ch.text
                if ch.logprobs is not None:
                    for k in entries:
                        entries[k] += getattr(ch.logprobs, k)
    else:
        r = client.completions.create(**kw)
        lp = r.choices[0].logprobs
        text = r.choices[0].text
        entries = {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                   "top_logprobs": lp.top_logprobs}
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert len(entries["tokens"]) == 4 and "".join(entries["tokens"]) == text
    assert all(x < 0 for x in entries["token_logprobs"])
    for tok, lp_, top in zip(entries["tokens"], entries["token_logprobs"],
                             entries["top_logprobs"], strict=True):
        assert len(top) == 3 and top[tok] == lp_ == max(top.values())


@BOTH
def test_chat_logprobs_and_top_logprobs(client: OpenAI, stream: bool) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Log me."}], max_tokens=3,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    if stream:
        content = [e for c in client.chat.completions.create(stream=True, **kw)
                   for ch in c.choices if ch.logprobs and ch.logprobs.content
                   for e in ch.logprobs.content]
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == 3
    for e in content:
        assert e.logprob < 0 and bytes(e.bytes).decode() == e.token
        assert [t.token for t in e.top_logprobs][0] == e.token and len(e.top_logprobs) == 2


# --------------------------------------------------------------------------- ids and docs


def test_request_ids_in_body_and_header(client: OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="id?", max_tokens=1)
    body = raw.parse()
    assert body.id.startswith("cmpl-") and raw.headers["x-request-id"] == body.id
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "id?"}], max_tokens=1)
    assert raw.parse().id.startswith("chatcmpl-") and raw.headers["x-request-id"] == raw.parse().id
    traced = client.completions.with_raw_response.create(
        model=MODEL, prompt="id?", max_tokens=1, extra_headers={"x-request-id": "trace-77"})
    assert traced.headers["x-request-id"] == "trace-77"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x")
    assert info.value.response.headers["x-request-id"].startswith("req-")


def test_stream_is_honoured_however_the_body_spells_it(mesh: LocalMesh) -> None:
    """The edge's lean front answers plain completions and leaves streams to aiohttp: a
    ``stream`` key written with an escape (the same key once decoded) still streams, and
    ``"stream": false`` gets one JSON body."""
    url = mesh.url + "/v1/completions"
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS['alpha']}"}
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
    escaped = body.replace('"stream"', '"str\\u0065am"').encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=escaped, headers=headers),
                                timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.read().rstrip().endswith(b"data: [DONE]")
    status, body = _post(mesh, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                   "max_tokens": 2, "stream": False})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_openapi_document_describes_the_routes(mesh: LocalMesh) -> None:
    with urllib.request.urlopen(mesh.url + "/openapi.json", timeout=5) as r:
        doc = json.loads(r.read())
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/models"} <= set(
        doc["paths"])
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"n", "stop", "max_tokens", "temperature", "top_p", "seed", "logprobs",
            "stream_options", "user", "ignore_eos"} <= set(props)
    assert doc["security"] == [{"bearer": []}]  # auth is on in this mesh


# --------------------------------------------------------------------------- scoring


def _post(mesh: LocalMesh, path: str, body: dict, key: str = KEYS["alpha"]) -> tuple[int, dict]:
    req = urllib.request.Request(mesh.url + path, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_score_endpoint_returns_candidate_probabilities(mesh: LocalMesh) -> None:
    body = {"model": MODEL, "prompt": ["Is the sky green? Answer:", "Is water wet? Answer:"],
            "candidates": ["Yes", "No"]}
    status, out = _post(mesh, "/v1/score", body)
    assert status == 200, out
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1]
    assert out["simulated"] is True  # sim workers: pseudo-probabilities, said so
    for d in out["data"]:
        assert [s["candidate"] for s in d["scores"]] == ["Yes", "No"]
        assert math.isclose(sum(s["probability"] for s in d["scores"]), 1.0, rel_tol=1e-6)
    assert out["usage"]["completion_tokens"] == 2
    again = _post(mesh, "/v1/score", body)[1]
    assert again["data"] == out["data"]  # same prompt, same scores
    status, err = _post(mesh, "/v1/score", {"model": MODEL, "prompt": "x",
                                            "candidates": ["a whole sentence of words"]})
    assert status == 400 and err["error"]["param"] == "candidates"


def test_completion_with_allowed_tokens_is_prefill_only_scoring(mesh: LocalMesh,
                                                                client: OpenAI) -> None:
    status, scored = _post(mesh, "/v1/score",
                           {"model": MODEL, "prompt": "Answer:", "candidates": ["Yes", "No"]})
    assert status == 200, scored
    ids = [s["token_id"] for s in scored["data"][0]["scores"]]
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=1, logprobs=2,
                                  extra_body={"allowed_token_ids": ids})
    lp = r.choices[0].logprobs
    assert r.choices[0].text in ("Yes", "No") and set(lp.top_logprobs[0]) == {"Yes", "No"}
    by_token = {s["candidate"]: s["logprob"] for s in scored["data"][0]["scores"]}
    assert lp.top_logprobs[0] == pytest.approx(by_token)


# --------------------------------------------------------------------------- tenants


def test_missing_or_unknown_key_is_401(mesh: LocalMesh) -> None:
    c = _client(mesh, key="sk-nobody")
    with pytest.raises(openai.AuthenticationError) as info:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert info.value.body["code"] == "invalid_api_key"
    status, err = _post(mesh, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key="")
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(mesh.url + "/health", timeout=5) as r:
        assert r.status == 200  # health stays open


def test_tenant_rate_limit_is_429_with_retry_after(mesh: LocalMesh) -> None:
    c = _client(mesh, "limited")
    statuses = []
    for _ in range(4):
        try:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            statuses.append(200)
        except openai.RateLimitError as exc:
            statuses.append(429)
            assert int(exc.response.headers["Retry-After"]) >= 1
            assert exc.body["code"] == "rate_limit_exceeded"
    assert statuses[:2] == [200, 200] and 429 in statuses[2:]
    _client(mesh, "beta").completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_tenant_never_sees_another_tenants_cached_prefix(mesh: LocalMesh) -> None:
    """Security: a prompt cached for alpha is never reported cached for beta (streamed or
    not), whichever worker serves beta; beta then caches it for itself."""
    alpha, beta = _client(mesh, "alpha"), _client(mesh, "beta")
    for i, stream in enumerate((False, True)):
        kw = dict(model=MODEL, prompt=f"Case {i}. {LONG_DOC}\nQ: who shares caches?", max_tokens=2,
                  extra_body={"ignore_eos": True})
        first = alpha.completions.create(**kw)
        second = alpha.completions.create(**kw)
        assert first.usage.prompt_tokens > 500
        assert second.usage.prompt_tokens_details.cached_tokens >= \
            first.usage.prompt_tokens - 32
        if stream:
            chunks = list(beta.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw))
            usage = chunks[-1].usage
        else:
            usage = beta.completions.create(**kw).usage
        assert usage.prompt_tokens == first.usage.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens == 0
        again = beta.completions.create(**kw)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
