"""Predictor service: answers ``predict.length`` in the ``predictor`` queue group."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from services.predictor.prior import DEFAULT_TABLE, LengthPrior
from shared.bus import Bus
from shared.config import CommonConfig, option
from shared.messages import PREDICT_REQUEST, ErrorInfo, PredictLengthReply, PredictLengthRequest
from shared.metrics import LATENCY_BUCKETS_S, serve_metrics
from shared.subjects import PREDICTOR_GROUP, Subjects

REQUESTS = Counter("prefixmesh_predictor_requests_total", "predictions by outcome", ["outcome"])
ERRORS = Counter("prefixmesh_predictor_errors_total", "requests answered with an error, by code",
                 ["code"])
LATENCY = Histogram("prefixmesh_predictor_request_latency_seconds", "time to answer one request",
                    buckets=LATENCY_BUCKETS_S)


@dataclass(frozen=True)
class PredictorConfig(CommonConfig):
    length_prior: str = option(DEFAULT_TABLE, "mean output tokens per workload: name=n,...")


class PredictorService:
    name = "predictor"

    def __init__(self, cfg: PredictorConfig) -> None:
        self.cfg = cfg
        self.prior = LengthPrior.parse(cfg.length_prior)
        self._sub = None

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        bus = await Bus.connect(self.cfg.nats_url, Subjects(self.cfg.subject_prefix), "predictor")
        stack.push_async_callback(bus.close)
        await serve_metrics(stack, self.cfg.metrics_port)

        async def handle(req: PredictLengthRequest) -> PredictLengthReply:
            t0 = time.perf_counter()
            reply = self.prior.predict(req)
            LATENCY.observe(time.perf_counter() - t0)
            REQUESTS.labels("error" if reply.error else "ok").inc()
            if reply.error:
                ERRORS.labels(reply.error.code).inc()
            return reply

        self._sub = await bus.serve(
            bus.subjects.predict_length, PREDICT_REQUEST, handle,
            lambda why: PredictLengthReply(request_id="", error=ErrorInfo(why, "bad_request")),
            queue=PREDICTOR_GROUP)

    async def stop_intake(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def drain(self) -> None:
        return None
