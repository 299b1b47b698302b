"""Runs stored batches through the mesh: plan (BatchLLM), dispatch per worker, record.

One ``BatchRunner`` per edge. A batch goes ``validating -> in_progress -> finalizing ->
completed`` (or ``failed`` at validation, ``cancelling -> cancelled``). Its lines are
tokenized, planned as a whole (``batch_plan``: enlarged first-level prefix groups,
ordered and placed on the live workers by estimated GPU work) and submitted group by group
to their planned worker, tagged with the batch id so the worker's ``batch_groups`` policy
runs them below interactive traffic. Each worker gets at most ``inflight_per_worker``
lines at a time: enough for its local policy to form groups and batches, few enough that a
shutdown drains quickly.

Durability and exactly-once results: every line's outcome is recorded with a KV
``create`` keyed by (batch, line) (``BatchStore.record_line``) and lines with a record are
never submitted again. On start the runner resumes every batch not in a terminal state.
A graceful stop (SIGTERM) stops dispatching and lets in-flight lines finish and record,
so a restart runs no line twice; after a crash the lines that were in flight (no record
yet) run again, and their second result is the only one recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from prefixmesh.services.edge.batch_format import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    TERMINAL,
    BatchLine,
    BatchRecord,
    FileRecord,
    LineResult,
    RequestCounts,
    error_result,
    new_id,
    output_line,
    parse_lines,
)
from prefixmesh.services.edge.batch_plan import plan_batch
from prefixmesh.services.edge.batch_store import BatchStore
from prefixmesh.services.edge.completion import complete, token_prompts
from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.pipeline import MeshClient
from prefixmesh.services.edge.workers import WorkerDirectory
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.openai.schema import (
    ApiError,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from prefixmesh.shared.runtime.lifecycle import TaskSet
from prefixmesh.shared.wire import BatchProgressEvent

log = logging.getLogger(__name__)

BATCH_LINES = Counter("prefixmesh_batch_lines_total", "batch lines finished, by outcome",
                      ["outcome"])
BATCH_ACTIVE = Gauge("prefixmesh_batch_active", "batches this edge is running")
BATCH_PENDING = Gauge("prefixmesh_batch_pending_lines", "batch lines not yet finished")


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """The runner's knobs (from EdgeConfig)."""

    inflight_per_worker: int
    progress_interval_s: float
    profile: str

    @classmethod
    def from_config(cls, cfg: EdgeConfig) -> RunnerSettings:
        return cls(cfg.batch_inflight_per_worker, cfg.batch_progress_interval_s,
                   cfg.batch_profile)


# Attempts per line when the mesh answers 503 (no worker, worker error, tokenizer not up
# yet after a restart); then the line fails. Waits double from RETRY_WAIT_S between them.
LINE_ATTEMPTS = 6
# Seconds before the first retry of a line, and between polls for a live worker.
RETRY_WAIT_S = 0.5
# Seconds to wait for any worker to report before planning without placement.
WORKER_WAIT_S = 10.0
# Lines tokenized concurrently.
TOKENIZE_CONCURRENCY = 32


class _Job:
    """A batch being run: its record, counts and the tasks running its lines."""

    def __init__(self, rec: BatchRecord) -> None:
        self.rec = rec
        self.cancel = asyncio.Event()
        self.last_saved = 0.0
        # Lines counted in BATCH_PENDING and not recorded yet.
        self.unrecorded = 0


class BatchRunner:
    """Resumes, plans and runs batches; ``submit`` / ``cancel`` come from the HTTP API."""

    def __init__(self, store: BatchStore, mesh: MeshClient, cfg: EdgeConfig,
                 workers: WorkerDirectory) -> None:
        self.store = store
        self.mesh = mesh
        self.cfg = cfg
        self.settings = RunnerSettings.from_config(cfg)
        self.cost = CostModel.load(self.settings.profile)
        self.workers = workers
        self.tasks = TaskSet()
        self._jobs: dict[str, _Job] = {}
        self._intake = True
        self._inflight = 0

    # ------------------------------------------------------------------ control

    async def resume_all(self) -> None:
        """Start every stored batch that is not finished (after a restart)."""
        for rec in await self.store.list_batches():
            if rec.status not in TERMINAL:
                log.info("resuming batch %s (%s)", rec.id, rec.status)
                self.submit(rec)

    def submit(self, rec: BatchRecord) -> None:
        """Run ``rec`` in the background (no-op when it is already running here)."""
        if rec.id in self._jobs or not self._intake:
            return
        job = self._jobs[rec.id] = _Job(rec)
        BATCH_ACTIVE.inc()
        self.tasks.spawn(self._run(job), name=f"batch-{rec.id}")

    async def cancel(self, rec: BatchRecord) -> BatchRecord:
        """Move a batch to ``cancelling``; its runner aborts in-flight lines and finalizes."""
        job = self._jobs.get(rec.id)
        if job is not None:
            rec = job.rec
        if rec.status in TERMINAL or rec.status == CANCELLING:
            return rec
        rec.status, rec.cancelling_at = CANCELLING, int(time.time())
        await self._save(rec)
        if job is not None:
            job.cancel.set()
        else:
            self.submit(rec)  # not running here (e.g. still queued): finalize it
        return rec

    def record_of(self, batch_id: str) -> BatchRecord | None:
        """The live record of a batch running here (fresher counts than the store's)."""
        job = self._jobs.get(batch_id)
        return job.rec if job is not None else None

    def stop_intake(self) -> None:
        """Stop submitting lines; lines in flight finish and are recorded."""
        self._intake = False

    @property
    def inflight(self) -> int:
        return self._inflight

    async def aclose(self) -> None:
        await self.tasks.aclose()

    # ------------------------------------------------------------------ one batch

    async def _run(self, job: _Job) -> None:
        try:
            await self._run_batch(job)
        finally:
            self._jobs.pop(job.rec.id, None)
            BATCH_ACTIVE.dec()

    async def _run_batch(self, job: _Job) -> None:
        rec = job.rec
        data = await self.store.file_content(rec.input_file_id)
        lines, errors = parse_lines(data, rec.endpoint)
        if errors:
            rec.status, rec.failed_at = FAILED, int(time.time())
            rec.errors = [{"code": e.code, "message": e.message, "line": e.line,
                           "param": e.param} for e in errors[:100]]
            await self._save(rec)
            return
        done = await self.store.line_results(rec.id)
        self._recount(rec, len(lines), done)
        if rec.status not in (CANCELLING, FINALIZING):
            if rec.status != IN_PROGRESS:
                rec.status, rec.in_progress_at = IN_PROGRESS, int(time.time())
            await self._save(rec)
            pending = [i for i in range(len(lines)) if i not in done]
            job.unrecorded = len(pending)
            BATCH_PENDING.inc(len(pending))
            try:
                await self._execute(job, lines, pending)
            finally:
                BATCH_PENDING.dec(job.unrecorded)
        if not self._intake:
            await self._save(rec)  # shutting down: resume later from here
            return
        await self._finalize(rec, lines, await self.store.line_results(rec.id))

    def _recount(self, rec: BatchRecord, total: int, done: dict[int, LineResult]) -> None:
        ok = sum(1 for r in done.values() if r.ok)
        rec.request_counts = RequestCounts(total=total, completed=ok, failed=len(done) - ok)

    async def _execute(self, job: _Job, lines: Sequence[BatchLine], pending: list[int]
                       ) -> None:
        """Parse and tokenize pending lines, plan them, run them worker by worker."""
        rec = job.rec
        parsed: dict[int, tuple[ParsedRequest, list[list[int]]]] = {}
        sem = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

        async def prepare(i: int) -> None:
            async with sem:
                rid = f"{rec.id}-{i}"
                wait = RETRY_WAIT_S
                for attempt in range(LINE_ATTEMPTS):
                    try:
                        p = self._parse(lines[i])
                        parsed[i] = (p, await self._tokens(rid, p))
                        return
                    except ApiError as err:
                        if err.status != 503 or attempt == LINE_ATTEMPTS - 1:
                            await self._record(job, i, error_result(lines[i].custom_id, rid,
                                                                    err))
                            return
                    if not self._intake:
                        return
                    await asyncio.sleep(wait)
                    wait *= 2

        await asyncio.gather(*(prepare(i) for i in pending))
        order = sorted(parsed)
        if not order:
            return
        workers = await self._live_workers()
        prompts = [parsed[i][1][0] for i in order]
        outputs = [parsed[i][0].sampling.max_tokens for i in order]
        if workers:
            plan = plan_batch(prompts, outputs, workers, self.cost)
            rec.plan = plan.summary()
            queues = {w: [order[k] for g in gs for k in g.members]
                      for w, gs in plan.placement.groups.items()}
        else:  # nobody reporting: let the scheduler route each line
            queues = {"": order}
        await self._save(rec)
        async with asyncio.TaskGroup() as tg:
            for w, idx in queues.items():
                tg.create_task(self._worker_loop(job, w, idx, lines, parsed))

    async def _worker_loop(self, job: _Job, worker: str, idx: list[int],
                           lines: Sequence[BatchLine],
                           parsed: dict[int, tuple[ParsedRequest, list[list[int]]]]) -> None:
        """Submit one worker's lines in plan order, at most ``inflight_per_worker`` at once."""
        sem = asyncio.Semaphore(self.settings.inflight_per_worker)
        async with asyncio.TaskGroup() as tg:
            for i in idx:
                await sem.acquire()
                if job.cancel.is_set() or not self._intake:
                    sem.release()
                    break
                tg.create_task(self._line(job, worker, i, lines[i], parsed[i], sem))
            # Leaving the group waits for in-flight lines; a cancel aborts them (see _line).

    async def _line(self, job: _Job, worker: str, i: int, line: BatchLine,
                    prepared: tuple[ParsedRequest, list[list[int]]],
                    sem: asyncio.Semaphore) -> None:
        rid = f"{job.rec.id}-{i}"
        p, prompts = prepared
        self._inflight += 1
        wait = RETRY_WAIT_S
        try:
            for attempt in range(LINE_ATTEMPTS):
                run = asyncio.ensure_future(self._complete(p, rid, prompts, job.rec.id, worker))
                stop = asyncio.ensure_future(job.cancel.wait())
                await asyncio.wait({run, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if not run.done():  # cancelled: abort on the worker, record nothing
                    run.cancel()
                    await asyncio.gather(run, return_exceptions=True)
                    return
                err = run.exception()
                if err is None:
                    await self._record(job, i, LineResult(line.custom_id, 200, rid,
                                                          run.result()))
                    return
                if not isinstance(err, ApiError):
                    log.error("batch line %s failed", rid, exc_info=err)
                    err = ApiError(500, "internal error", type="internal_error")
                if err.status != 503 or attempt == LINE_ATTEMPTS - 1 or not self._intake:
                    if err.status == 503 and not self._intake:
                        return  # shutting down: leave it for the resumed run
                    await self._record(job, i, error_result(line.custom_id, rid, err))
                    return
                worker = ""  # the planned worker failed: let the scheduler route it
                await asyncio.sleep(wait)
                wait *= 2
        finally:
            self._inflight -= 1
            sem.release()

    async def _complete(self, p: ParsedRequest, rid: str, prompts: list[list[int]],
                        batch_id: str, worker: str) -> dict:
        body, _usage = await complete(self.mesh, self.cfg, p, rid, prompts,
                                      batch_id=batch_id, worker_id=worker)
        return body

    async def _record(self, job: _Job, i: int, result: LineResult) -> None:
        if not await self.store.record_line(job.rec.id, i, result):
            return  # recorded already (another runner, or before a restart)
        counts = job.rec.request_counts
        if result.ok:
            counts.completed += 1
            BATCH_LINES.labels("completed").inc()
        else:
            counts.failed += 1
            BATCH_LINES.labels("failed").inc()
        BATCH_PENDING.dec()
        job.unrecorded -= 1
        now = time.monotonic()
        if now - job.last_saved >= self.settings.progress_interval_s:
            job.last_saved = now
            if job.rec.status == IN_PROGRESS:  # never overwrite a cancel from the API
                await self._save(job.rec)

    # ------------------------------------------------------------------ helpers

    async def _save(self, rec: BatchRecord) -> None:
        """Persist the record, then tell the metrics service (best effort) how far it is."""
        await self.store.put_batch(rec)
        c = rec.request_counts
        try:
            await self.mesh.bus.publish(self.mesh.bus.subjects.batch_progress, BatchProgressEvent(
                batch_id=rec.id, status=rec.status, total=c.total, completed=c.completed,
                failed=c.failed, ts=time.time()))
        except Exception as exc:  # noqa: BLE001 - progress display must not stop a batch
            log.debug("batch progress publish failed: %s", exc)

    def _parse(self, line: BatchLine) -> ParsedRequest:
        body = json.dumps(line.body).encode()
        if line.url == "/v1/chat/completions":
            return parse_chat(body, self.cfg.context_lengths, self.cfg.max_tokens_limit)
        return parse_completion(body, self.cfg.context_lengths, self.cfg.vocab_size,
                                self.cfg.max_tokens_limit)

    async def _tokens(self, rid: str, p: ParsedRequest) -> list[list[int]]:
        return await token_prompts(self.mesh, rid, p)

    async def _live_workers(self) -> list[str]:
        deadline = time.monotonic() + WORKER_WAIT_S
        while True:
            live = self.workers.live()
            if live or time.monotonic() > deadline:
                return live
            await asyncio.sleep(RETRY_WAIT_S)

    async def _finalize(self, rec: BatchRecord, lines: Sequence[BatchLine],
                        done: dict[int, LineResult]) -> None:
        """Write the output and error files and close the batch."""
        self._recount(rec, len(lines), done)
        cancelling = rec.status == CANCELLING or (
            (stored := await self.store.get_batch(rec.id)) is not None
            and stored.status == CANCELLING)
        if not cancelling:
            rec.status, rec.finalizing_at = FINALIZING, int(time.time())
            await self._save(rec)
        out = [output_line(done[i]) for i in sorted(done) if done[i].ok]
        err = [output_line(done[i]) for i in sorted(done) if not done[i].ok]
        now = int(time.time())
        if out:
            rec.output_file_id = await self._put_output(rec.id, "output", out, now)
        if err:
            rec.error_file_id = await self._put_output(rec.id, "error", err, now)
        if cancelling:
            rec.status, rec.cancelled_at = CANCELLED, now
        else:
            rec.status, rec.completed_at = COMPLETED, now
        await self._save(rec)
        log.info("batch %s %s: %s", rec.id, rec.status, rec.request_counts)

    async def _put_output(self, batch_id: str, kind: str, rows: list[bytes], now: int) -> str:
        data = b"\n".join(rows) + b"\n"
        fid = new_id("file")
        await self.store.put_file(FileRecord(fid, len(data), now, f"{batch_id}_{kind}.jsonl",
                                             "batch_output"), data)
        return fid
