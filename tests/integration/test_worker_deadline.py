"""Workers enforce TokenizedRequest.deadline: expired requests are refused or dropped."""

from __future__ import annotations

import time

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.wire import (
    STREAM_EVENT,
    SUBMIT_REPLY,
    RequestDoneEvent,
    SamplingParams,
    TokenizedRequest,
)
from tests.helpers import FAST_LOAD_INTERVAL_S, eventually, running


def _request(bus: Bus, rid: str, deadline: float, max_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, token_ids=list(range(100, 164)),
                           sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           reply_to=bus.subjects.stream_reply("t", rid), deadline=deadline)


async def test_expired_requests_are_refused_or_dropped(bus: Bus, nats_server: str,
                                                       prefix: str) -> None:
    done: list[RequestDoneEvent] = []

    async def on_event(ev: object) -> None:
        if isinstance(ev, RequestDoneEvent):
            done.append(ev)

    await bus.subscribe(bus.subjects.stream_inbox("t"), STREAM_EVENT, on_event)
    worker = WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix,
                                        worker_id="wd", load_interval_s=FAST_LOAD_INTERVAL_S))
    async with running(worker):
        subject = bus.subjects.worker_submit("wd")
        late = await bus.request(subject, _request(bus, "late", time.time() - 1, 4),
                                 SUBMIT_REPLY, 5)
        assert not late.accepted and late.error.code == "timeout" and late.error.retriable
        # Thousands of decode steps: still running when its deadline passes.
        ack = await bus.request(subject, _request(bus, "slow", time.time() + 0.5, 20000),
                                SUBMIT_REPLY, 5)
        assert ack.accepted
        await eventually(lambda: bool(done), timeout=5)
        assert done[0].request_id == "slow" and done[0].finish_reason == "error"
        assert done[0].error.code == "timeout" and done[0].error.retriable
        assert "slow" not in worker.live
