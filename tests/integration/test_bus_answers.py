"""A request server's answers leave while the rest of its backlog waits, over a real NATS
server: nats-py hands a subscription's queued messages to its callback without returning
to the event loop, and a publish only queues bytes for the connection's flusher task, so
without ``Bus`` turning the loop once a backlog has held answers for ``ANSWER_HOLD_S``,
the first reply of a burst would wait until the burst's last request was handled (the
scheduler's tail at 100 in flight)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.msg import Msg

from prefixmesh.shared.bus import ANSWER_HOLD_S, Bus
from prefixmesh.shared.wire import (
    ROUTE_REPLY,
    ROUTE_REQUEST,
    ErrorInfo,
    RouteReply,
    SamplingParams,
    TokenizedRequest,
    encode,
)

pytestmark = pytest.mark.timeout(30)

BURST = 20
HANDLE_S = 0.01  # each request holds the loop this long (over ANSWER_HOLD_S), as a busy
# scheduler's batch of decisions does


def request(i: int) -> TokenizedRequest:
    return TokenizedRequest(request_id=f"r{i}", token_ids=[], sampling=SamplingParams(),
                            block_hashes=[], prompt_tokens=1)


@pytest.mark.parametrize("how", ["serve", "subscribe_raw"])
async def test_first_answer_leaves_before_the_backlog_is_handled(connect_bus, how: str
                                                                 ) -> None:
    assert HANDLE_S > ANSWER_HOLD_S  # each answer is held long enough to be let out
    server: Bus = await connect_bus(name="server")
    client: Bus = await connect_bus(name="client")
    subject = f"{server.subjects.route}.answers"
    started: dict[str, float] = {}

    def handle(req: TokenizedRequest) -> RouteReply:
        started[req.request_id] = time.monotonic()
        time.sleep(HANDLE_S)  # blocks the loop: no await, as a decision does not
        return RouteReply(request_id=req.request_id, worker_id="w0")

    if how == "serve":
        async def answer(req: TokenizedRequest) -> RouteReply:
            return handle(req)

        await server.serve(subject, ROUTE_REQUEST, answer,
                           lambda why: RouteReply(request_id="", error=ErrorInfo(why)))
    else:
        async def answer_raw(m: Msg) -> None:
            await m.respond(encode(handle(ROUTE_REQUEST.decode(m.data))))

        await server.subscribe_raw(subject, answer_raw)

    answered: dict[str, float] = {}

    async def ask(i: int) -> None:
        reply = await client.request(subject, request(i), ROUTE_REPLY, 10)
        answered[reply.request_id] = time.monotonic()

    await ask(-1)  # the client's reply inbox is set up by its first request
    started.clear()
    answered.clear()
    # One publish each, flushed together: the server reads the burst at once.
    await asyncio.gather(*(ask(i) for i in range(BURST)))
    assert sorted(answered) == sorted(started) == sorted(f"r{i}" for i in range(BURST))
    last_started = max(started.values())
    early = [r for r, t in answered.items() if t < last_started]
    # Every request but the last few was answered while the rest still waited.
    assert "r0" in early and len(early) >= BURST // 2, (early, started, answered)
