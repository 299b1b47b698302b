"""One OpenAI request as choices: fan-out, the context-length check, the SSE stream.

A request with P prompts and ``n`` choices per prompt runs as P x n engine requests
(choice ``index = prompt * n + j``). The edge (over the mesh) and the standalone worker
(straight into its engine) both build their choices here and stream them with
``stream_choices``, so the two HTTP fronts answer in one shape.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from prefixmesh.shared.openai.http import close_sse, open_sse, send_sse
from prefixmesh.shared.openai.responses import (
    ChoiceResult,
    ResponseMeta,
    Usage,
    chunk,
    logprobs_body,
    usage_chunk,
)
from prefixmesh.shared.openai.schema import ApiError, ParsedRequest
from prefixmesh.shared.wire import GenerateChunkEvent, RequestDoneEvent

# What a choice's stream carries: its events, or the error that ended it.
ChoiceEvent = GenerateChunkEvent | RequestDoneEvent | ApiError


@dataclass(slots=True)
class Choice:
    """One prompt x choice of a request, run as one engine request."""

    index: int
    request_id: str
    token_ids: list[int]


def fan_out(rid: str, prompts: list[list[int]], n: int) -> list[Choice]:
    """The choices of a request; a single choice keeps the request's own id."""
    single = len(prompts) * n == 1
    return [Choice(pi * n + j, rid if single else f"{rid}-{pi * n + j}", toks)
            for pi, toks in enumerate(prompts) for j in range(n)]


def first_of_prompt(prompts: int, n: int) -> set[int]:
    """Choice indexes whose prompt counts in usage: each distinct prompt once, as OpenAI
    counts it."""
    return {pi * n for pi in range(prompts)}


def check_context(prompts: list[list[int]], max_tokens: int, limit: int) -> None:
    """400 when a prompt plus ``max_tokens`` does not fit the model's context."""
    for p in prompts:
        if len(p) + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the "
                           f"prompt has {len(p)} and max_tokens is {max_tokens}.",
                           param="max_tokens", code="context_length_exceeded")


async def _prepend(first: tuple[int, ChoiceEvent], rest: AsyncIterator[tuple[int, ChoiceEvent]]
                   ) -> AsyncIterator[tuple[int, ChoiceEvent]]:
    yield first
    async for item in rest:
        yield item


@dataclass(slots=True)
class StreamOutcome:
    """What a finished stream reports to its caller's metrics."""

    usage: Usage
    # Seconds from ``started`` to the first token (None: no token came).
    ttft_s: float | None


async def stream_choices(request: web.Request, meta: ResponseMeta, parsed: ParsedRequest,
                         events: AsyncIterator[tuple[int, ChoiceEvent]], n_prompts: int,
                         headers: dict[str, str], started: float
                         ) -> tuple[web.StreamResponse, StreamOutcome]:
    """Relay (choice index, event) pairs as OpenAI's server-sent chunks, ending with the
    usage chunk (when asked for) and ``data: [DONE]``. The stream opens with the first
    event: a request failed before that (a worker refused an option, no worker could take
    it) raises its ApiError, an HTTP error like a non-streamed request's. A choice that
    fails later sends an error object in the stream, as OpenAI does once the stream is
    open; the others go on."""
    first = await anext(events)
    if isinstance(first[1], ApiError):
        raise first[1]
    events = _prepend(first, events)
    resp = await open_sse(request, headers)
    usage = Usage()
    counted = first_of_prompt(n_prompts, parsed.n)
    want_logprobs = parsed.sampling.logprobs is not None
    chat = parsed.kind == "chat"
    text_offsets: dict[int, int] = {}  # choice -> characters sent (completions text_offset)
    opened: set[int] = set()
    ttft: float | None = None
    async for index, event in events:
        if isinstance(event, ApiError):
            await send_sse(resp, event.body())
            continue
        if chat and index not in opened:
            opened.add(index)
            await send_sse(resp, chunk(meta, index, text="", role=True))
        if isinstance(event, GenerateChunkEvent):
            if ttft is None:
                ttft = time.monotonic() - started
            if event.text or (want_logprobs and event.logprobs):
                offset = text_offsets.get(index, 0)
                lp = logprobs_body(parsed.kind, event.logprobs, offset) if want_logprobs \
                    else None
                text_offsets[index] = offset + len(event.text)
                await send_sse(resp, chunk(meta, index, text=event.text, logprobs=lp))
            continue
        if event.error is not None:
            await send_sse(resp, ApiError(503, f"generation failed: {event.error.message}",
                                          type="service_unavailable",
                                          code="worker_error").body())
        else:
            await send_sse(resp, chunk(meta, index, text=None if chat else "",
                                       finish_reason=event.finish_reason))
        usage.add(ChoiceResult(index=index, prompt_tokens=event.prompt_tokens,
                               completion_tokens=event.completion_tokens,
                               cached_tokens=event.cached_tokens), index in counted)
    if parsed.include_usage:
        await send_sse(resp, usage_chunk(meta, usage))
    await close_sse(request, resp)
    return resp, StreamOutcome(usage, ttft)
