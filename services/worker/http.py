"""Standalone HTTP front of a worker: one engine replica as an OpenAI / SGLang / vLLM server.

``prefixmesh worker --http PORT`` (or ``PM_HTTP_PORT``) serves the very engine and local
scheduler that the worker drives for the mesh, so third-party routers (sglang-router,
vllm-router) and prefixmesh's own edge can be put in front of the same simulated GPUs. With
the mesh on, both paths feed one engine: a request from either lands in the same queue.

Routes, as the peers' routers use them (measured against sglang-router 0.3.2 and
vllm-router 0.1.17):

- ``GET /health``, ``/health_generate``: liveness (sglang-router probes /health at start and
  every ``--health-check-interval-secs``).
- ``GET /server_info``, ``/get_server_info``, ``/model_info``, ``/get_model_info``,
  ``/v1/models``: what the routers read at registration. ``/server_info`` also carries
  the sim clock's ``time_scale`` and ``step_lag`` since the last flush (engine/pacing.py).
- ``GET /get_load``: queued + running requests (power_of_two's load probe).
- ``POST /v1/completions``, ``/v1/chat/completions``: OpenAI, SSE streaming or not, usage
  with ``prompt_tokens_details.cached_tokens``; prompts as text or token ids.
- ``POST /generate``: SGLang's native request (text or input_ids, sampling_params) and
  response (``text``, ``output_ids``, ``meta_info``); streaming sends cumulative text.
- ``POST /tokenize``, ``/detokenize``: SGLang's and vLLM's shape.
- ``POST /v1/completions/render``, ``/v1/chat/completions/render``: vLLM's renderer shape
  (a list of token-in TokenizedRequests; one for chat). vllm-router renders every request
  on the workers before routing on the token ids.
- ``POST /flush_cache``: SGLang's admin route; drops the prefix cache when idle (the
  comparison runner resets every engine between contenders).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack, aclosing
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.openai.choices import (
    Choice,
    check_context,
    fan_out,
    first_of_prompt,
    stream_choices,
)
from prefixmesh.shared.openai.http import (
    close_sse,
    errors_middleware,
    open_sse,
    read_body,
    send_sse,
)
from prefixmesh.shared.openai.responses import (
    ChoiceResult,
    ResponseMeta,
    Usage,
    full_response,
)
from prefixmesh.shared.openai.schema import (
    ApiError,
    ParsedRequest,
    decode_body,
    parse_chat,
    parse_completion,
    refusal_error,
)
from prefixmesh.shared.wire import (
    ErrorInfo,
    GenerateChunkEvent,
    RequestDoneEvent,
    SamplingParams,
    TokenizedRequest,
)

WORKER = web.AppKey("worker", WorkerService)
# Largest request body accepted (bytes): a 128k-token prompt as JSON ints fits.
MAX_BODY_BYTES = 16 * 1024 * 1024
# Seconds the HTTP server gives open responses on shutdown (the worker drained before).
SHUTDOWN_TIMEOUT_S = 2.0
# SGLang's default max_new_tokens for /generate.
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# Refusal codes of WorkerService._submit -> (HTTP status, OpenAI error type).
def _worker(request: web.Request) -> WorkerService:
    return request.app[WORKER]


def _models(w: WorkerService) -> dict[str, int]:
    """The served model's name -> its context length."""
    return {w.model.name: w.model.context_length}


def _vocab(w: WorkerService) -> int:
    return w.tok.vocab_size if w.tok is not None else 2**31


def _encode(w: WorkerService, text: str) -> list[int]:
    if w.tok is None:
        raise ApiError(400, "this worker takes token ids only", param="prompt")
    return w.tok.encode(text)


def _token_prompts(w: WorkerService, parsed: ParsedRequest) -> list[list[int]]:
    if parsed.kind == "chat":
        if w.tok is None:
            raise ApiError(400, "chat needs a tokenizer; send token ids", param="messages")
        return [w.tok.encode_chat(parsed.messages)]
    prompts = [p if isinstance(p, list) else _encode(w, p) for p in parsed.prompts]
    for p in prompts:
        if not p:
            raise ApiError(400, "prompt has no tokens", param="prompt")
    return prompts


async def _run(w: WorkerService, jobs: list[Choice], sampling: SamplingParams
               ) -> AsyncGenerator[tuple[int, GenerateChunkEvent | RequestDoneEvent], None]:
    """Submit every job to the engine and yield (job index, event) until all are done.

    Leaving early (client disconnect, error) aborts what is still running."""
    if not w.accepting:
        raise ApiError(503, "worker is shutting down", type="service_unavailable",
                       code="unavailable", headers={"Retry-After": "1"})
    sink: asyncio.Queue = asyncio.Queue()
    index = {j.request_id: j.index for j in jobs}
    submitted: list[str] = []
    try:
        for j in jobs:
            reply = w.submit_local(TokenizedRequest(
                request_id=j.request_id, token_ids=j.token_ids, sampling=sampling,
                reply_to="", created=time.time()), sink)
            if not reply.accepted:
                raise refusal_error(reply.error or ErrorInfo("refused", "unavailable",
                                                             retriable=True))
            submitted.append(j.request_id)
        pending = set(submitted)
        while pending:
            event = await sink.get()
            if isinstance(event, RequestDoneEvent):
                pending.discard(event.request_id)
            yield index[event.request_id], event
    finally:
        for rid in submitted:
            if rid in w.live:
                w.abort(rid)


async def _read(request: web.Request) -> bytes:
    return await read_body(request, MAX_BODY_BYTES)


# --------------------------------------------------------------------------- OpenAI


async def _openai(request: web.Request, parsed: ParsedRequest) -> web.StreamResponse:
    w = _worker(request)
    prompts = _token_prompts(w, parsed)
    check_context(prompts, parsed.sampling.max_tokens, w.model.context_length)
    rid = ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + uuid.uuid4().hex
    jobs = fan_out(rid, prompts, parsed.n)
    meta = ResponseMeta(id=rid, created=int(time.time()), model=parsed.model, kind=parsed.kind)
    headers = {"x-request-id": rid}
    async with aclosing(_run(w, jobs, parsed.sampling)) as events:
        if parsed.stream:  # a refusal raises before the stream opens: an HTTP error
            resp, _ = await stream_choices(request, meta, parsed, events, len(prompts),
                                           headers, time.monotonic())
            return resp
        want_logprobs = parsed.sampling.logprobs is not None
        results = {j.index: ChoiceResult.start(j.index, len(j.token_ids), want_logprobs)
                   for j in jobs}
        async for i, ev in events:
            results[i].take(ev)
    usage = Usage()
    counted = first_of_prompt(len(prompts), parsed.n)
    for r in results.values():
        usage.add(r, r.index in counted)
    return web.json_response(full_response(meta, list(results.values()), usage),
                             headers=headers)


async def completions(request: web.Request) -> web.StreamResponse:
    w = _worker(request)
    return await _openai(request, parse_completion(await _read(request), _models(w), _vocab(w)))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    w = _worker(request)
    return await _openai(request, parse_chat(await _read(request), _models(w)))


# --------------------------------------------------------------------------- SGLang native


class _SglSampling(msgspec.Struct):
    max_new_tokens: int = SGLANG_DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    stop: str | list[str] | None = None


class _SglGenerate(msgspec.Struct):
    text: str | list[str] | None = None
    # One prompt (list of ids) or a batch (list of lists); checked in _sgl_prompts.
    input_ids: list[Any] | None = None
    sampling_params: _SglSampling = msgspec.field(default_factory=_SglSampling)
    stream: bool = False
    rid: str | None = None


def _sgl_prompts(w: WorkerService, b: _SglGenerate) -> tuple[list[list[int]], bool]:
    """Token-id prompts of a /generate body and whether it was a batch."""
    if (b.text is None) == (b.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", param="text")
    if b.input_ids is not None:
        batch = bool(b.input_ids) and isinstance(b.input_ids[0], list)
        prompts = b.input_ids if batch else [b.input_ids]
        vocab = _vocab(w)
        for p in prompts:
            if not isinstance(p, list) or not p or any(
                    not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
                    for t in p):
                raise ApiError(400, f"input_ids must be non-empty ids in [0, {vocab})",
                               param="input_ids")
        return prompts, batch
    text = b.text
    assert text is not None  # exactly one of text and input_ids: checked above
    batch = isinstance(text, list)
    texts = text if isinstance(text, list) else [text]
    prompts = [_encode(w, t) for t in texts]
    if not prompts or any(not p for p in prompts):
        raise ApiError(400, "text must be non-empty", param="text")
    return prompts, batch


def _sgl_finish(ev: RequestDoneEvent) -> dict[str, Any]:
    if ev.finish_reason == "length":
        return {"type": "length", "length": ev.completion_tokens}
    return {"type": ev.finish_reason}


async def generate(request: web.Request) -> web.StreamResponse:
    w = _worker(request)
    b = decode_body(await _read(request), _SglGenerate)
    prompts, batch = _sgl_prompts(w, b)
    sp = b.sampling_params
    if sp.max_new_tokens < 1:
        raise ApiError(400, "max_new_tokens must be at least 1", param="max_new_tokens")
    if batch and b.stream:
        raise ApiError(400, "streaming takes one prompt", param="stream")
    check_context(prompts, sp.max_new_tokens, w.model.context_length)
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    sampling = SamplingParams(max_tokens=sp.max_new_tokens, temperature=sp.temperature,
                              top_p=sp.top_p, ignore_eos=sp.ignore_eos, stop=stop)
    rid = b.rid or uuid.uuid4().hex
    jobs = fan_out(rid, prompts, 1)
    out: list[dict[str, Any]] = [{"text": "", "output_ids": [], "meta_info": {
        "id": j.request_id, "prompt_tokens": len(j.token_ids), "completion_tokens": 0,
        "cached_tokens": 0, "finish_reason": None}} for j in jobs]
    started = time.monotonic()

    def apply(i: int, ev: GenerateChunkEvent | RequestDoneEvent) -> None:
        o, m = out[i], out[i]["meta_info"]
        if isinstance(ev, GenerateChunkEvent):
            o["text"] += ev.text
            o["output_ids"] += ev.token_ids
            m["completion_tokens"] = len(o["output_ids"])
        else:
            m.update(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                     cached_tokens=ev.cached_tokens, finish_reason=_sgl_finish(ev),
                     e2e_latency=time.monotonic() - started)

    async with aclosing(_run(w, jobs, sampling)) as events:
        if not b.stream:
            async for i, ev in events:
                apply(i, ev)
            return web.json_response(out if batch else out[0])
        first = await anext(events)
        resp = await open_sse(request)
        apply(*first)
        await send_sse(resp, out[0])
        async for i, ev in events:
            apply(i, ev)
            await send_sse(resp, out[0])
    await close_sse(request, resp)
    return resp


# --------------------------------------------------------------------------- tokenizer routes


class _TokenizeBody(msgspec.Struct):
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    model: str | None = None
    add_special_tokens: bool = True


async def tokenize(request: web.Request) -> web.Response:
    w = _worker(request)
    b = decode_body(await _read(request), _TokenizeBody)
    if b.messages is not None:
        body = msgspec.json.encode({"model": w.model.name, "messages": b.messages})
        tokens = _token_prompts(w, parse_chat(body, _models(w)))[0]
    elif isinstance(b.prompt, str):
        tokens = _encode(w, b.prompt)
    elif isinstance(b.prompt, list):
        tokens = b.prompt
    else:
        raise ApiError(400, "prompt or messages is required", param="prompt")
    return web.json_response({"tokens": tokens, "count": len(tokens),
                              "max_model_len": w.model.context_length, "token_strs": None})


class _DetokenizeBody(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


async def detokenize(request: web.Request) -> web.Response:
    w = _worker(request)
    b = decode_body(await _read(request), _DetokenizeBody)
    if w.tok is None:
        raise ApiError(400, "this worker has no tokenizer", param="tokens")
    return web.json_response({"prompt": w.tok.decode(b.tokens)})


def _rendered(w: WorkerService, rid: str, tokens: list[int], parsed: ParsedRequest,
              stream_options: Any) -> dict[str, Any]:
    s = parsed.sampling
    return {"request_id": rid, "token_ids": tokens, "features": None, "model": parsed.model,
            "sampling_params": {"max_tokens": s.max_tokens, "temperature": s.temperature,
                                "top_p": s.top_p, "seed": s.seed, "stop": s.stop,
                                "ignore_eos": s.ignore_eos, "n": parsed.n},
            "stream": parsed.stream, "stream_options": stream_options, "cache_salt": None,
            "priority": 0, "kv_transfer_params": None, "token_offsets": None}


def _stream_options(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body).get("stream_options")
    except (msgspec.DecodeError, AttributeError):
        return None


async def render_completions(request: web.Request) -> web.Response:
    w = _worker(request)
    body = await _read(request)
    parsed = parse_completion(body, _models(w), _vocab(w))
    prompts = _token_prompts(w, parsed)
    opts = _stream_options(body)
    return web.json_response([_rendered(w, f"cmpl-{uuid.uuid4().hex}-{i}", p, parsed, opts)
                              for i, p in enumerate(prompts)])


async def render_chat(request: web.Request) -> web.Response:
    w = _worker(request)
    body = await _read(request)
    parsed = parse_chat(body, _models(w))
    tokens = _token_prompts(w, parsed)[0]
    return web.json_response(_rendered(w, f"chatcmpl-{uuid.uuid4().hex}", tokens, parsed,
                                       _stream_options(body)))


# --------------------------------------------------------------------------- info and admin


async def health(request: web.Request) -> web.Response:
    if not _worker(request).accepting:
        raise ApiError(503, "worker is shutting down", type="service_unavailable")
    return web.json_response({"status": "ok"})


def _load(w: WorkerService) -> dict[str, int]:
    s = w.engine.stats(w.engine.now())
    return {"running": s.running, "waiting": s.waiting, "outstanding_tokens":
            s.outstanding_tokens}


async def server_info(request: web.Request) -> web.Response:
    w = _worker(request)
    cost, eng = w.cost, w.engine
    return web.json_response({
        "model_path": w.model.name, "served_model_name": w.model.name,
        "tokenizer_path": w.cfg.tokenizer_path or w.model.name,
        "simulated": w.model.simulated, "backend": w.cfg.backend,
        "profile": w.cfg.profile, "local_policy": w.cfg.local_policy,
        "worker_id": w.worker_id, "page_size": eng.block_size,
        "max_total_num_tokens": eng.num_blocks * eng.block_size,
        "chunked_prefill_size": cost.max_batched_tokens,
        "max_running_requests": cost.max_num_seqs, "context_length": w.model.context_length,
        "dp_size": 1, "tp_size": 1, "version": "prefixmesh",
        "internal_states": [_load(w)],
        # Not SGLang's: what the backend adds (the sim: its clock's time_scale and how
        # late its steps ran since the last flush, step_lag).
        **eng.info(),
    })


async def model_info(request: web.Request) -> web.Response:
    w = _worker(request)
    return web.json_response({
        "model_path": w.model.name, "tokenizer_path": w.cfg.tokenizer_path or w.model.name,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "max_model_len": w.model.context_length,
    })


async def models(request: web.Request) -> web.Response:
    w = _worker(request)
    return web.json_response({"object": "list", "data": [
        {"id": m, "object": "model", "created": 0, "owned_by": "prefixmesh",
         "max_model_len": w.model.context_length} for m in _models(w)]})


async def get_load(request: web.Request) -> web.Response:
    """SGLang's shape (``load`` = queued + running requests) plus the per-rank fields."""
    w = _worker(request)
    ld = _load(w)
    n = ld["running"] + ld["waiting"]
    return web.json_response({"load": n, "dp_rank": 0, "num_reqs": n,
                              "num_waiting_reqs": ld["waiting"],
                              "num_tokens": ld["outstanding_tokens"]})


async def flush_cache(request: web.Request) -> web.Response:
    if not _worker(request).reset_cache():
        raise ApiError(400, "cache not flushed: requests are still running",
                       code="requests_running")
    return web.json_response({"flushed": True})


def build_app(worker: WorkerService) -> web.Application:
    """The worker's HTTP application."""
    app = web.Application(middlewares=[errors_middleware()], client_max_size=MAX_BODY_BYTES)
    app[WORKER] = worker
    r = app.router
    handler: Handler
    for path, handler in (("/health", health), ("/health_generate", health),
                          ("/server_info", server_info), ("/get_server_info", server_info),
                          ("/model_info", model_info), ("/get_model_info", model_info),
                          ("/v1/models", models), ("/get_load", get_load)):
        r.add_get(path, handler)
    for path, handler in (("/v1/completions", completions),
                          ("/v1/chat/completions", chat_completions), ("/generate", generate),
                          ("/tokenize", tokenize), ("/detokenize", detokenize),
                          ("/v1/completions/render", render_completions),
                          ("/v1/chat/completions/render", render_chat),
                          ("/flush_cache", flush_cache)):
        r.add_post(path, handler)
    return app


async def serve_http(stack: AsyncExitStack, worker: WorkerService) -> None:
    """Serve ``worker`` over HTTP on its ``http_host:http_port`` until ``stack`` unwinds
    (the worker's ``front``)."""
    # Access log at DEBUG only: it shows which routes a router calls, at a cost per request.
    access_log = logging.getLogger("aiohttp.access") if worker.cfg.log_level == "DEBUG" else None
    # handler_cancellation: a client that goes away cancels its handler, which aborts the
    # request on the engine and frees its KV blocks (docs/design.md section 12).
    runner = web.AppRunner(build_app(worker), access_log=access_log,
                           handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, worker.cfg.http_host, worker.cfg.http_port).start()
