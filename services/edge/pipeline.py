"""The edge's path through the mesh: tokenize -> (predict) -> route -> submit -> stream.

One ``MeshClient`` per edge process. Token streams from workers arrive on the edge's own
inbox subject (``stream.<edge_id>.*``) and are dispatched to per-request queues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.edge.schema import ApiError, Sampling
from shared.blocks import block_hashes
from shared.bus import Bus, BusUnavailable
from shared.messages import (
    PREDICT_REPLY,
    ROUTE_REPLY,
    SUBMIT_REPLY,
    TOKENIZER_REPLY,
    AbortRequest,
    ChatMessage,
    GenerateChunkEvent,
    GenerateDoneEvent,
    GenerateRequest,
    PredictLengthRequest,
    RouteRequest,
    SamplingParams,
    StreamEvent,
    TokenizeRequest,
)

log = logging.getLogger(__name__)

# Seconds the client is told to wait before retrying when the mesh cannot take a request.
RETRY_AFTER_S = 1
# Routing retry backoff while the scheduler is unavailable (seconds).
ROUTE_BACKOFF_S = 0.05
ROUTE_BACKOFF_MAX_S = 0.5


@dataclass(frozen=True, slots=True)
class MeshTimeouts:
    """Per-hop deadlines (seconds)."""

    tokenize_s: float = 10.0
    predict_s: float = 0.5
    route_s: float = 2.0
    # How long routing keeps retrying while no scheduler answers (standby takeover, restart).
    route_retry_s: float = 8.0
    submit_s: float = 2.0
    request_s: float = 600.0
    # Routing attempts per request (a refused or silent worker is excluded and re-routed).
    attempts: int = 3


class StreamDispatcher:
    """Routes stream events from the edge inbox to the queue of their request."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[StreamEvent]] = {}

    def open(self, request_id: str) -> asyncio.Queue[StreamEvent]:
        q: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._queues)

    async def on_event(self, event: StreamEvent) -> None:
        q = self._queues.get(event.request_id)
        if q is not None:  # late events of an aborted/finished request are dropped
            q.put_nowait(event)


def unavailable(what: str, exc: Exception) -> ApiError:
    return ApiError(503, f"{what} unavailable: {exc}", type="service_unavailable",
                    code="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


class MeshClient:
    """The edge's client for the tokenizer, predictor, scheduler and workers."""

    def __init__(self, bus: Bus, edge_id: str, timeouts: MeshTimeouts, predict: bool) -> None:
        self.bus = bus
        self.edge_id = edge_id
        self.timeouts = timeouts
        self.predict = predict
        self.streams = StreamDispatcher()

    async def tokenize(self, request_id: str, text: str | None = None,
                       messages: list[ChatMessage] | None = None,
                       add_special_tokens: bool = True) -> list[int]:
        req = TokenizeRequest(request_id=request_id, text=text, messages=messages,
                              add_special_tokens=add_special_tokens)
        try:
            reply = await self.bus.request(self.bus.subjects.tokenize, req, TOKENIZER_REPLY,
                                           self.timeouts.tokenize_s)
        except BusUnavailable as exc:
            raise unavailable("tokenizer", exc) from None
        if reply.error is not None:
            status = 400 if reply.error.code == "bad_request" else 500
            raise ApiError(status, reply.error.message, param="messages" if messages else "prompt")
        if not reply.token_ids:
            raise ApiError(400, "prompt tokenizes to nothing", param="prompt")
        return reply.token_ids

    async def predict_length(self, request_id: str, prompt_tokens: int) -> float:
        """Predicted output tokens, or 0 when prediction is off or unavailable."""
        if not self.predict:
            return 0.0
        req = PredictLengthRequest(request_id=request_id, prompt_tokens=prompt_tokens)
        try:
            reply = await self.bus.request(self.bus.subjects.predict_length, req, PREDICT_REPLY,
                                           self.timeouts.predict_s)
        except BusUnavailable as exc:  # prediction is advisory: route without it
            log.debug("predictor unavailable: %s", exc)
            return 0.0
        return reply.predicted_tokens if reply.error is None else 0.0

    async def _route(self, req: RouteRequest) -> str:
        """Ask the scheduler; while none answers, retry with backoff up to route_retry_s."""
        deadline = time.monotonic() + self.timeouts.route_retry_s
        backoff = ROUTE_BACKOFF_S
        while True:
            try:
                reply = await self.bus.request(self.bus.subjects.route, req, ROUTE_REPLY,
                                               self.timeouts.route_s)
                break
            except BusUnavailable as exc:
                if time.monotonic() + backoff > deadline:
                    raise unavailable("scheduler", exc) from None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, ROUTE_BACKOFF_MAX_S)
        if reply.error is not None or not reply.worker_id:
            msg = reply.error.message if reply.error else "no worker chosen"
            raise unavailable("workers", RuntimeError(msg))
        return reply.worker_id

    async def _submit(self, worker_id: str, req: GenerateRequest) -> str | None:
        """Hand the request to a worker; returns None on success, else why it failed."""
        try:
            ack = await self.bus.request(self.bus.subjects.worker_submit(worker_id), req,
                                         SUBMIT_REPLY, self.timeouts.submit_s)
        except BusUnavailable as exc:
            return str(exc)
        if not ack.accepted:
            return ack.error.message if ack.error else "refused"
        return None

    async def generate(self, request_id: str, token_ids: list[int], sampling: Sampling,
                       tenant: str, batch_id: str = "", worker_id: str = ""
                       ) -> AsyncIterator[GenerateChunkEvent | GenerateDoneEvent]:
        """Run one request on the mesh, yielding its chunks and then its done event.

        ``batch_id`` tags an offline batch request (the worker's ``batch_groups`` policy runs
        it below interactive traffic); ``worker_id`` is a placement decided by the batch
        planner, tried first without asking the scheduler (a refusal falls back to routing).
        Cancelling the consumer (client disconnect) aborts the request on its worker.
        """
        placed = worker_id
        predicted = await self.predict_length(request_id, len(token_ids))
        hashes = block_hashes(token_ids, tenant)
        gen = GenerateRequest(
            request_id=request_id, token_ids=token_ids,
            sampling=SamplingParams(
                max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, seed=sampling.seed, stop=sampling.stop,
                ignore_eos=sampling.ignore_eos, logprobs=sampling.logprobs,
                allowed_token_ids=sampling.allowed_token_ids,
            ),
            reply_to=self.bus.subjects.stream_reply(self.edge_id, request_id),
            tenant=tenant, predicted_output=predicted, batch_id=batch_id, created=time.time(),
            deadline=time.time() + self.timeouts.request_s,
        )
        queue = self.streams.open(request_id)
        worker_id = ""
        finished = False
        try:
            excluded: list[str] = []
            for _attempt in range(self.timeouts.attempts):
                route = RouteRequest(
                    request_id=request_id, block_hashes=hashes, prompt_tokens=len(token_ids),
                    max_tokens=sampling.max_tokens, tenant=tenant, predicted_output=predicted,
                    exclude=excluded,
                )
                worker_id = placed or await self._route(route)
                placed = ""
                failure = await self._submit(worker_id, gen)
                if failure is None:
                    break
                log.warning("worker %s did not take %s: %s", worker_id, request_id, failure)
                excluded.append(worker_id)
                worker_id = ""
            else:
                raise unavailable("workers", RuntimeError(f"{len(excluded)} workers refused"))
            deadline = time.monotonic() + self.timeouts.request_s
            while True:
                remaining = deadline - time.monotonic()
                try:
                    event = await asyncio.wait_for(queue.get(), max(remaining, 0.0))
                except TimeoutError:
                    raise ApiError(504, "request timed out", type="timeout",
                                   code="timeout") from None
                yield event
                if isinstance(event, GenerateDoneEvent):
                    finished = True
                    return
        finally:
            self.streams.close(request_id)
            if worker_id and not finished:
                await self._abort(worker_id, request_id)

    async def _abort(self, worker_id: str, request_id: str) -> None:
        try:
            await self.bus.publish(self.bus.subjects.worker_abort(worker_id),
                                   AbortRequest(request_id=request_id, reason="client gone"))
        except Exception as exc:  # best effort: the worker also drops streams nobody reads
            log.debug("abort of %s failed: %s", request_id, exc)
