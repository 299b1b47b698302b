"""Predictor service: answers ``predict.length`` in the ``predictor`` queue group.

Two sources: a trained artifact (``--model-dir``: MiniLM + head over TRAIL's length bins,
``serving.ModelPredictor``) for requests that carry their prompt's ``token_ids``, and the
workload prior (``prior.LengthPrior``) for everything else, or for every request when no
artifact is configured. Requests are answered in micro-batches (``batching.py``): the
concurrent ones share one encoder forward pass, which runs on the service's own
one-thread executor so the event loop never blocks. torch is imported only when an
artifact is configured.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram

from prefixmesh.services.predictor.batching import BatchServer
from prefixmesh.services.predictor.prior import DEFAULT_TABLE, LengthPrior
from prefixmesh.services.predictor.serving import check_token_ids
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.runtime.config import CommonConfig, option
from prefixmesh.shared.runtime.lifecycle import TaskSet
from prefixmesh.shared.runtime.metrics import LATENCY_BUCKETS_S, serve_metrics
from prefixmesh.shared.subjects import PREDICTOR_GROUP, Subjects
from prefixmesh.shared.wire import (
    PREDICT_REQUEST,
    ErrorInfo,
    LengthDistribution,
    PredictLengthReply,
    PredictLengthRequest,
)

if TYPE_CHECKING:
    from prefixmesh.services.predictor.serving import ModelPredictor

REQUESTS = Counter("prefixmesh_predictor_requests_total", "predictions by outcome", ["outcome"])
ERRORS = Counter("prefixmesh_predictor_errors_total", "requests answered with an error, by code",
                 ["code"])
LATENCY = Histogram("prefixmesh_predictor_request_latency_seconds",
                    "time to answer one batch of requests", buckets=LATENCY_BUCKETS_S)
BATCH = Histogram("prefixmesh_predictor_batch_size", "requests answered per batch",
                  buckets=(1, 2, 4, 8, 16, 32, 64, 128))

# TRAIL's measured case: 32 prompts per batch; a pass over more grows latency linearly.
DEFAULT_MAX_BATCH = 32
# How long an idle predictor lets a batch's first request wait for others (milliseconds).
DEFAULT_BATCH_WAIT_MS = 2.0


@dataclass(frozen=True)
class PredictorConfig(CommonConfig):
    length_prior: str = option(DEFAULT_TABLE, "mean output tokens per workload: name=n,...")
    model_dir: str = option("", "trained predictor artifact folder (prefixmesh predictor "
                            "train --out); empty = answer from the length prior only")
    max_batch: int = option(DEFAULT_MAX_BATCH, "requests per encoder forward pass at most")
    batch_wait_ms: float = option(DEFAULT_BATCH_WAIT_MS, "how long a batch's first request "
                                  "waits for more to join it (milliseconds)")
    threads: int = option(1, "torch threads of the encoder (1: OpenMP threads contend on "
                          "shared cores)")
    tokenizer_path: str = option("", "tokenizer.json of the served model, to decode prompts "
                                 "(empty = SmolLM2's)")


def bad_request(request_id: str, why: str) -> PredictLengthReply:
    """An error reply the caller should not retry."""
    return PredictLengthReply(request_id=request_id, error=ErrorInfo(why, code="bad_request"))


class PredictorService:
    name = "predictor"

    def __init__(self, cfg: PredictorConfig) -> None:
        self.cfg = cfg
        self.prior = LengthPrior.parse(cfg.length_prior)
        self.model: ModelPredictor | None = None  # once loaded (cfg.model_dir)
        self.server: BatchServer | None = None
        self._executor: ThreadPoolExecutor | None = None

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        if self.cfg.model_dir:
            await self._load_model(stack)
        bus = await Bus.connect(self.cfg.nats_url, Subjects(self.cfg.subject_prefix), "predictor")
        stack.push_async_callback(bus.close)
        await serve_metrics(stack, self.cfg.metrics_port)
        tasks = await stack.enter_async_context(TaskSet(on_crash=lambda _e: stop.set()))
        self.server = BatchServer(
            bus, bus.subjects.predict_length, PREDICT_REQUEST, self.predict_batch,
            lambda why: bad_request("", why), queue=PREDICTOR_GROUP,
            max_batch=self.cfg.max_batch, max_wait_s=self.cfg.batch_wait_ms / 1e3)
        await self.server.start(tasks)

    async def _load_model(self, stack: AsyncExitStack) -> None:
        from prefixmesh.services.predictor.serving import (
            ModelPredictor,  # torch, only when asked for
        )

        self._executor = ThreadPoolExecutor(1, thread_name_prefix="predictor-model")
        stack.callback(self._executor.shutdown, wait=True, cancel_futures=True)
        self.model = await asyncio.get_running_loop().run_in_executor(
            self._executor, ModelPredictor, self.cfg.model_dir, self.cfg.threads,
            self.cfg.tokenizer_path)

    async def predict_batch(self, reqs: list[PredictLengthRequest]) -> list[PredictLengthReply]:
        """Answer a batch: invalid requests get errors, requests with token ids go through
        the model (one forward pass), the rest through the prior."""
        t0 = time.perf_counter()
        replies: list[PredictLengthReply | None] = [None] * len(reqs)
        to_model: list[int] = []
        model = self.model
        for i, req in enumerate(reqs):
            why = self._invalid(req)
            if why is not None:
                replies[i] = bad_request(req.request_id, why)
            elif model is not None and req.token_ids:
                to_model.append(i)
            else:
                replies[i] = self.prior.predict(req)
        if model is not None and to_model:
            preds = await asyncio.get_running_loop().run_in_executor(
                self._executor, model.predict_distributions,
                [reqs[i].token_ids for i in to_model])
            edges = model.edges
            for i, (n, probs) in zip(to_model, preds, strict=True):
                replies[i] = PredictLengthReply(
                    request_id=reqs[i].request_id, predicted_tokens=max(n, 1.0),
                    distribution=LengthDistribution(edges=edges, probs=probs))
        LATENCY.observe(time.perf_counter() - t0)
        BATCH.observe(len(reqs))
        answered: list[PredictLengthReply] = []
        for reply in replies:
            assert reply is not None, "each request got an error, a model or a prior answer"
            REQUESTS.labels("error" if reply.error else "ok").inc()
            if reply.error:
                ERRORS.labels(reply.error.code).inc()
            answered.append(reply)
        return answered

    def _invalid(self, req: PredictLengthRequest) -> str | None:
        """Why a request cannot be answered (None when it can)."""
        if req.prompt_tokens < 0:
            return "prompt_tokens must be non-negative"
        if self.model is not None and req.token_ids:
            return check_token_ids(req.token_ids, self.model.vocab_size)
        return None

    async def stop_intake(self) -> None:
        if self.server is not None:
            await self.server.stop_intake()

    async def drain(self) -> None:
        if self.server is not None:
            await self.server.drain()
