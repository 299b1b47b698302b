"""aiohttp application: the OpenAI-compatible routes and their error handling."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import Counter, Histogram

from prefixmesh.services.edge.auth import KeyResolver
from prefixmesh.services.edge.completion import complete, run_choice, token_prompts
from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.front import Answer, Declined
from prefixmesh.services.edge.openapi import openapi_document
from prefixmesh.services.edge.pipeline import MeshClient
from prefixmesh.services.edge.scoring import parse_score, score
from prefixmesh.services.edge.tenants import Admission, ApiKeys
from prefixmesh.shared.openai.choices import (
    ChoiceEvent,
    check_context,
    fan_out,
    stream_choices,
)
from prefixmesh.shared.openai.http import CLIENT_CLOSED, errors_middleware, read_body
from prefixmesh.shared.openai.responses import ResponseMeta, Usage
from prefixmesh.shared.openai.schema import (
    ApiError,
    ParsedRequest,
    check_model,
    parse_chat,
    parse_completion,
)
from prefixmesh.shared.runtime.log import bind_request
from prefixmesh.shared.runtime.metrics import (
    LATENCY_BUCKETS_S,
    health_handler,
    metrics_handler,
)

log = logging.getLogger(__name__)

MESH = web.AppKey("mesh", MeshClient)
CONFIG = web.AppKey("config", EdgeConfig)
KEYS = web.AppKey("keys", KeyResolver)
ADMISSION = web.AppKey("admission", Admission)
# The authenticated tenant of a request ("" with auth off), set by auth_middleware.
TENANT = web.RequestKey("tenant", str)
# Client-supplied x-request-id values echoed back: at most this long, these characters.
_CLIENT_ID_MAX = 128
_CLIENT_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")
# A JSON body's ``"stream": true`` (the key cannot occur unescaped inside a string).
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')

REQUESTS = Counter("prefixmesh_edge_requests_total", "HTTP requests by route and status",
                   ["route", "status"])
LATENCY = Histogram("prefixmesh_edge_request_latency_seconds", "send to last token",
                    ["route", "tenant"], buckets=LATENCY_BUCKETS_S)
TTFT = Histogram("prefixmesh_edge_ttft_seconds", "time to first token", ["route", "tenant"],
                 buckets=LATENCY_BUCKETS_S)
TOKENS = Counter("prefixmesh_edge_tokens_total", "tokens by kind (prompt, cached, completion)",
                 ["kind", "tenant"])
ERRORS = Counter("prefixmesh_edge_errors_total", "HTTP requests answered with an error status",
                 ["route", "status"])
# The OpenAI routes (each handler below names its own); build_app adds them.
ROUTES = web.RouteTableDef()
ROUTES.get("/health")(health_handler)
ROUTES.get("/metrics")(metrics_handler)
# The index under which ``_merge``'s queue carries a choice task's end (choices count up
# from 0; -1 is an error).
_ENDED = -2
# Tenant label of requests that carry none (no API key configured).
DEFAULT_TENANT_LABEL = "default"


class RequestMetrics:
    """The per-request metrics above, their labelled series looked up once per label set
    (``labels()`` takes a lock and builds a key each call: several per request)."""

    def __init__(self) -> None:
        self._status: dict[tuple[str, int], tuple[Counter, Counter | None]] = {}
        self._timing: dict[tuple[str, str], tuple[Histogram, Histogram, Counter, Counter,
                                                  Counter]] = {}

    def count_status(self, route: str, status: int) -> None:
        """One answered request (``errors_middleware``'s status sink)."""
        series = self._status.get((route, status))
        if series is None:
            error = (ERRORS.labels(route, str(status))
                     if 400 <= status != CLIENT_CLOSED else None)
            series = self._status[(route, status)] = (REQUESTS.labels(route, str(status)),
                                                      error)
        series[0].inc()
        if series[1] is not None:
            series[1].inc()

    def observe(self, route: str, usage: Usage, latency: float, ttft: float | None,
                tenant: str = "") -> None:
        """Latency, time to first token and tokens of one finished request."""
        tenant = tenant or DEFAULT_TENANT_LABEL
        series = self._timing.get((route, tenant))
        if series is None:
            series = self._timing[(route, tenant)] = (
                LATENCY.labels(route, tenant), TTFT.labels(route, tenant),
                TOKENS.labels("prompt", tenant), TOKENS.labels("cached", tenant),
                TOKENS.labels("completion", tenant))
        latency_h, ttft_h, prompt, cached, completion = series
        latency_h.observe(latency)
        if ttft is not None:
            ttft_h.observe(ttft)
        prompt.inc(usage.prompt_tokens)
        cached.inc(usage.cached_tokens)
        completion.inc(usage.completion_tokens)


METRICS = web.AppKey("metrics", RequestMetrics)


def _request_id(client: str, fallback: str | None) -> str:
    """The ``x-request-id`` a response carries: the client's own (echoed, as proxies do)
    when it sent a well-formed one, else ``fallback`` (the response's id) or a new
    ``req-`` id."""
    if client and len(client) <= _CLIENT_ID_MAX and set(client) <= _CLIENT_ID_CHARS:
        return client
    return fallback or "req-" + uuid.uuid4().hex


@web.middleware
async def request_id_middleware(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                ) -> web.StreamResponse:
    """Every response carries ``x-request-id`` (``_request_id``)."""
    resp = await handler(request)
    if not resp.prepared:
        resp.headers["x-request-id"] = _request_id(request.headers.get("x-request-id", ""),
                                                   resp.headers.get("x-request-id"))
    return resp


@web.middleware
async def auth_middleware(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
    """API key -> tenant for everything under /v1/ (401 without a valid key, auth on)."""
    if request.path.startswith("/v1/"):
        request[TENANT] = await request.app[KEYS].tenant(request.headers.get("Authorization"))
    return await handler(request)


def _parse(cfg: EdgeConfig, path: str, body: bytes) -> ParsedRequest:
    """A completion route's body (the route says text or chat)."""
    if path.endswith("/chat/completions"):
        return parse_chat(body, cfg.context_lengths, cfg.max_tokens_limit)
    return parse_completion(body, cfg.context_lengths, cfg.vocab_size, cfg.max_tokens_limit)


@contextmanager
def _admitted(app: web.Application, tenant: str) -> Iterator[None]:
    """Within the tenant's and the edge's limits for the request's life (429 / 503)."""
    admission = app[ADMISSION]
    admission.enter(tenant, time.monotonic())
    try:
        yield
    finally:
        admission.leave(tenant)


def _new_id(parsed: ParsedRequest) -> str:
    # 128 random bits, as uuid4's, without building a UUID.
    rid = ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + os.urandom(16).hex()
    bind_request(rid)
    return rid


async def _json_completion(app: web.Application, route: str, parsed: ParsedRequest,
                           rid: str, tenant: str) -> bytes:
    """A completion answered in one JSON body (not streamed)."""
    mesh, cfg = app[MESH], app[CONFIG]
    started = time.monotonic()
    prompts = await token_prompts(mesh, rid, parsed)
    body, usage = await complete(mesh, cfg, parsed, rid, prompts, tenant)
    app[METRICS].observe(route, usage, time.monotonic() - started, None, tenant)
    # msgspec writes the body several times faster than json.dumps.
    return msgspec.json.encode(body)


async def _generate(request: web.Request, parsed: ParsedRequest) -> web.StreamResponse:
    rid = _new_id(parsed)
    tenant = request.get(TENANT, "")
    with _admitted(request.app, tenant):
        if not parsed.stream:
            body = await _json_completion(request.app, request.path, parsed, rid, tenant)
            return web.Response(body=body, content_type="application/json",
                                headers={"x-request-id": rid})
        return await _stream(request, parsed, rid, tenant)


async def _stream(request: web.Request, parsed: ParsedRequest, rid: str, tenant: str
                  ) -> web.StreamResponse:
    """A completion streamed as server-sent events."""
    mesh = request.app[MESH]
    cfg = request.app[CONFIG]
    started = time.monotonic()
    prompts = await token_prompts(mesh, rid, parsed)
    check_context(prompts, parsed.sampling.max_tokens, cfg.context_lengths[parsed.model])
    meta = ResponseMeta(id=rid, created=int(time.time()), model=parsed.model, kind=parsed.kind)
    sink: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    tasks = [asyncio.create_task(run_choice(mesh, c, parsed, tenant, sink), name=c.request_id)
             for c in fan_out(rid, prompts, parsed.n)]
    try:
        resp, outcome = await stream_choices(request, meta, parsed, _merge(tasks, sink),
                                             len(prompts), {"x-request-id": rid}, started)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    request.app[METRICS].observe(request.path, outcome.usage, time.monotonic() - started,
                                 outcome.ttft_s, tenant)
    return resp


class FastCompletions:
    """The completion routes as the lean front (``front.py``) serves them: a request that
    is not streamed gets the very answer the aiohttp route and its middlewares give
    (auth, limits, errors as OpenAI JSON, ``x-request-id``, metrics)."""

    routes = frozenset({"/v1/completions", "/v1/chat/completions"})

    def __init__(self, app: web.Application) -> None:
        self._app = app

    @staticmethod
    def takes(path: str, body: bytes) -> bool:
        """Not visibly a streamed request (``"stream": true``: those go to aiohttp); one
        that says so less plainly is declined once parsed."""
        return _STREAM_TRUE.search(body) is None

    async def __call__(self, path: str, headers: dict[str, str], body: bytes) -> Answer:
        app = self._app
        status, out = CLIENT_CLOSED, {}
        try:
            tenant = await app[KEYS].tenant(headers.get("authorization"))
            parsed = _parse(app[CONFIG], path, body)
            if parsed.stream:
                raise Declined
            rid = _new_id(parsed)
            with _admitted(app, tenant):
                payload = await _json_completion(app, path, parsed, rid, tenant)
            status, out = 200, {"x-request-id": rid}
        except ApiError as err:
            status, out, payload = err.status, dict(err.headers), msgspec.json.encode(err.body())
        except Declined:
            status = 0  # not answered here: aiohttp answers (and counts) it
            raise
        except Exception:
            log.exception("unhandled error on %s", path)
            status, payload = 500, msgspec.json.encode(
                ApiError(500, "internal error", type="internal_error").body())
        finally:  # cancelled (the client went away): counted as CLIENT_CLOSED
            if status:
                app[METRICS].count_status(path, status)
        out["x-request-id"] = _request_id(headers.get("x-request-id", ""),
                                          out.get("x-request-id"))
        return status, out, payload


async def _merge(tasks: list[asyncio.Task], sink: asyncio.Queue[tuple[int, Any]]
                 ) -> AsyncIterator[tuple[int, ChoiceEvent]]:
    """The choices' events as they come, until every choice task has ended; a task that
    failed yields its error (an ApiError, or a 500 for anything else). Each task's end is
    queued behind its own events (a done callback), so one queue read serves both."""
    for t in tasks:
        t.add_done_callback(lambda task: sink.put_nowait((_ENDED, task)))
    running = len(tasks)
    while running:
        index, item = await sink.get()
        if index != _ENDED:
            yield index, item
            continue
        running -= 1
        if not item.cancelled() and (exc := item.exception()) is not None:
            yield -1, exc if isinstance(exc, ApiError) else ApiError(
                500, "internal error", type="internal_error")


@ROUTES.post("/v1/completions")
@ROUTES.post("/v1/chat/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    """Text and chat completions (the route says which)."""
    cfg = request.app[CONFIG]
    body = await read_body(request, cfg.max_body_bytes)
    return await _generate(request, _parse(cfg, request.path, body))


@ROUTES.post("/v1/score")
async def score_route(request: web.Request) -> web.Response:
    """Prefill-only scoring: probabilities of a few single-token continuations."""
    cfg = request.app[CONFIG]
    parsed = parse_score(await read_body(request, cfg.max_body_bytes), cfg.model_names,
                         cfg.vocab_size)
    rid = "score-" + uuid.uuid4().hex
    bind_request(rid)
    tenant = request.get(TENANT, "")
    admission = request.app[ADMISSION]
    admission.enter(tenant, time.monotonic())
    try:
        body = await score(request.app[MESH], cfg, parsed, rid, tenant)
    finally:
        admission.leave(tenant)
    return web.json_response(body, headers={"x-request-id": rid})


@ROUTES.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[CONFIG]))


def _model_object(cfg: EdgeConfig, name: str) -> dict[str, Any]:
    """A served model in OpenAI's shape, with its context length as vLLM reports it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "prefixmesh",
            "max_model_len": cfg.context_lengths[name]}


@ROUTES.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"object": "list",
                              "data": [_model_object(cfg, m) for m in cfg.model_names]})


@ROUTES.get("/v1/models/{model}")
async def model(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    name = request.match_info["model"]
    check_model(name, cfg.model_names)
    return web.json_response(_model_object(cfg, name))


def build_app(cfg: EdgeConfig, mesh: MeshClient, keys: KeyResolver | None = None
              ) -> web.Application:
    """The edge's aiohttp application (``keys``: the API key resolver; None = from
    ``cfg.api_keys_file`` alone)."""
    metrics = RequestMetrics()
    app = web.Application(middlewares=[request_id_middleware,
                                       errors_middleware(on_status=metrics.count_status),
                                       auth_middleware], client_max_size=cfg.max_body_bytes)
    app[METRICS] = metrics
    app[CONFIG] = cfg
    app[MESH] = mesh
    if keys is None:
        keys = KeyResolver(ApiKeys.load(cfg.api_keys_file) if cfg.api_keys_file else ApiKeys(),
                           cfg.auth)
    app[KEYS] = keys
    app[ADMISSION] = Admission(keys.keys, cfg.max_inflight)
    app.add_routes(ROUTES)
    return app
