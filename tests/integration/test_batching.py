"""BatchServer over a real NATS server: batches bounded by max_batch, every request answered
once and in its own inbox, a failing handler answers its batch with errors and serving goes on."""

from __future__ import annotations

import asyncio

import pytest

from prefixmesh.services.predictor.batching import BatchServer
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.runtime.lifecycle import TaskSet
from prefixmesh.shared.wire import (
    PREDICT_REPLY,
    PREDICT_REQUEST,
    ErrorInfo,
    PredictLengthReply,
    PredictLengthRequest,
)

pytestmark = pytest.mark.timeout(30)


def error(why: str) -> PredictLengthReply:
    return PredictLengthReply(request_id="", error=ErrorInfo(why, "bad_request"))


async def test_batches_are_bounded_and_failures_answered(bus: Bus) -> None:
    sizes: list[int] = []
    gate = asyncio.Event()

    async def handler(reqs: list[PredictLengthRequest]) -> list[PredictLengthReply]:
        sizes.append(len(reqs))
        await gate.wait()  # hold the first batch so the rest queue up behind it
        if any(r.workload == "boom" for r in reqs):
            raise RuntimeError("model failed")
        return [PredictLengthReply(request_id=r.request_id, predicted_tokens=r.prompt_tokens)
                for r in reqs]

    subj = bus.subjects.predict_length
    async with TaskSet() as tasks:
        server = BatchServer(bus, subj, PREDICT_REQUEST, handler, error, max_batch=4,
                             max_wait_s=0.0)
        await server.start(tasks)

        async def ask(i: int, workload: str = "") -> PredictLengthReply:
            return await bus.request(subj, PredictLengthRequest(
                request_id=f"r{i}", prompt_tokens=i, workload=workload), PREDICT_REPLY, 10)

        pending = [asyncio.create_task(ask(i)) for i in range(11)]
        await asyncio.sleep(0.2)
        gate.set()
        replies = await asyncio.gather(*pending)
        assert [(r.request_id, r.predicted_tokens) for r in replies] == [
            (f"r{i}", i) for i in range(11)]
        assert max(sizes) <= 4 and sum(sizes) == 11 and len(sizes) >= 3
        failed = await ask(99, "boom")
        assert failed.error is not None and "internal error" in failed.error.message
        assert (await ask(7)).predicted_tokens == 7  # still serving
        await server.stop_intake()
        await server.drain()
        assert server.requests == 13
