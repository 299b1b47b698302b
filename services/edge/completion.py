"""Running one OpenAI request on the mesh: prompts to token ids, choices to a response.

Shared by the HTTP routes (``app``) and the batch runner (``batch_runner``).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any

import msgspec

from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.pipeline import MeshClient, WorkerLost
from prefixmesh.services.edge.stops import StopMatcher
from prefixmesh.shared.openai.choices import (
    Choice,
    check_context,
    fan_out,
    first_of_prompt,
)
from prefixmesh.shared.openai.responses import (
    ChoiceResult,
    ResponseMeta,
    Usage,
    full_response,
)
from prefixmesh.shared.openai.schema import ApiError, ParsedRequest
from prefixmesh.shared.wire import GenerateChunkEvent, RequestDoneEvent


async def token_prompts(mesh: MeshClient, rid: str, parsed: ParsedRequest) -> list[list[int]]:
    if parsed.kind == "chat":
        return [await mesh.tokenize(rid, messages=parsed.messages)]
    out = []
    for p in parsed.prompts:
        out.append(p if isinstance(p, list) else await mesh.tokenize(rid, text=p))
    return out


async def run_choice(mesh: MeshClient, choice: Choice, parsed: ParsedRequest, tenant: str,
                     sink: asyncio.Queue[tuple[int, Any]] | None, batch_id: str = "",
                     worker_id: str = "", exclude: tuple[str, ...] = (),
                     deadline: float = 0.0) -> ChoiceResult:
    """Run one choice on the mesh, pushing (index, event) to ``sink`` (if any); returns its
    result. Stop sequences are applied here (``stops``): the chunk events pushed carry
    only text before the first stop, and a stop ends the request on its worker at once.
    ``exclude`` and ``deadline`` go to ``MeshClient.generate``."""
    index, sub_id, tokens = choice.index, choice.request_id, choice.token_ids
    result = ChoiceResult.start(index, len(tokens), parsed.sampling.logprobs is not None)
    stops = StopMatcher(parsed.sampling.stop)
    events = mesh.generate(sub_id, tokens, parsed.sampling, tenant, batch_id, worker_id,
                           exclude, deadline)
    async with aclosing(events):  # leaving early (stop) aborts the request on its worker
        async for event in events:
            if isinstance(event, GenerateChunkEvent):
                event = msgspec.structs.replace(event, text=stops.feed(event.text))
                result.take(event)
                if stops.stopped:
                    await _put(sink, index, event)
                    done = RequestDoneEvent(
                        request_id=sub_id, worker_id=result.worker_id, finish_reason="stop",
                        prompt_tokens=len(tokens), completion_tokens=result.completion_tokens,
                        cached_tokens=event.cached_tokens)
                    result.finish_reason = "stop"
                    await _put(sink, index, done)
                    return result
            elif isinstance(event, RequestDoneEvent):
                if tail := stops.flush():
                    result.text += tail
                    await _put(sink, index, GenerateChunkEvent(request_id=sub_id, token_ids=[],
                                                               text=tail))
                result.take(event)
            await _put(sink, index, event)
    return result


async def _choice_with_failover(mesh: MeshClient, choice: Choice, parsed: ParsedRequest,
                                tenant: str, batch_id: str, worker_id: str,
                                deadline: float) -> ChoiceResult:
    """A non-streamed choice: nothing reached the client yet, so a choice whose worker died
    after streaming some tokens is run again from scratch elsewhere (docs/design.md section 12)."""
    lost: list[str] = []
    while True:
        try:
            return await run_choice(mesh, choice, parsed, tenant, None, batch_id, worker_id,
                                    tuple(lost), deadline)
        except WorkerLost as exc:
            lost.append(exc.worker_id)
            worker_id = ""
            if len(lost) >= mesh.timeouts.attempts:
                raise


async def _put(sink: asyncio.Queue[tuple[int, Any]] | None, index: int, event: Any) -> None:
    if sink is not None:
        await sink.put((index, event))


async def complete(mesh: MeshClient, cfg: EdgeConfig, parsed: ParsedRequest, rid: str,
                   prompts: list[list[int]], tenant: str = "", batch_id: str = "",
                   worker_id: str = "") -> tuple[dict[str, Any], Usage]:
    """Run a non-streaming request whose prompts are already token ids; returns the
    OpenAI response body and its usage (raises ApiError when a choice failed). Shared by
    the HTTP routes and the batch runner."""
    check_context(prompts, parsed.sampling.max_tokens, cfg.context_lengths[parsed.model])
    counted = first_of_prompt(len(prompts), parsed.n)
    meta = ResponseMeta(id=rid, created=int(time.time()), model=parsed.model, kind=parsed.kind)
    deadline = time.time() + mesh.timeouts.request_s
    choices = fan_out(rid, prompts, parsed.n)
    if len(choices) == 1:  # the usual request: run in place, no task of its own
        results = [await _choice_with_failover(mesh, choices[0], parsed, tenant, batch_id,
                                               worker_id, deadline)]
    else:
        tasks = [asyncio.create_task(_choice_with_failover(mesh, c, parsed, tenant, batch_id,
                                                           worker_id, deadline),
                                     name=c.request_id)
                 for c in choices]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    failed = [r for r in results if r.error]
    if failed:
        raise ApiError(503, f"generation failed: {failed[0].error}", type="service_unavailable",
                       code="worker_error", headers={"Retry-After": "1"})
    usage = Usage()
    for r in results:
        usage.add(r, r.index in counted)
    return full_response(meta, results, usage), usage
