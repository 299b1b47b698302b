"""The edge's path through the mesh: tokenize -> (predict) -> route -> submit -> stream.

One ``MeshClient`` per edge process. Token streams from workers arrive on the edge's own
inbox subject (``stream.<edge_id>.*``) and are dispatched to per-request queues.

Fewer hops where they cost: a short text prompt is tokenized in the edge itself
(``LocalTokenizer``, the tokenizer service's own ``shared/text/requests.handle``), a long
one by the tokenizer service; token-id prompts skip tokenization; a short prompt reaches
its worker through the scheduler in one hop (``sched.place``); the placements of short
prompts, and the routing requests of longer ones, asked in one turn of the event loop go
to the scheduler together (``RequestBatcher``), and it passes each worker its share of a
placement in one message.

Worker failover (docs/design.md section 12): while a request waits on its worker, the edge
watches that worker's load reports (``WorkerDirectory``). A worker silent for
``worker_silence_s`` is presumed dead: a request that has yielded nothing yet is placed
again on another worker, transparently; one that already yielded tokens raises
``WorkerLost`` (a streamed response ends with that error event; a non-streamed choice is
re-run from scratch by ``completion.complete``). Every placement after the first uses its
own wire id (``<id>-f<n>``), so late events of the presumed-dead worker never mix in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from prometheus_client import Counter

from prefixmesh.services.edge.shortcuts import PLACE_BACKOFF_S, Shortcuts
from prefixmesh.services.edge.streams import StreamDispatcher
from prefixmesh.services.edge.workers import WorkerDirectory
from prefixmesh.shared.blocks import block_hashes
from prefixmesh.shared.bus import BatchLimits, Bus, BusUnavailable, RequestBatcher
from prefixmesh.shared.openai.schema import ApiError, refusal_error
from prefixmesh.shared.text.requests import handle, prompt_chars
from prefixmesh.shared.wire import (
    PREDICT_REPLY,
    ROUTE_REPLY,
    SUBMIT_REPLY,
    TOKENIZER_REPLY,
    AbortRequest,
    ChatMessage,
    GenerateChunkEvent,
    LengthDistribution,
    PredictLengthRequest,
    RequestDoneEvent,
    ResumeRequest,
    RouteReply,
    SamplingParams,
    SubmitBatch,
    SubmitReply,
    TokenizedRequest,
    TokenizeReply,
    TokenizeRequest,
    route_message,
    route_replies,
    routing_copy,
    submit_replies,
)

log = logging.getLogger(__name__)

TOKENIZED = Counter("prefixmesh_edge_prompts_tokenized_total",
                    "text and chat prompts tokenized, by where (edge: in place, service: by "
                    "the tokenizer service)", ["where"])
# Its two series, looked up once (``labels()`` takes a lock and builds a key each call).
TOKENIZED_HERE, TOKENIZED_BY_SERVICE = TOKENIZED.labels("edge"), TOKENIZED.labels("service")

# Seconds the client is told to wait before retrying when the mesh cannot take a request.
RETRY_AFTER_S = 1
# While waiting on a worker, its liveness is checked this often (seconds).
WATCH_TICK_S = 0.25


@dataclass(frozen=True, slots=True)
class MeshTimeouts:
    """Per-hop deadlines (seconds)."""

    tokenize_s: float = 10.0
    predict_s: float = 0.5
    route_s: float = 2.0
    # How long routing keeps retrying while no scheduler answers (standby takeover, restart),
    # first after route_backoff_s, the wait doubling up to route_backoff_max_s.
    route_retry_s: float = 8.0
    route_backoff_s: float = 0.05
    route_backoff_max_s: float = 0.5
    submit_s: float = 2.0
    request_s: float = 600.0
    # Routing attempts per request (a refused or silent worker is excluded and re-routed).
    attempts: int = 3
    # A worker whose load reports stop for this long is presumed dead and its requests
    # fail over (about 4 report intervals of 0.25 s; 0 = never fail over).
    worker_silence_s: float = 1.0


class WorkerLost(ApiError):
    """The worker of a request that already yielded tokens stopped reporting (retriable)."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(503, f"worker {worker_id} stopped responding mid-request; retry "
                         "the request", type="service_unavailable", code="worker_lost",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
        self.worker_id = worker_id


def _refusal(ack: SubmitReply) -> str | None:
    """None when the worker took the request, else why not. A request its backend cannot
    serve (a bad_request refusal) raises the client's 400 naming the option at once: every
    worker of a model runs the same backend, so routing elsewhere cannot help."""
    if ack.accepted:
        return None
    if ack.error is not None and ack.error.code == "bad_request":
        raise refusal_error(ack.error)
    return ack.error.message if ack.error else "refused"


def unavailable(what: str, exc: Exception) -> ApiError:
    return ApiError(503, f"{what} unavailable: {exc}", type="service_unavailable",
                    code="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


class MeshClient:
    """The edge's client for the tokenizer, predictor, scheduler and workers.

    As an async context manager it batches its routing requests and its placements
    (``RequestBatcher``, ``Shortcuts.route_batch``; ``max_batch`` 1 = no batching);
    outside one it sends each routing request in its own message and places nothing
    through the scheduler (route, then submit)."""

    def __init__(self, bus: Bus, edge_id: str, timeouts: MeshTimeouts, predict: bool,
                 workers: WorkerDirectory | None = None,
                 shortcuts: Shortcuts | None = None) -> None:
        self.bus = bus
        self.shortcuts = shortcuts or Shortcuts(BatchLimits(), place_max_tokens=0)
        self.edge_id = edge_id
        self.timeouts = timeouts
        self.predict = predict
        self.streams = StreamDispatcher()
        # Load reports seen on ``load.*`` (None: no failover, requests wait out their deadline).
        self.workers = workers
        # Worker silence counts from this monotonic time on at the earliest: the last time
        # this edge was itself blind (NATS down, reconnected, or its loop stalled).
        self._blind_at = time.monotonic()
        self._last_check = time.monotonic()
        self._reconnects = 0
        self.failovers = 0  # placements abandoned because their worker fell silent
        self.resumes = 0  # streams a worker was asked to resend (events possibly lost)
        self._router: RequestBatcher[TokenizedRequest, RouteReply] | None = None
        self._placer: RequestBatcher[TokenizedRequest, SubmitReply] | None = None
        # Monotonic time until which ``sched.place`` is not tried (PLACE_BACKOFF_S).
        self._place_off_until = 0.0
        self.placed = 0  # requests the scheduler handed to their worker itself
        # Where workers send this edge several of its requests' stream events at once.
        self._stream_batch = bus.subjects.stream_batch(edge_id)

    async def __aenter__(self) -> MeshClient:
        limits = self.shortcuts.route_batch
        if limits.max_batch > 1:
            router = self.bus.batcher(self.bus.subjects.route, route_message, route_replies,
                                      self.timeouts.route_s, limits)
            self._router = await router.__aenter__()
        placer = self.bus.batcher(self.bus.subjects.place, SubmitBatch, submit_replies,
                                  self._place_timeout_s, limits)
        self._placer = await placer.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        batchers, self._router, self._placer = (self._router, self._placer), None, None
        for batcher in batchers:
            if batcher is not None:
                await batcher.__aexit__(*exc)

    @property
    def _place_timeout_s(self) -> float:
        """How long a placement waits for the scheduler and then its worker."""
        return self.timeouts.route_s + self.timeouts.submit_s

    async def tokenize(self, request_id: str, text: str | None = None,
                       messages: list[ChatMessage] | None = None,
                       add_special_tokens: bool = True) -> list[int]:
        req = TokenizeRequest(request_id=request_id, text=text, messages=messages,
                              add_special_tokens=add_special_tokens)
        local = self.shortcuts.local_tokenizer
        if local is not None and prompt_chars(req) <= local.max_chars:
            reply = handle(local.tok, req)
            TOKENIZED_HERE.inc()
        else:
            try:
                reply = await self.bus.request(self.bus.subjects.tokenize, req,
                                               TOKENIZER_REPLY, self.timeouts.tokenize_s)
            except BusUnavailable as exc:
                raise unavailable("tokenizer", exc) from None
            TOKENIZED_BY_SERVICE.inc()
        if reply.error is not None:
            status = 400 if reply.error.code == "bad_request" else 500
            raise ApiError(status, reply.error.message, param="messages" if messages else "prompt")
        if not isinstance(reply, TokenizeReply):  # the subject's union: a detokenize answer
            raise ApiError(500, f"tokenizer answered with a {type(reply).__name__}")
        if not reply.token_ids:
            raise ApiError(400, "prompt tokenizes to nothing", param="prompt")
        return reply.token_ids

    async def predict_length(self, request_id: str, token_ids: list[int]
                             ) -> tuple[float, LengthDistribution | None]:
        """Predicted output tokens (0 when prediction is off or unavailable) and the
        trained model's bin distribution behind them (None from the prior).

        The prompt goes as token ids: the predictor decodes the text its encoder reads
        (docs/predictor.md, "Serving the predictor")."""
        if not self.predict:
            return 0.0, None
        req = PredictLengthRequest(request_id=request_id, prompt_tokens=len(token_ids),
                                   token_ids=token_ids)
        try:
            reply = await self.bus.request(self.bus.subjects.predict_length, req, PREDICT_REPLY,
                                           self.timeouts.predict_s)
        except BusUnavailable as exc:  # prediction is advisory: route without it
            log.debug("predictor unavailable: %s", exc)
            return 0.0, None
        if reply.error is not None:
            return 0.0, None
        return reply.predicted_tokens, reply.distribution

    async def _route(self, req: TokenizedRequest) -> str:
        """Ask the scheduler; while none answers, retry with backoff up to route_retry_s."""
        route = routing_copy(req)
        deadline = time.monotonic() + self.timeouts.route_retry_s
        backoff = self.timeouts.route_backoff_s
        while True:
            try:
                if self._router is not None:
                    reply = await self._router.request(route)
                else:
                    reply = await self.bus.request(self.bus.subjects.route, route,
                                                   ROUTE_REPLY, self.timeouts.route_s)
                break
            except BusUnavailable as exc:
                if time.monotonic() + backoff > deadline:
                    raise unavailable("scheduler", exc) from None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.timeouts.route_backoff_max_s)
        if reply.error is not None or not reply.worker_id:
            msg = reply.error.message if reply.error else "no worker chosen"
            raise unavailable("workers", RuntimeError(msg))
        return reply.worker_id

    async def _submit(self, worker_id: str, req: TokenizedRequest) -> str | None:
        """Hand the request to a worker; returns None on success, else why it failed."""
        try:
            ack = await self.bus.request(self.bus.subjects.worker_submit(worker_id), req,
                                         SUBMIT_REPLY, self.timeouts.submit_s)
        except BusUnavailable as exc:
            return str(exc)
        return _refusal(ack)

    def _judging_since(self) -> float:
        """Monotonic time from which a worker's silence counts: our own blindness (NATS
        disconnected or just reconnected, our event loop stalled) says nothing about it."""
        now = time.monotonic()
        reconnects = self.reconnects()
        # Requests in flight check every tick; a longer gap means our loop stalled (or
        # nothing was in flight: judging again from now on costs nothing then).
        stalled = now - self._last_check > self._tick() + self.timeouts.worker_silence_s / 2
        if not self.bus.connected or reconnects != self._reconnects or stalled:
            self._reconnects = reconnects
            self._blind_at = now
        self._last_check = now
        return self._blind_at

    def _tick(self) -> float:
        """Seconds between liveness checks of a request's worker."""
        silence = self.timeouts.worker_silence_s
        return min(WATCH_TICK_S, silence / 4) if silence > 0 else WATCH_TICK_S

    def _silent(self, worker_id: str, submitted_at: float) -> bool:
        """True when ``worker_id`` has not reported for ``worker_silence_s``."""
        if self.workers is None or self.timeouts.worker_silence_s <= 0:
            return False
        heard = max(self.workers.last_seen(worker_id) or 0.0, submitted_at,
                    self._judging_since())
        return time.monotonic() - heard > self.timeouts.worker_silence_s

    async def _place(self, req: TokenizedRequest, placed: str) -> str:
        """Route (or use ``placed``) and submit; a refusing worker is excluded and the
        request routed again, up to ``attempts`` times. Returns the accepting worker."""
        for _attempt in range(self.timeouts.attempts):
            if placed:
                worker_id, failure = placed, await self._submit(placed, req)
                placed = ""
            elif (self._placer is not None
                  and len(req.token_ids) <= self.shortcuts.place_max_tokens
                  and time.monotonic() >= self._place_off_until):
                worker_id, failure = await self._route_and_submit(req)
            else:
                worker_id = await self._route(req)
                failure = await self._submit(worker_id, req)
            if failure is None:
                return worker_id
            log.warning("worker %s did not take %s: %s", worker_id, req.request_id, failure)
            req.exclude.append(worker_id)
        raise unavailable("workers", RuntimeError(f"{len(req.exclude)} workers refused"))

    async def _route_and_submit(self, req: TokenizedRequest) -> tuple[str, str | None]:
        """One hop: the scheduler routes the whole request and hands it to the chosen
        worker (``sched.place``), whose SubmitReply it passes back. Returns the worker
        and, if it did not take the request, why. Unanswered (no scheduler serves the
        subject, or none answered in time), the request takes the two steps, and so do
        the next ones for ``PLACE_BACKOFF_S``."""
        assert self._placer is not None  # _place places only inside ``async with``
        try:
            ack = await self._placer.request(req)
        except BusUnavailable as exc:
            log.info("placing through the scheduler failed (%s); routing, then submitting",
                     exc)
            self._place_off_until = time.monotonic() + PLACE_BACKOFF_S
            worker_id = await self._route(req)
            return worker_id, await self._submit(worker_id, req)
        if not ack.worker_id:  # the scheduler's own answer: no worker for it
            why = ack.error.message if ack.error else "no worker chosen"
            raise unavailable("workers", RuntimeError(why))
        if not ack.accepted:
            return ack.worker_id, _refusal(ack)
        self.placed += 1
        return ack.worker_id, None

    async def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams,
                       tenant: str, batch_id: str = "", worker_id: str = "",
                       exclude: tuple[str, ...] = (), deadline: float = 0.0
                       ) -> AsyncGenerator[GenerateChunkEvent | RequestDoneEvent, None]:
        """Run one request on the mesh, yielding its chunks and then its done event.

        ``batch_id`` tags an offline batch request (the worker's ``batch_groups`` policy runs
        it below interactive traffic); ``worker_id`` is a placement decided by the batch
        planner, tried first without asking the scheduler (a refusal falls back to routing).
        ``exclude``: workers not to use (presumed dead by an earlier run of this request);
        ``deadline``: unix time the request must end by (0 = ``request_s`` from now).
        Cancelling the consumer (client disconnect) aborts the request on its worker.
        A worker that falls silent before anything was yielded is replaced transparently;
        after, ``WorkerLost`` is raised.
        """
        placed = worker_id
        deadline = deadline or time.time() + self.timeouts.request_s
        predicted, distribution = await self.predict_length(request_id, token_ids)
        hashes = block_hashes(token_ids, tenant)
        lost = list(exclude)  # workers presumed dead, never routed to again
        yielded = False
        for _placement in range(self.timeouts.attempts):
            wire_id = f"{request_id}-f{len(lost)}" if lost else request_id
            req = TokenizedRequest(
                request_id=wire_id, token_ids=token_ids, sampling=sampling,
                block_hashes=hashes, prompt_tokens=len(token_ids),
                reply_to=self.bus.subjects.stream_reply(self.edge_id, wire_id),
                tenant=tenant, predicted_output=predicted, batch_id=batch_id,
                created=time.time(), deadline=deadline, predicted_distribution=distribution,
                exclude=list(lost), done_carries_last=True,
                stream_batch_to=self._stream_batch,
            )
            queue = self.streams.open(wire_id)
            worker_id = ""
            finished = False
            try:
                worker_id = await self._place(req, placed)
                placed = ""
                submitted_at = time.monotonic()
                # Output tokens received so far; this edge's reconnect count when the
                # stream was last known complete (a later reconnect may have lost events).
                next_index, synced_at = 0, self.reconnects()
                # A resend was asked for and may still come; a done event that arrives
                # before it, short of tokens, waits for it (a tick at most, then the
                # request fails as lost).
                resend_due = waiting_resend = False
                while True:
                    remaining = deadline - time.time()
                    if remaining <= 0:
                        raise ApiError(504, "request timed out", type="timeout", code="timeout")
                    event = await queue.get(min(remaining, self._tick()))
                    gap = False
                    if isinstance(event, GenerateChunkEvent) and event.token_ids:
                        end = event.index + len(event.token_ids)
                        if end <= next_index:
                            continue  # already had it: a resend overlapping the original
                        gap = event.index != next_index
                    if gap or (event is None and synced_at != self.reconnects()):
                        # Events may be lost: a chunk is missing, or this edge reconnected
                        # (a worker that was back first published to nobody).
                        marker = self.reconnects()
                        known = await self._resume(worker_id, wire_id, next_index)
                        if known is False:  # it ended long ago or the worker restarted
                            log.warning("worker %s no longer knows %s", worker_id, wire_id)
                            if yielded:
                                raise WorkerLost(worker_id)
                            break  # nothing sent yet: place it again
                        if known:
                            synced_at, resend_due = marker, True
                            continue
                        synced_at = -1  # unanswered: ask again next tick
                        if event is not None:
                            continue  # the chunk after the gap: the resend carries it
                    if (isinstance(event, RequestDoneEvent) and resend_due
                            and next_index < event.completion_tokens):
                        # Chunks before it were lost and their resend (which ends with
                        # the done event again) is on its way: wait for it.
                        waiting_resend, resend_due = True, False
                        continue
                    if event is None and waiting_resend:
                        # The resend did not come within a tick: the tokens are lost, and
                        # the caller is told so (retriable) rather than handed a short
                        # completion that looks whole.
                        log.warning("%s: resend from token %d did not come", wire_id,
                                    next_index)
                        raise WorkerLost(worker_id)
                    if event is None:  # nothing for a tick: is the worker still alive?
                        if not self._silent(worker_id, submitted_at):
                            continue
                        self.failovers += 1
                        log.warning("worker %s went silent with %s in flight (%s)", worker_id,
                                    wire_id, "tokens sent" if yielded else "retrying elsewhere")
                        if yielded:
                            raise WorkerLost(worker_id)
                        lost.append(worker_id)
                        break
                    if isinstance(event, GenerateChunkEvent) and event.token_ids:
                        next_index = event.index + len(event.token_ids)
                    yielded = True
                    yield event
                    if isinstance(event, RequestDoneEvent):
                        finished = True
                        return
            finally:
                self.streams.close(wire_id)
                if worker_id and not finished:
                    await self._abort(worker_id, wire_id)
        raise unavailable("workers", RuntimeError(f"{len(lost)} workers went silent"))

    def reconnects(self) -> int:
        """How many times this edge's NATS connection was re-established."""
        return self.bus.nc.stats.get("reconnects", 0)

    async def _resume(self, worker_id: str, request_id: str, from_index: int) -> bool | None:
        """Ask ``worker_id`` to resend ``request_id``'s stream from output token
        ``from_index`` on (services/worker/replay.py). True: it will; False: it no longer
        knows the request; None: no answer (not reconnected yet), ask again later."""
        try:
            ack = await self.bus.request(self.bus.subjects.worker_submit(worker_id),
                                         ResumeRequest(request_id=request_id,
                                                       from_index=from_index),
                                         SUBMIT_REPLY, self.timeouts.submit_s)
        except BusUnavailable:
            return None
        self.resumes += 1
        log.warning("asked worker %s to resend %s from token %d: %s", worker_id, request_id,
                    from_index, "resending" if ack.accepted else "unknown there")
        return ack.accepted

    async def _abort(self, worker_id: str, request_id: str) -> None:
        try:
            await self.bus.publish(self.bus.subjects.worker_abort(worker_id),
                                   AbortRequest(request_id=request_id, reason="client gone"))
        except Exception as exc:  # best effort: the worker also drops streams nobody reads
            log.debug("abort of %s failed: %s", request_id, exc)
