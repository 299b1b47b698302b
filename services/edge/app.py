"""aiohttp application: the OpenAI-compatible routes and their error handling."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Histogram

from prefixmesh.services.edge.auth import KeyResolver
from prefixmesh.services.edge.completion import check_length, complete, run_choice, token_prompts
from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.openapi import openapi_document
from prefixmesh.services.edge.pipeline import MeshClient
from prefixmesh.services.edge.responses import (
    ChoiceResult,
    ResponseMeta,
    Usage,
    chunk,
    logprobs_body,
    usage_chunk,
)
from prefixmesh.services.edge.schema import ApiError, ParsedRequest, parse_chat, parse_completion
from prefixmesh.services.edge.scoring import parse_score, score
from prefixmesh.services.edge.tenants import Admission, ApiKeys
from prefixmesh.shared.log import bind_request
from prefixmesh.shared.messages import GenerateChunkEvent, GenerateDoneEvent
from prefixmesh.shared.metrics import LATENCY_BUCKETS_S, health_handler, metrics_handler

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
# Status label of requests whose client disconnected before the answer (nginx's 499).
CLIENT_CLOSED = 499
# Tenant label of requests that carry none (no API key configured).
DEFAULT_TENANT_LABEL = "default"


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def errors_middleware(request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                            ) -> web.StreamResponse:
    """Every error leaves as OpenAI-shaped JSON with the right status, never a bare 500."""
    route = request.match_info.route.resource.canonical if request.match_info.route.resource \
        else "unmatched"
    try:
        resp = await handler(request)
    except asyncio.CancelledError:  # the client went away (its request was aborted)
        REQUESTS.labels(route, str(CLIENT_CLOSED)).inc()
        raise
    except ApiError as err:
        resp = error_response(err)
    except web.HTTPRequestEntityTooLarge as exc:
        resp = error_response(ApiError(413, f"request body too large: {exc.text}",
                                       code="request_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        msg = f"{request.method} {request.path}: {exc.reason}"
        resp = error_response(ApiError(exc.status, msg, type=kind, headers={
            k: v for k, v in exc.headers.items() if k.lower() == "allow"}))
    except Exception:
        log.exception("unhandled error on %s", request.path)
        resp = error_response(ApiError(500, "internal error", type="internal_error"))
    REQUESTS.labels(route, str(resp.status)).inc()
    if resp.status >= 400:
        ERRORS.labels(route, str(resp.status)).inc()
    return resp


@web.middleware
async def request_id_middleware(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                ) -> web.StreamResponse:
    """Every response carries ``x-request-id``: the client's own (echoed, as proxies do)
    when it sent a well-formed one, else the response's id (generation routes) or a new
    ``req-`` id."""
    resp = await handler(request)
    client = request.headers.get("x-request-id", "")
    if not resp.prepared:
        if client and len(client) <= _CLIENT_ID_MAX and set(client) <= _CLIENT_ID_CHARS:
            resp.headers["x-request-id"] = client
        elif "x-request-id" not in resp.headers:
            resp.headers["x-request-id"] = "req-" + uuid.uuid4().hex
    return resp


@web.middleware
async def auth_middleware(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
    """API key -> tenant for everything under /v1/ (401 without a valid key, auth on)."""
    if request.path.startswith("/v1/"):
        request[TENANT] = await request.app[KEYS].tenant(request.headers.get("Authorization"))
    return await handler(request)


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        cfg = request.app[CONFIG]
        raise ApiError(413, f"request body exceeds {cfg.max_body_bytes} bytes",
                       code="request_too_large") from None


async def _generate(request: web.Request, parsed: ParsedRequest) -> web.StreamResponse:
    mesh = request.app[MESH]
    cfg = request.app[CONFIG]
    kind = parsed.kind
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    bind_request(rid)
    tenant = request.get(TENANT, "")
    admission = request.app[ADMISSION]
    admission.enter(tenant, time.monotonic())
    try:
        return await _generate_admitted(request, parsed, rid, tenant)
    finally:
        admission.leave(tenant)


async def _generate_admitted(request: web.Request, parsed: ParsedRequest, rid: str,
                             tenant: str) -> web.StreamResponse:
    mesh = request.app[MESH]
    cfg = request.app[CONFIG]
    kind = parsed.kind
    started = time.monotonic()
    route = request.path
    prompts = await token_prompts(mesh, rid, parsed)
    headers = {"x-request-id": rid}
    if not parsed.stream:
        body, usage = await complete(mesh, cfg, parsed, rid, prompts, tenant)
        _observe(route, usage, time.monotonic() - started, None, tenant)
        return web.json_response(body, headers=headers)
    check_length(cfg, prompts, parsed.sampling.max_tokens)
    jobs = [(pi * parsed.n + j, toks) for pi, toks in enumerate(prompts) for j in range(parsed.n)]
    # The prompt of a choice counts once per distinct prompt in usage, as OpenAI does.
    first_of_prompt = {pi * parsed.n for pi in range(len(prompts))}
    meta = ResponseMeta(id=rid, created=int(time.time()), model=parsed.model, kind=kind)
    sink: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    tasks = [asyncio.create_task(run_choice(mesh, rid, i, toks, parsed, tenant, sink),
                                 name=f"{rid}-{i}") for i, toks in jobs]
    try:
        return await _stream(request, meta, parsed, tasks, sink, first_of_prompt, headers,
                             started, tenant)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _observe(route: str, usage: Usage, latency: float, ttft: float | None,
             tenant: str = "") -> None:
    tenant = tenant or DEFAULT_TENANT_LABEL
    LATENCY.labels(route, tenant).observe(latency)
    if ttft is not None:
        TTFT.labels(route, tenant).observe(ttft)
    TOKENS.labels("prompt", tenant).inc(usage.prompt_tokens)
    TOKENS.labels("cached", tenant).inc(usage.cached_tokens)
    TOKENS.labels("completion", tenant).inc(usage.completion_tokens)


async def _stream(request: web.Request, meta: ResponseMeta, parsed: ParsedRequest,
                  tasks: list[asyncio.Task], sink: asyncio.Queue[tuple[int, Any]],
                  first_of_prompt: set[int], headers: dict[str, str],
                  started: float, tenant: str) -> web.StreamResponse:
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)

    async def send(obj: Any) -> None:
        await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    usage = Usage()
    ttft: float | None = None
    want_logprobs = parsed.sampling.logprobs is not None
    text_offsets: dict[int, int] = {}  # choice -> characters sent (completions text_offset)
    pending = set(tasks)
    started_choices: set[int] = set()
    getter: asyncio.Task | None = None
    while pending or not sink.empty():
        if getter is None:
            getter = asyncio.ensure_future(sink.get())
        done, _ = await asyncio.wait(pending | {getter}, return_when=asyncio.FIRST_COMPLETED)
        for t in done - {getter}:
            pending.discard(t)
            if t.exception() is not None:
                exc = t.exception()
                err = exc if isinstance(exc, ApiError) else ApiError(500, "internal error",
                                                                     type="internal_error")
                await send(err.body())
        if getter not in done:
            continue
        index, event = getter.result()
        getter = None
        if parsed.kind == "chat" and index not in started_choices:
            started_choices.add(index)
            await send(chunk(meta, index, text="", role=True))
        if isinstance(event, GenerateChunkEvent):
            if ttft is None:
                ttft = time.monotonic() - started
            if event.text or (want_logprobs and event.logprobs):
                lp = logprobs_body(parsed.kind, event.logprobs, text_offsets.get(index, 0)) \
                    if want_logprobs else None
                text_offsets[index] = text_offsets.get(index, 0) + len(event.text)
                await send(chunk(meta, index, text=event.text, logprobs=lp))
        elif isinstance(event, GenerateDoneEvent):
            if event.error is not None:
                await send(ApiError(503, f"generation failed: {event.error.message}",
                                    type="service_unavailable", code="worker_error").body())
            else:
                await send(chunk(meta, index, text=None if parsed.kind == "chat" else "",
                                 finish_reason=event.finish_reason))
            usage.add(ChoiceResult(index=index, prompt_tokens=event.prompt_tokens,
                                   completion_tokens=event.completion_tokens,
                                   cached_tokens=event.cached_tokens),
                      index in first_of_prompt)
    if getter is not None:
        getter.cancel()
    if parsed.include_usage:
        await send(usage_chunk(meta, usage))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    _observe(request.path, usage, time.monotonic() - started, ttft, tenant)
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    parsed = parse_completion(await _read_body(request), cfg.model_names, cfg.vocab_size,
                              cfg.max_tokens_limit)
    return await _generate(request, parsed)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    parsed = parse_chat(await _read_body(request), cfg.model_names, cfg.max_tokens_limit)
    return await _generate(request, parsed)


async def score_route(request: web.Request) -> web.Response:
    """Prefill-only scoring: probabilities of a few single-token continuations."""
    cfg = request.app[CONFIG]
    parsed = parse_score(await _read_body(request), cfg.model_names, cfg.vocab_size)
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


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[CONFIG]))


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "prefixmesh"}
            for m in cfg.model_names]
    return web.json_response({"object": "list", "data": data})


async def model(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    name = request.match_info["model"]
    if name not in cfg.model_names:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model",
                       code="model_not_found")
    return web.json_response({"id": name, "object": "model", "created": 0,
                              "owned_by": "prefixmesh"})


def build_app(cfg: EdgeConfig, mesh: MeshClient, keys: KeyResolver | None = None
              ) -> web.Application:
    """The edge's aiohttp application (``keys``: the API key resolver; None = from
    ``cfg.api_keys_file`` alone)."""
    app = web.Application(middlewares=[request_id_middleware, errors_middleware,
                                       auth_middleware], client_max_size=cfg.max_body_bytes)
    app[CONFIG] = cfg
    app[MESH] = mesh
    if keys is None:
        keys = KeyResolver(ApiKeys.load(cfg.api_keys_file) if cfg.api_keys_file else ApiKeys(),
                           cfg.auth)
    app[KEYS] = keys
    app[ADMISSION] = Admission(keys.keys, cfg.max_inflight)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/score", score_route)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    return app
