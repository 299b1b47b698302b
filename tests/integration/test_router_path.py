"""The short router path on real NATS: routing requests batched to the scheduler, short
prompts placed through the scheduler in one hop (and the two steps when it does not
serve that), short text tokenized by the edge itself."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.service import EdgeService
from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService
from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.blocks import block_hashes, unpack_hashes
from prefixmesh.shared.bus import BatchLimits, Bus, BusUnavailable
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL
from prefixmesh.shared.wire import (
    PLACE_REQUEST,
    ROUTE_REQUEST,
    WORKER_REQUEST,
    LoadReportEvent,
    RouteBatchRequest,
    RouteReply,
    SamplingParams,
    SubmitBatch,
    TokenizedRequest,
    route_message,
    route_replies,
)
from tests.helpers import FAST_LOAD_INTERVAL_S, eventually, running

WORKERS = ("w0", "w1")
# Short and long token-id prompts for an edge that places prompts of up to PLACE_MAX tokens.
PLACE_MAX = 64


def _req(rid: str, seed: int) -> TokenizedRequest:
    tokens = [seed * 100 + i for i in range(48)]
    return TokenizedRequest(request_id=rid, token_ids=[], sampling=SamplingParams(max_tokens=4),
                            block_hashes=block_hashes(tokens), prompt_tokens=len(tokens))


@pytest.fixture
async def mesh(bus: Bus, nats_server: str, redis_server: str, prefix: str):
    """Two sim workers and the E2 scheduler in-process; yields once it routes."""
    sched = SchedulerService(SchedulerConfig(
        nats_url=nats_server, redis_url=redis_server, subject_prefix=prefix,
        redis_prefix=prefix, load_interval_s=FAST_LOAD_INTERVAL_S))
    workers = [WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix,
                                          worker_id=w, load_interval_s=FAST_LOAD_INTERVAL_S))
               for w in WORKERS]
    async with running(workers[0]), running(workers[1]), running(sched):
        await eventually(lambda: set(sched.policy.workers) == set(WORKERS))
        yield sched


class RouteTap:
    """What travels on the route subject (a plain subscriber beside the scheduler's group)."""

    def __init__(self) -> None:
        self.messages: list[object] = []

    async def __call__(self, msg: object) -> None:
        self.messages.append(msg)


async def test_concurrent_routing_requests_share_messages_and_get_their_own_answers(
        bus: Bus, mesh) -> None:
    tap = RouteTap()
    await bus.subscribe(bus.subjects.route, ROUTE_REQUEST, tap)
    async with bus.batcher(bus.subjects.route, route_message, route_replies, 5,
                           BatchLimits(max_batch=16, max_inflight=2)) as router:
        reqs = [_req(f"r{i}", i) for i in range(40)]
        replies: list[RouteReply] = await asyncio.gather(*(router.request(r) for r in reqs))
    assert [r.request_id for r in replies] == [r.request_id for r in reqs]
    assert all(r.worker_id in WORKERS for r in replies)
    assert router.batches < len(reqs)  # batched: fewer messages than requests
    await eventually(lambda: len(tap.messages) == router.batches)
    assert all(isinstance(m, RouteBatchRequest) and len(m.requests) <= 16
               for m in tap.messages)


async def test_an_idle_caller_sends_each_request_as_itself_at_once(bus: Bus, mesh) -> None:
    tap = RouteTap()
    await bus.subscribe(bus.subjects.route, ROUTE_REQUEST, tap)
    async with bus.batcher(bus.subjects.route, route_message, route_replies, 5,
                           BatchLimits()) as router:
        for i in range(3):
            reply = await router.request(_req(f"s{i}", 50 + i))
            assert reply.request_id == f"s{i}" and reply.worker_id in WORKERS
    assert router.batches == 3
    await eventually(lambda: len(tap.messages) == 3)
    assert all(isinstance(m, TokenizedRequest) for m in tap.messages)


async def test_a_batch_nobody_answers_fails_each_of_its_requests(bus: Bus) -> None:
    async with bus.batcher(bus.subjects.route, route_message, route_replies, 0.5,
                           BatchLimits()) as router:
        results = await asyncio.gather(*(router.request(_req(f"x{i}", i)) for i in range(5)),
                                       return_exceptions=True)
    assert all(isinstance(r, BusUnavailable) for r in results)


async def test_a_malformed_answer_fails_each_request_of_its_batch_as_unanswered(
        bus: Bus) -> None:
    async def junk(msg) -> None:
        await msg.respond(b"not msgpack")

    await bus.nc.subscribe(bus.subjects.route, cb=junk)
    async with bus.batcher(bus.subjects.route, route_message, route_replies, 5,
                           BatchLimits()) as router:
        results = await asyncio.gather(*(router.request(_req(f"m{i}", i)) for i in range(3)),
                                       return_exceptions=True)
    assert all(isinstance(r, BusUnavailable) and "malformed answer" in str(r)
               for r in results), results


async def test_a_cancelled_request_leaves_the_others_of_its_batch_answered(
        bus: Bus, mesh) -> None:
    async with bus.batcher(bus.subjects.route, route_message, route_replies, 5,
                           BatchLimits(max_inflight=1)) as router:
        first = asyncio.ensure_future(router.request(_req("a", 1)))
        waiting = [asyncio.ensure_future(router.request(_req(f"b{i}", 10 + i)))
                   for i in range(3)]
        await asyncio.sleep(0)
        waiting[1].cancel()
        assert (await first).worker_id in WORKERS
        others = await asyncio.gather(waiting[0], waiting[2])
    assert [r.request_id for r in others] == ["b0", "b2"]


def _edge_cfg(nats_server: str, prefix: str, **kw) -> EdgeConfig:
    return EdgeConfig(nats_url=nats_server, subject_prefix=prefix, port=0, models=MODEL,
                      batch=False, place_max_tokens=PLACE_MAX, tokenize_timeout_s=0.5, **kw)


async def _complete(session: aiohttp.ClientSession, url: str, prompt) -> tuple[int, dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


async def test_short_prompts_are_placed_in_one_hop_and_long_ones_routed(
        bus: Bus, mesh, nats_server: str, prefix: str) -> None:
    tap = RouteTap()
    await bus.subscribe(bus.subjects.route, ROUTE_REQUEST, tap)
    async with running(EdgeService(_edge_cfg(nats_server, prefix))) as edge, \
            aiohttp.ClientSession() as session:
        status, body = await _complete(session, edge.url, list(range(100, 100 + PLACE_MAX)))
        assert status == 200, body
        assert edge.mesh.placed == 1
        long_prompt = list(range(500, 501 + PLACE_MAX))
        status, body = await _complete(session, edge.url, long_prompt)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == PLACE_MAX + 1
        assert edge.mesh.placed == 1  # the long one took route, then submit
    # It was routed without its token ids, its block hashes packed.
    await eventually(lambda: len(tap.messages) == 1)
    routed = tap.messages[0]
    assert isinstance(routed, TokenizedRequest)
    assert routed.token_ids == [] and routed.block_hashes == []
    assert routed.prompt_tokens == PLACE_MAX + 1
    assert list(unpack_hashes(routed.packed_hashes)) == block_hashes(long_prompt)


async def test_placements_made_together_share_messages_to_the_scheduler_and_workers(
        bus: Bus, mesh, nats_server: str, prefix: str) -> None:
    """Short prompts sent at once: the edge places them in batches (``SubmitBatch`` on
    ``sched.place``), and the scheduler passes each worker its share of a batch in one
    message; every request is placed once and answered."""
    placements, shares = RouteTap(), RouteTap()
    await bus.subscribe(bus.subjects.place, PLACE_REQUEST, placements)
    for w in WORKERS:
        await bus.subscribe(bus.subjects.worker_submit(w), WORKER_REQUEST, shares)
    count = 24
    async with running(EdgeService(_edge_cfg(nats_server, prefix, route_inflight=1))) as edge, \
            aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(
            _complete(session, edge.url, [1000 + 10 * i + k for k in range(20)])
            for i in range(count)))
        assert all(status == 200 for status, _ in answers), answers
        assert edge.mesh.placed == count
    await eventually(lambda: sum(len(m.requests) for m in placements.messages) == count)
    assert len(placements.messages) < count  # placed in batches
    await eventually(lambda: sum(len(m.requests) for m in shares.messages) == count)
    assert all(isinstance(m, SubmitBatch) for m in shares.messages)
    # A batch's requests reach each of their workers together, each request once.
    assert len(shares.messages) <= len(placements.messages) * len(WORKERS)
    placed = [r.request_id for m in shares.messages for r in m.requests]
    assert len(set(placed)) == count


async def test_a_scheduler_that_does_not_place_still_gets_every_request_served(
        bus: Bus, nats_server: str, prefix: str) -> None:
    """Nothing serves ``sched.place`` (a scheduler from before it): the edge routes, then
    submits, as always, and leaves placing alone for a while."""
    async def route_to_w0(req: TokenizedRequest) -> RouteReply:
        return RouteReply(request_id=req.request_id, worker_id="w0", decision="fixed")

    await bus.serve(bus.subjects.route, ROUTE_REQUEST, route_to_w0,
                    lambda why: RouteReply(request_id="", error=None))
    worker = WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix,
                                        worker_id="w0", load_interval_s=FAST_LOAD_INTERVAL_S))
    async with running(worker), running(EdgeService(_edge_cfg(nats_server, prefix))) as edge, \
            aiohttp.ClientSession() as session:
        for seed in range(3):
            status, body = await _complete(session, edge.url, [seed + 1] * 20)
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 2
        assert edge.mesh.placed == 0


@pytest.mark.parametrize("hung", [False, True], ids=["gone", "hung"])
async def test_a_placed_request_whose_worker_is_gone_is_placed_again_elsewhere(
        bus: Bus, nats_server: str, redis_server: str, prefix: str, hung: bool) -> None:
    """The scheduler still believes in a worker that serves nothing (its reports go on; a
    process killed a moment ago), or one that takes requests and never answers (a process
    that hangs): a request placed there comes back as a refusal naming it, at once or
    after ``PLACE_ACK_TIMEOUT_S``, and the edge places it again without it."""
    sched = SchedulerService(SchedulerConfig(
        nats_url=nats_server, redis_url=redis_server, subject_prefix=prefix,
        redis_prefix=prefix, policy="round_robin", load_interval_s=FAST_LOAD_INTERVAL_S))
    worker = WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix,
                                        worker_id="w0", load_interval_s=FAST_LOAD_INTERVAL_S))

    async def ghost_reports() -> None:
        while True:
            await bus.publish(bus.subjects.load("ghost"), LoadReportEvent(
                worker_id="ghost", ts=time.time(), free_blocks=1000, total_blocks=1000))
            await asyncio.sleep(FAST_LOAD_INTERVAL_S)

    if hung:
        async def ignore(msg: object) -> None:
            return None

        await bus.nc.subscribe(bus.subjects.worker_submit("ghost"), cb=ignore)
    ghost = asyncio.create_task(ghost_reports())
    try:
        async with running(worker), running(sched), \
                running(EdgeService(_edge_cfg(nats_server, prefix))) as edge, \
                aiohttp.ClientSession() as session:
            await eventually(lambda: set(sched.policy.workers) == {"w0", "ghost"})
            for seed in range(4):  # round robin: half of them are placed on the ghost first
                status, body = await _complete(session, edge.url, [seed + 7] * 20)
                assert status == 200, body
            assert edge.mesh.placed == 4
            assert sched.decisions.get("round_robin", 0) >= 6  # ghost refusals re-placed
    finally:
        ghost.cancel()
        await asyncio.gather(ghost, return_exceptions=True)


async def test_the_edge_tokenizes_short_text_itself(mesh, nats_server: str,
                                                    prefix: str) -> None:
    """No tokenizer service runs: short text is served; text above the edge's limit needs
    the service, and its absence is a 503 that names it."""
    cfg = _edge_cfg(nats_server, prefix, local_tokenize_chars=200)
    async with running(EdgeService(cfg)) as edge, aiohttp.ClientSession() as session:
        status, body = await _complete(session, edge.url, "a short prompt served at once")
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > 0
        status, body = await _complete(session, edge.url, "word " * 100)
        assert status == 503
        assert "tokenizer unavailable" in body["error"]["message"]
