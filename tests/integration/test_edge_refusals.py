"""A request option a worker's backend cannot serve is the client's 400 naming it, never a
503: the edge does not route a request the worker refused as bad around the mesh.

The worker here is a stand-in on the real NATS server: it reports its load like a worker
(so the scheduler routes to it) and refuses every submit as a bad request, the way a worker
refuses what its engine raises ``BadOption`` for (services/worker/service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.service import EdgeService
from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL
from prefixmesh.shared.wire import (
    WORKER_REQUEST,
    ErrorInfo,
    LoadReportEvent,
    SubmitBatch,
    SubmitReplies,
    SubmitReply,
    TokenizedRequest,
)
from tests.helpers import running

pytestmark = pytest.mark.timeout(60)

LOAD_INTERVAL_S = 0.1


class RefusingWorker:
    """Reports load as worker ``wid`` and refuses every request (bad_request, ``param``)."""

    def __init__(self, bus: Bus, wid: str, param: str) -> None:
        self.bus, self.wid, self.param = bus, wid, param
        self.submits = 0

    async def on_request(self, msg: object) -> SubmitReply | SubmitReplies:
        if isinstance(msg, SubmitBatch):  # placed through the scheduler
            return SubmitReplies(replies=[self.refuse(r) for r in msg.requests])
        if isinstance(msg, TokenizedRequest):
            return self.refuse(msg)
        return SubmitReply(request_id=getattr(msg, "request_id", ""), worker_id=self.wid)

    def refuse(self, req: TokenizedRequest) -> SubmitReply:
        self.submits += 1
        return SubmitReply(request_id=req.request_id, worker_id=self.wid, accepted=False,
                           error=ErrorInfo(f"{self.param}: not supported by this backend",
                                           "bad_request", param=self.param))

    async def report(self) -> None:
        while True:
            await self.bus.publish(self.bus.subjects.load(self.wid), LoadReportEvent(
                worker_id=self.wid, ts=time.time(), free_blocks=100, total_blocks=100,
                model=MODEL))
            await asyncio.sleep(LOAD_INTERVAL_S)


async def test_option_a_backend_cannot_serve_is_a_400_naming_it(
        bus: Bus, nats_server: str, redis_server: str, prefix: str) -> None:
    worker = RefusingWorker(bus, "refuser", "logprobs")
    await bus.serve(bus.subjects.worker_submit("refuser"), WORKER_REQUEST, worker.on_request,
                    lambda why: SubmitReply(request_id="", accepted=False))
    reports = asyncio.create_task(worker.report())
    sched = SchedulerService(SchedulerConfig(
        nats_url=nats_server, redis_url=redis_server, subject_prefix=prefix,
        redis_prefix=prefix, load_interval_s=LOAD_INTERVAL_S))
    edge_cfg = EdgeConfig(nats_url=nats_server, subject_prefix=prefix, port=0, models=MODEL,
                          batch=False, route_retry_s=5.0)
    try:
        async with running(sched), running(EdgeService(edge_cfg)) as edge, \
                aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 2,
                    "logprobs": 3}
            while True:  # until the scheduler has heard of the worker and routes to it
                async with session.post(edge.url + "/v1/completions", json=body) as r:
                    status, err = r.status, await r.json()
                if worker.submits:
                    break
                assert status == 503, err
                await asyncio.sleep(LOAD_INTERVAL_S)
            assert status == 400, err
            assert err["error"]["param"] == "logprobs" and "logprobs" in err["error"]["message"]
            assert err["error"]["code"] == "bad_request"
            assert worker.submits == 1  # not retried on other workers: it cannot help
            # Streamed, the refusal comes before the stream: an HTTP 400 too.
            async with session.post(edge.url + "/v1/completions",
                                    json={**body, "stream": True}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "logprobs"
    finally:
        reports.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reports
