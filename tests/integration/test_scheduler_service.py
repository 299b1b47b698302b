"""The scheduler service with simulated workers on real NATS and Redis."""

from __future__ import annotations

import asyncio

import msgspec
import redis.asyncio as aioredis

from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService
from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.blocks import block_hashes
from prefixmesh.shared.bus import Bus, BusUnavailable
from prefixmesh.shared.wire import (
    ROUTE_BATCH_REPLY,
    ROUTE_REPLY,
    STREAM_EVENT,
    SUBMIT_REPLY,
    RequestDoneEvent,
    RouteBatchReply,
    RouteBatchRequest,
    SamplingParams,
    TokenizedRequest,
    routing_copy,
)
from tests.helpers import FAST_LOAD_INTERVAL_S, eventually, running


def _sched_cfg(nats_server, redis_server, prefix, policy="e2") -> SchedulerConfig:
    return SchedulerConfig(nats_url=nats_server, redis_url=redis_server, subject_prefix=prefix,
                           redis_prefix=prefix, policy=policy, load_interval_s=FAST_LOAD_INTERVAL_S,
                           persist_interval_s=0.1)


def _worker(nats_server, prefix, wid) -> WorkerService:
    return WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix, worker_id=wid,
                                      load_interval_s=FAST_LOAD_INTERVAL_S))


# Like the edge (route_retry_s), the client retries a routing request nobody answered.
ROUTE_PATIENCE_S = 2.0


async def _route(bus: Bus, rid: str, tokens: list[int]):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ROUTE_PATIENCE_S
    req = TokenizedRequest(request_id=rid, token_ids=tokens, block_hashes=block_hashes(tokens),
                           sampling=SamplingParams(max_tokens=4))
    while True:
        try:
            return await bus.request(bus.subjects.route, req, ROUTE_REPLY, 5)
        except BusUnavailable:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _serve(bus: Bus, worker_id: str, rid: str, tokens: list[int], done: list) -> None:
    await bus.request(bus.subjects.worker_submit(worker_id), TokenizedRequest(
        request_id=rid, token_ids=tokens, reply_to=bus.subjects.stream_reply("t", rid),
        sampling=SamplingParams(max_tokens=4, ignore_eos=True)), SUBMIT_REPLY, 5)
    await eventually(lambda: any(d.request_id == rid for d in done))


async def test_e2_exploits_the_worker_that_cached_a_prefix(bus, nats_server, redis_server,
                                                           prefix):
    done: list = []

    async def on_stream(ev) -> None:
        if isinstance(ev, RequestDoneEvent):
            done.append(ev)

    await bus.subscribe(bus.subjects.stream_inbox("t"), STREAM_EVENT, on_stream)
    sched = SchedulerService(_sched_cfg(nats_server, redis_server, prefix))
    async with running(sched), running(_worker(nats_server, prefix, "a")), \
            running(_worker(nats_server, prefix, "b")):
        await eventually(lambda: set(sched.policy.workers) == {"a", "b"})
        doc = list(range(1000, 3000))
        first = await _route(bus, "r0", doc + [1, 2, 3])
        assert first.error is None and first.worker_id in {"a", "b"}
        await _serve(bus, first.worker_id, "r0", doc + [1, 2, 3], done)
        for i in range(5):
            r = await _route(bus, f"q{i}", doc + [10 + i] * 20)
            assert r.worker_id == first.worker_id
            assert r.decision == "exploit" and r.matched_tokens >= 1984
        # A cold prompt of similar size is explored, not exploited.
        cold = await _route(bus, "cold", list(range(5000, 7000)))
        assert cold.decision != "exploit"


async def test_round_robin_alternates_and_silent_workers_leave_routing(
        bus, nats_server, redis_server, prefix):
    sched = SchedulerService(_sched_cfg(nats_server, redis_server, prefix, "round_robin"))
    async with running(sched), running(_worker(nats_server, prefix, "a")):
        async with running(_worker(nats_server, prefix, "b")):
            await eventually(lambda: set(sched.policy.workers) == {"a", "b"})
            picks = [(await _route(bus, f"r{i}", [7] * 64)).worker_id for i in range(4)]
            assert sorted(picks) == ["a", "a", "b", "b"]
        # Worker b stopped: after 3 missed reports it no longer receives requests.
        await eventually(lambda: set(sched.policy.workers) == {"a"}, timeout=5)
        picks = {(await _route(bus, f"s{i}", [7] * 64)).worker_id for i in range(4)}
        assert picks == {"a"}


async def test_no_workers_is_an_explicit_retriable_error(bus, nats_server, redis_server, prefix):
    async with running(SchedulerService(_sched_cfg(nats_server, redis_server, prefix))):
        r = await _route(bus, "r", [1] * 32)
        assert r.worker_id == "" and r.error is not None and r.error.retriable


async def test_state_is_persisted_to_redis_and_restored(bus, nats_server, redis_server, prefix):
    cfg = _sched_cfg(nats_server, redis_server, prefix)
    sched = SchedulerService(cfg)
    doc = list(range(100, 1700))
    async with running(_worker(nats_server, prefix, "a")), running(_worker(nats_server, prefix,
                                                                           "b")):
        async with running(sched):
            await eventually(lambda: set(sched.policy.workers) == {"a", "b"})
            owner = (await _route(bus, "r0", doc)).worker_id
        r = aioredis.from_url(redis_server)
        assert await r.get(sched.store.meta_key)
        await r.aclose()
        # A new scheduler process restores the tree: the prefix is exploited at once.
        again = SchedulerService(cfg)
        async with running(again):
            # Routing once caught up (every restored worker resent its cache)
            await eventually(lambda: again.routing and set(again.policy.workers) == {"a", "b"},
                             timeout=15)
            r2 = await _route(bus, "r1", doc + [5] * 16)
            # r0 was routed, never run: the workers' resyncs during catch-up say nobody
            # caches doc, and the restored window still sends it to its home.
            assert (r2.worker_id, r2.decision) == (owner, "affinity")


async def test_malformed_packed_hashes_are_refused_alone_in_their_batch(
        bus, nats_server, redis_server, prefix):
    """Packed hashes that are not whole int64s: that request's answer is a bad_request
    naming the field; the others of its message are routed as usual."""
    sched = SchedulerService(_sched_cfg(nats_server, redis_server, prefix))
    async with running(sched), running(_worker(nats_server, prefix, "a")):
        await eventually(lambda: set(sched.policy.workers) == {"a"})
        good = [routing_copy(TokenizedRequest(
            request_id=f"g{i}", token_ids=[], block_hashes=block_hashes([i] * 64),
            prompt_tokens=64, sampling=SamplingParams(max_tokens=4))) for i in range(2)]
        bad = msgspec.structs.replace(good[0], request_id="bad",
                                      packed_hashes=good[0].packed_hashes[:-3])
        reply = await bus.request(bus.subjects.route,
                                  RouteBatchRequest(requests=[good[0], bad, good[1]]),
                                  ROUTE_BATCH_REPLY, 5)
    assert isinstance(reply, RouteBatchReply)
    first, refused, second = reply.replies
    assert first.worker_id == "a" and second.worker_id == "a"
    assert refused.request_id == "bad" and not refused.worker_id
    assert refused.error is not None and refused.error.code == "bad_request"
    assert refused.error.param == "packed_hashes" and "multiple of 8" in refused.error.message
