"""The edge answers bad input with OpenAI-shaped errors and the right status, never a 500."""

from __future__ import annotations

import json

import aiohttp
import pytest

from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.service import EdgeService
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve
from tests.helpers import running


@pytest.fixture
async def edge(nats_server: str, prefix: str):
    cfg = EdgeConfig(nats_url=nats_server, subject_prefix=prefix, port=0, models=MODEL,
                     route_timeout_s=0.5, route_retry_s=0.5, tokenize_timeout_s=0.5,
                     max_body_bytes=4096)
    async with running(EdgeService(cfg)) as svc:
        async with aiohttp.ClientSession() as session:
            yield svc.url, session


def _error(body: dict) -> dict:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


async def _post(session, url, path, data, **kw):
    async with session.post(url + path, data=data, **kw) as r:
        return r.status, await r.json(), r.headers


CASES = [
    # (path, raw body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", json.dumps({"prompt": "hi"}).encode(), 400, "model"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "5"}).encode(),
     400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -3}).encode(),
     400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": []}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": 5}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 10**9]}).encode(), 400,
     "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "temperature": 9}).encode(),
     400, "temperature"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode(),
     400, "stream"),
    ("/v1/completions", json.dumps({"model": "gpt-nope", "prompt": "x"}).encode(), 404, "model"),
    ("/v1/chat/completions", json.dumps({"model": MODEL}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400,
     "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "wizard", "content": "hi"}]}).encode(), 400, "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": 42}]}).encode(), 400, "messages[0].content"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400,
     "messages"),
]


@pytest.mark.parametrize("path,body,status,param", CASES)
async def test_bad_request_gets_openai_error(edge, path, body, status, param) -> None:
    url, session = edge
    got, payload, _ = await _post(session, url, path, body,
                                  headers={"Content-Type": "application/json"})
    assert got == status
    err = _error(payload)
    assert err["param"] == param


async def test_unknown_route_and_method_are_json_errors(edge) -> None:
    url, session = edge
    async with session.get(url + "/v1/nothing") as r:
        assert r.status == 404
        assert _error(await r.json())["type"] == "not_found_error"
    async with session.get(url + "/v1/completions") as r:
        assert r.status == 405
        _error(await r.json())


async def test_oversized_body_is_413(edge) -> None:
    url, session = edge
    big = json.dumps({"model": MODEL, "prompt": "x" * 10000}).encode()
    status, payload, _ = await _post(session, url, "/v1/completions", big)
    assert status == 413
    _error(payload)


async def test_no_mesh_behind_the_edge_is_a_fast_503_with_retry_after(edge) -> None:
    """Nothing serves the tokenizer or scheduler subjects in this test: 503, not a hang."""
    url, session = edge
    status, payload, headers = await _post(
        session, url, "/v1/completions", json.dumps({"model": MODEL, "prompt": "hello"}))
    assert status == 503
    assert headers["Retry-After"]
    assert _error(payload)["code"] == "service_unavailable"
    status, payload, _ = await _post(
        session, url, "/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 2, 3]}))
    assert status == 503


async def test_models_and_health(edge) -> None:
    url, session = edge
    async with session.get(url + "/v1/models") as r:
        body = await r.json()
        assert [m["id"] for m in body["data"]] == [MODEL]
        assert body["data"][0]["max_model_len"] == 32768  # Mistral-7B's, the sim imitates
    async with session.get(url + f"/v1/models/{MODEL}") as r:
        assert r.status == 200 and (await r.json())["max_model_len"] == 32768
    async with session.get(url + "/v1/models/other") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
    async with session.get(url + "/health") as r:
        assert r.status == 200
    async with session.get(url + "/metrics") as r:
        assert "prefixmesh_edge_requests_total" in await r.text()
