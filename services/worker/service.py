"""Worker service: one engine replica behind its local queue, on the bus.

Subscriptions: ``worker.<id>.submit`` (request/reply: queued or refused),
``worker.<id>.abort``, ``worker.<id>.resync``. Publishes token streams to each request's
``reply_to``, KV events on ``kv.<id>`` (per-worker sequence numbers), load reports on
``load.<id>`` and completion records on ``done``.

The engine behind the shell is whatever ``--backend`` names (``engine/registry.py``: sim,
hf, vllm), all behind one interface (``engine/base.py``): the shell turns submits into
``EngineRequest``s, runs the engine's own step loop (``Engine.run``) and relays what it
emits through ``_emit`` and ``_publish_kv``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import msgspec
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Histogram

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.engine.base import Engine
from prefixmesh.services.worker.engine.registry import backend
from prefixmesh.services.worker.engine.sim_logprobs import prompt_key
from prefixmesh.services.worker.engine.types import EngineRequest, StepOutput
from prefixmesh.services.worker.local import make_local_policy
from prefixmesh.services.worker.replay import FinishedJournals, StreamJournal
from prefixmesh.services.worker.reports import done_record, load_report
from prefixmesh.shared.blocks import BLOCK_SIZE
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.runtime.lifecycle import TaskSet
from prefixmesh.shared.runtime.metrics import LATENCY_BUCKETS_S, serve_metrics
from prefixmesh.shared.subjects import Subjects
from prefixmesh.shared.text.tokenizer import IncrementalDetokenizer, TextTokenizer
from prefixmesh.shared.wire import (
    WORKER_REQUEST,
    AbortRequest,
    BlockRemoved,
    ErrorInfo,
    GenerateChunkEvent,
    KvEventBatch,
    RequestDoneBatch,
    RequestDoneEvent,
    ResumeRequest,
    ResyncRequest,
    StreamBatch,
    SubmitBatch,
    SubmitReplies,
    SubmitReply,
    TokenizedRequest,
    TokenLogprob,
    WorkerRequest,
)

log = logging.getLogger(__name__)

STEPS = Counter("prefixmesh_worker_steps_total", "engine steps", ["worker"])
STEP_TIME = Histogram("prefixmesh_worker_step_seconds", "engine step duration", ["worker"],
                      buckets=LATENCY_BUCKETS_S)
FINISHED = Counter("prefixmesh_worker_requests_total", "requests finished by reason",
                   ["worker", "reason"])
REFUSED = Counter("prefixmesh_worker_errors_total", "submits refused, by error code",
                  ["worker", "code"])
LATENCY = Histogram("prefixmesh_worker_request_latency_seconds",
                    "arrival at the worker to last token", ["worker"], buckets=LATENCY_BUCKETS_S)
QUEUE_TIME = Histogram("prefixmesh_worker_queue_seconds", "time a request waited to start",
                       ["worker"], buckets=LATENCY_BUCKETS_S)
ARRIVAL_DELAY = Histogram("prefixmesh_worker_arrival_delay_seconds",
                          "the mesh's path before the engine: from the edge sending a request "
                          "(TokenizedRequest.created) to its arrival here (across hosts, with "
                          "their clocks' offset)", ["worker"], buckets=LATENCY_BUCKETS_S)
# KV blocks the engine evicted (BlockRemoved events): zero until the prefix cache is full.
KV_EVICTED = Counter("prefixmesh_worker_kv_blocks_evicted_total",
                     "KV cache blocks evicted (BlockRemoved events published)", ["worker"])
# Running requests preempted (by the local policy, or for KV memory), recomputed on resume.
PREEMPTIONS = Counter("prefixmesh_worker_preemptions_total",
                      "running requests preempted (resumed later by recompute)", ["worker"])
RESUMES = Counter("prefixmesh_worker_stream_resumes_total",
                  "streams resent on an edge's ResumeRequest", ["worker"])
# Drain polls the engine this often (seconds).
DRAIN_POLL_S = 0.02
# Starts an extra way into a running worker (its HTTP API) on the worker's exit stack.
Front = Callable[[AsyncExitStack, "WorkerService"], Awaitable[None]]


@dataclass(slots=True)
class _Live:
    """Per-request state the shell keeps beside the engine's."""

    reply_to: str
    tenant: str
    # None when the engine sends text itself (vllm detokenizes with the model's tokenizer).
    detok: IncrementalDetokenizer | None
    # An in-process caller (the HTTP front, services/worker/http.py) gets the request's
    # chunk and done events on this queue instead of on ``reply_to``.
    sink: asyncio.Queue | None = None
    # TokenizedRequest.deadline: unix seconds after which the request is dropped (0 = none).
    deadline: float = 0.0
    # What the stream carried over NATS, for a ResumeRequest (replay.py); None with a sink.
    journal: StreamJournal | None = None
    # The edge reads a last chunk inside the done event (TokenizedRequest.done_carries_last).
    fold_last: bool = False
    # The edge's subject for its requests' events together (TokenizedRequest.stream_batch_to).
    batch_to: str = ""


def sample_key(req: TokenizedRequest) -> str:
    """Key of a request's deterministic sim output: greedy and seeded requests repeat
    themselves on the same prompt (as a real engine would); others vary by request id."""
    s = req.sampling
    if s.temperature == 0.0:
        return f"greedy:{prompt_key(req.token_ids)}"
    if s.seed is not None:
        return f"seed:{s.seed}:{prompt_key(req.token_ids)}"
    return req.request_id


def sample_output_len(request_id: str, mean: float, max_tokens: int) -> int:
    """Output length of a request that carries no hint: exponential around ``mean``,
    deterministic per request id, clamped to [1, max_tokens]."""
    u = (zlib.crc32(request_id.encode()) + 0.5) / 2**32  # uniform in (0, 1)
    return max(1, min(max_tokens, round(-mean * math.log(u))))


class WorkerService:
    name = "worker"

    def __init__(self, cfg: WorkerConfig, front: Front | None = None) -> None:
        self._backend = backend(cfg.backend)
        if cfg.time_scale != 1.0 and cfg.backend != "sim":
            raise SystemExit("--time-scale applies to the sim backend only")
        if cfg.probe_model and cfg.backend != "hf":
            raise SystemExit("--probe-model needs --backend hf (the probe reads its hidden "
                             "states)")
        self.cfg = cfg
        # An extra way in, started once the engine runs (the HTTP API: worker/http.py).
        self.front = front
        self.worker_id = cfg.resolved_worker_id()
        self._arrival_delay = ARRIVAL_DELAY.labels(self.worker_id)
        self.cost = CostModel.load(cfg.profile)
        # Name and context length of the served model (shared/models.py).
        self.model = cfg.served_model()
        self._engine: Engine | None = None  # opened by start(): see ``engine``
        # This engine instance, new at every start: the scheduler tells a restart by it.
        self.engine_id = ""
        self.bus: Bus | None = None  # None without the mesh (HTTP-only worker)
        self.live: dict[str, _Live] = {}
        self.kv_seq = 0
        self._preemptions = 0  # the engine's count when PREEMPTIONS was last brought level
        self._subs: list[Subscription] = []
        self._accepting = True
        # Streams of requests that ended lately, for a late ResumeRequest (replay.py).
        self.finished = FinishedJournals()
        # Stream events (per edge subject) and completion records not yet published
        # (_flush_loop sends them).
        self._stream_out: dict[str, list[GenerateChunkEvent | RequestDoneEvent]] = {}
        self._done_out: list[RequestDoneEvent] = []
        self._flush_ready = asyncio.Event()

    # ------------------------------------------------------------------ intake

    def _output_len(self, req: TokenizedRequest) -> int:
        s = req.sampling
        if s.ignore_eos:
            return s.max_tokens
        if s.output_len_hint > 0:
            return min(s.output_len_hint, s.max_tokens)
        return sample_output_len(sample_key(req), self.cfg.default_output_mean, s.max_tokens)

    async def _on_request(self, msg: WorkerRequest) -> SubmitReply | SubmitReplies:
        if isinstance(msg, TokenizedRequest):
            return self._submit(msg)
        if isinstance(msg, SubmitBatch):  # the scheduler's share of an edge's placements
            return SubmitReplies(replies=[self._submit(r) for r in msg.requests])
        if isinstance(msg, ResumeRequest):
            return await self._resume(msg)
        if isinstance(msg, AbortRequest):
            self._abort(msg.request_id)
        elif isinstance(msg, ResyncRequest):
            await self._resync()
        return SubmitReply(request_id=getattr(msg, "request_id", ""), worker_id=self.worker_id)

    def submit_local(self, req: TokenizedRequest, sink: asyncio.Queue) -> SubmitReply:
        """Queue a request from an in-process caller; its GenerateChunkEvent and
        RequestDoneEvent messages are put on ``sink`` (``req.reply_to`` is unused)."""
        return self._submit(req, sink)

    @property
    def engine(self) -> Engine:
        """The backend's engine, opened by start() before any request can reach us."""
        assert self._engine is not None, "worker used before start()"
        return self._engine

    def _mesh(self) -> Bus:
        """The NATS connection, on paths that only mesh traffic reaches (requests that
        came over the bus, their replays); a worker without the mesh never takes them."""
        assert self.bus is not None, "mesh path taken by a worker without the mesh"
        return self.bus

    @property
    def tok(self) -> TextTokenizer | None:
        """The served model's tokenizer (None: the engine takes token ids only)."""
        return self._engine.tokenizer if self._engine is not None else None

    def reset_cache(self) -> bool:
        """Drop the engine's prefix cache (False while requests run, as vLLM and SGLang
        refuse, or when the backend cannot); the AllBlocksCleared event reaches the
        scheduler with the engine's next KV events."""
        return not self.live and self.engine.reset_cache()

    @property
    def accepting(self) -> bool:
        """False once shutdown has begun."""
        return self._accepting

    def _submit(self, req: TokenizedRequest, sink: asyncio.Queue | None = None) -> SubmitReply:
        def refuse(why: str, code: str) -> SubmitReply:
            REFUSED.labels(self.worker_id, code).inc()
            return SubmitReply(request_id=req.request_id, worker_id=self.worker_id,
                               accepted=False, error=ErrorInfo(why, code, retriable=True))

        if not self._accepting:
            return refuse("worker is shutting down", "unavailable")
        if len(self.live) >= self.cfg.max_requests:
            return refuse(f"worker queue full ({self.cfg.max_requests})", "overloaded")
        if req.request_id in self.live:  # a retried submit of a request we already run
            return SubmitReply(request_id=req.request_id, worker_id=self.worker_id)
        now = time.time()
        if req.deadline and now >= req.deadline:
            return refuse("request deadline already passed", "timeout")
        if req.created > 0 and sink is None:  # sent over the bus by an edge
            self._arrival_delay.observe(max(now - req.created, 0.0))
        try:
            ereq = EngineRequest(
                request_id=req.request_id, prompt_token_ids=req.token_ids,
                max_tokens=req.sampling.max_tokens, output_len=self._output_len(req),
                tenant=req.tenant, predicted_output=req.predicted_output, batch_id=req.batch_id,
                sample_key=sample_key(req), predicted_distribution=req.predicted_distribution,
                # The edge's hashes, when they are over the engine's blocks (a copy: the
                # engine extends the chain over generated tokens).
                block_hashes=list(req.block_hashes)
                if self.engine.block_size == BLOCK_SIZE else [],
            )
            self.engine.add(ereq, self.engine.now(), req.sampling)
        except ValueError as exc:  # BadOption names the option at fault
            REFUSED.labels(self.worker_id, "bad_request").inc()
            return SubmitReply(request_id=req.request_id, worker_id=self.worker_id,
                               accepted=False, error=ErrorInfo(
                                   str(exc), "bad_request", param=getattr(exc, "param", "")))
        tok = self.engine.tokenizer
        detok = None if self.engine.detokenizes or tok is None else IncrementalDetokenizer(tok)
        self.live[req.request_id] = _Live(
            req.reply_to, req.tenant, detok, sink, deadline=req.deadline,
            journal=StreamJournal(req.reply_to) if sink is None else None,
            fold_last=req.done_carries_last, batch_to=req.stream_batch_to)
        return SubmitReply(request_id=req.request_id, worker_id=self.worker_id)

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request (its caller went away); frees its KV blocks."""
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.engine.abort(request_id, self.engine.now())
            FINISHED.labels(self.worker_id, "abort").inc()

    async def _expire(self, now: float) -> None:
        """Drop requests past their deadline (the edge has answered 504 by now), each with
        an error done event, so a queue backed up by overload sheds work nobody awaits."""
        expired = [(rid, live) for rid, live in self.live.items()
                   if live.deadline and now >= live.deadline]
        for rid, live in expired:
            del self.live[rid]
            self.engine.abort(rid, self.engine.now())
            FINISHED.labels(self.worker_id, "deadline").inc()
            try:
                await self._deliver(live, RequestDoneEvent(
                    request_id=rid, worker_id=self.worker_id, finish_reason="error",
                    error=ErrorInfo("request deadline exceeded", "timeout", retriable=True)))
            except Exception as exc:  # best effort: NATS may be down
                log.debug("deadline notice for %s not sent: %s", rid, exc)
        if expired:
            log.warning("dropped %d requests past their deadline", len(expired))

    async def _resync(self) -> None:
        """Re-send the whole cache state (the scheduler saw a sequence gap)."""
        await self._publish_kv(self.engine.snapshot_events())

    # ------------------------------------------------------------------ engine loop

    async def _publish_kv(self, events: list) -> None:
        if not events or self.bus is None:  # HTTP-only worker: nobody consumes KV events
            return
        removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        if removed:
            KV_EVICTED.labels(self.worker_id).inc(removed)
        self.kv_seq += 1
        await self.bus.publish(self.bus.subjects.kv(self.worker_id), KvEventBatch(
            worker_id=self.worker_id, seq=self.kv_seq, ts=time.time(), events=events,
            engine_id=self.engine_id))

    async def _deliver(self, live: _Live, event: GenerateChunkEvent | RequestDoneEvent,
                       last: GenerateChunkEvent | None = None) -> None:
        """Send ``event`` to the request's caller; ``last``, the final chunk of a done
        ``event``, goes before it (over the bus inside it: ``RequestDoneEvent.last``)."""
        if live.journal is not None:
            if last is not None:
                live.journal.record(last)
            live.journal.record(event)
            if isinstance(event, RequestDoneEvent):
                self.finished.add(event.request_id, live.journal)
        if live.sink is not None:
            if last is not None:
                live.sink.put_nowait(last)
            live.sink.put_nowait(event)
        else:  # no sink: the request came over the bus
            if last is not None and live.fold_last and isinstance(event, RequestDoneEvent):
                event, last = msgspec.structs.replace(event, last=last), None
            if live.batch_to:  # sent by _flush_loop, with the edge's other events
                out = self._stream_out.setdefault(live.batch_to, [])
                out.extend((event,) if last is None else (last, event))
                self._flush_ready.set()
                return
            bus = self._mesh()
            if last is not None:
                await bus.publish(live.reply_to, last)
            await bus.publish(live.reply_to, event)

    async def _resume(self, msg: ResumeRequest) -> SubmitReply:
        """Resend a stream from ``msg.from_index`` on (replay.py); refused when unknown."""
        live = self.live.get(msg.request_id)
        journal = live.journal if live is not None else self.finished.get(msg.request_id)
        if journal is None:
            return SubmitReply(request_id=msg.request_id, worker_id=self.worker_id,
                               accepted=False, error=ErrorInfo(
                                   f"worker {self.worker_id} does not know request "
                                   f"{msg.request_id}", "not_found", retriable=True))
        bus = self._mesh()
        for event in journal.replay(msg.request_id, msg.from_index):
            await bus.publish(journal.reply_to, event)
        RESUMES.labels(self.worker_id).inc()
        return SubmitReply(request_id=msg.request_id, worker_id=self.worker_id)

    async def _emit(self, out: StepOutput, text: str = "",
                    logprobs: list[TokenLogprob] | None = None) -> None:
        """Stream a step's tokens to the request's caller; on its last step, the done
        message and the completion record. ``text``: the engine's own detokenization."""
        live = self.live.get(out.request_id)
        if live is None:
            return
        chunk = None
        if out.new_token_ids:
            index = out.request.num_output_tokens - len(out.new_token_ids)
            token_ids = out.new_token_ids
            if live.detok is not None:
                text = live.detok.step(token_ids)
                if out.finished:
                    text += live.detok.flush()
            chunk = GenerateChunkEvent(
                request_id=out.request_id, token_ids=token_ids, text=text, index=index,
                logprobs=logprobs or [], cached_tokens=max(out.num_cached_tokens, 0))
        if not out.finished:
            if chunk is not None:
                await self._deliver(live, chunk)
            return
        del self.live[out.request_id]
        # The caller gets the done event with the last chunk in it; the same record,
        # without it, goes to the scheduler and metrics.
        done = done_record(self.worker_id, out.request, out.finish_reason or "length",
                           live.tenant, self.model.simulated)
        await self._deliver(live, done, chunk)
        if self.bus is not None:  # sent by _flush_loop, with the step's others
            self._done_out.append(done)
            self._flush_ready.set()
        FINISHED.labels(self.worker_id, done.finish_reason).inc()
        LATENCY.labels(self.worker_id).observe(done.latency_s)
        QUEUE_TIME.labels(self.worker_id).observe(done.queue_s)

    def _on_step(self, seconds: float) -> None:
        STEPS.labels(self.worker_id).inc()
        STEP_TIME.labels(self.worker_id).observe(seconds)

    async def _flush_loop(self, bus: Bus) -> None:
        """Publish what the engine's outputs left queued once it yields, those of one step
        together: each edge's stream events in one message (``StreamBatch``), then the
        completion records on ``done`` in one (the edge, the scheduler and metrics read one
        message a step, not one a request)."""
        while True:
            await self._flush_ready.wait()
            self._flush_ready.clear()
            streams, self._stream_out = self._stream_out, {}
            batch, self._done_out = self._done_out, []
            out: list[tuple[str, msgspec.Struct]] = [
                (subject, events[0] if len(events) == 1 else StreamBatch(events=events))
                for subject, events in streams.items()]
            if batch:
                out.append((bus.subjects.done, batch[0] if len(batch) == 1
                            else RequestDoneBatch(events=batch)))
            # One message failing (NATS gone past its buffer) loses only its own events:
            # its edge resumes, as for any lost event (replay.py), and the scheduler's window
            # ages requests whose records were lost; the other messages still go.
            for subject, msg in out:
                try:
                    await bus.publish(subject, msg)
                except Exception as exc:
                    log.warning("could not publish a step's events on %s: %s", subject, exc)

    async def _load_loop(self, bus: Bus) -> None:
        while True:
            await self._expire(time.time())
            stats = self.engine.stats(self.engine.now())
            PREEMPTIONS.labels(self.worker_id).inc(stats.preemptions - self._preemptions)
            self._preemptions = stats.preemptions
            report = load_report(self.worker_id, stats, time.time(), self.cfg.backend,
                                 self.model.name, self.kv_seq, self.cfg.profile,
                                 self.engine_id)
            await bus.publish(bus.subjects.load(self.worker_id), report)
            await asyncio.sleep(self.cfg.load_interval_s)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        policy = make_local_policy(self.cfg.local_policy, self.cfg.local_policy_config())
        self._engine = engine = await self._backend.open_engine(self.cfg, self.cost, policy)
        self.engine_id = uuid.uuid4().hex[:16]
        stack.callback(engine.close)  # after the engine task is cancelled (LIFO)
        if self.cfg.mesh:  # before the tasks, so the bus closes after they are cancelled
            self.bus = await Bus.connect(self.cfg.nats_url, Subjects(self.cfg.subject_prefix),
                                         f"worker-{self.worker_id}")
            stack.push_async_callback(self.bus.close)
        await serve_metrics(stack, self.cfg.metrics_port)
        tasks = await stack.enter_async_context(TaskSet(on_crash=lambda _e: stop.set()))
        if self.bus is not None:
            await self._serve_bus(self.bus, tasks)
        tasks.spawn(self.engine.run(self._emit, self._publish_kv, self._on_step),
                     f"worker-{self.worker_id}-engine")
        if self.front is not None:
            await self.front(stack, self)
        log.info("worker %s ready (%s, %s, %s, %d KV blocks)", self.worker_id, self.cfg.backend,
                 self.model.name,
                 self.cfg.local_policy, self.engine.num_blocks)

    async def _serve_bus(self, bus: Bus, tasks: TaskSet) -> None:
        """Serve this worker's subjects on the mesh and publish its load reports."""
        s = bus.subjects
        for subject in (s.worker_submit(self.worker_id), s.worker_abort(self.worker_id),
                        s.worker_resync(self.worker_id)):
            self._subs.append(await bus.serve(
                subject, WORKER_REQUEST, self._on_request,
                lambda why: SubmitReply(request_id="", worker_id=self.worker_id, accepted=False,
                                        error=ErrorInfo(why, "bad_request"))))
        tasks.spawn(self._load_loop(bus), f"worker-{self.worker_id}-load")
        tasks.spawn(self._flush_loop(bus), f"worker-{self.worker_id}-flush")

    async def stop_intake(self) -> None:
        self._accepting = False
        if self.bus is None:
            return
        submit = self.bus.subjects.worker_submit(self.worker_id)
        for sub in list(self._subs):
            if sub.subject == submit:
                await sub.unsubscribe()
                self._subs.remove(sub)

    async def drain(self) -> None:
        while self.live or self._done_out or self._stream_out:
            await asyncio.sleep(DRAIN_POLL_S)
