"""Active-active scheduler replicas (routing together, a killed one, catch-up at boot) and
Redis outages, with real processes, NATS and Redis."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest
import redis.asyncio as aioredis

from prefixmesh.services.scheduler.policies import make_policy
from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.scheduler.replicas import Peers
from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService
from prefixmesh.services.scheduler.store import StateStore
from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes
from prefixmesh.shared.bus import Bus, BusUnavailable
from prefixmesh.shared.runtime.servers import (
    ManagedProcess,
    child_env,
    free_port,
    start_redis,
)
from prefixmesh.shared.wire import (
    BUS_EVENT,
    ROUTE_REPLY,
    AllBlocksCleared,
    BlockStored,
    KvEventBatch,
    LoadReportEvent,
    RoutingDecisionsEvent,
    SamplingParams,
    TokenizedRequest,
)
from tests.helpers import (
    FAST_LOAD_INTERVAL_S,
    eventually,
    eventually_async,
    running,
)

pytestmark = pytest.mark.timeout(90)


def _worker(nats_server: str, prefix: str, wid: str) -> WorkerService:
    return WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix, worker_id=wid,
                                      load_interval_s=FAST_LOAD_INTERVAL_S))


def _scheduler_process(nats_server, redis_url, prefix, log_path) -> ManagedProcess:
    env = child_env(PM_NATS_URL=nats_server, PM_REDIS_URL=redis_url, PM_SUBJECT_PREFIX=prefix,
                    PM_REDIS_PREFIX=prefix, PM_LOAD_INTERVAL_S=str(FAST_LOAD_INTERVAL_S),
                    PM_PERSIST_INTERVAL_S="0.1", PM_LEASE_TTL_S="1.5", PM_LOG_LEVEL="INFO")
    return ManagedProcess("scheduler", [sys.executable, "-m", "prefixmesh.services.scheduler"],
                          env=env,
                          log_path=log_path).start()


async def _route_retrying(bus: Bus, rid: str, tokens: list[int], patience_s: float = 10.0):
    """A client that retries until a scheduler answers (as the edge does)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            r = await bus.request(bus.subjects.route, TokenizedRequest(
                request_id=rid, token_ids=tokens, block_hashes=block_hashes(tokens),
                sampling=SamplingParams(max_tokens=4)), ROUTE_REPLY, 0.5)
            if r.worker_id:
                return r
        except BusUnavailable:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"routing request {rid} lost")
        await asyncio.sleep(0.05)


async def test_replicas_route_together_and_a_killed_one_loses_no_request(
        bus, nats_server, redis_server, prefix, tmp_path):
    docs = {f"doc{i}": list(range(10_000 * (i + 1), 10_000 * (i + 1) + 1600)) for i in range(4)}
    logs = [tmp_path / f"s{i}.log" for i in range(2)]
    replicas = [_scheduler_process(nats_server, redis_server, prefix, log) for log in logs]
    try:
        async with running(_worker(nats_server, prefix, "a")), \
                running(_worker(nats_server, prefix, "b")):
            # Both replicas route (each joined the queue group once caught up).
            await eventually(lambda: all("routes (policy" in log.read_text() for log in logs),
                             timeout=30)
            owners = {}
            for name, doc in docs.items():
                owners[name] = (await _route_retrying(bus, name, doc)).worker_id
            results: list = []

            async def stream() -> None:
                for i in range(60):
                    name = f"doc{i % 4}"
                    r = await _route_retrying(bus, f"s{i}", docs[name] + [i] * 32)
                    results.append((name, r))
                    await asyncio.sleep(0.05)

            streamer = asyncio.create_task(stream())
            await eventually(lambda: len(results) >= 4)
            killed_after = len(results)
            replicas[0].signal(signal.SIGKILL)
            await streamer
            assert len(results) == 60  # none lost: every request got a worker
            after = results[killed_after + 1:]  # (one may have been answered as it died)
            assert after, "no request was routed after the kill"
            # The survivor charged the dead one's decisions all along: its tree sends the
            # known prefixes to their workers (every decision of either replica went there).
            assert all(r.worker_id == owners[n] for n, r in after[-8:])
    finally:
        for p in replicas:
            p.stop()


def _replica(nats_server: str, redis_url: str, prefix: str, **kw) -> SchedulerService:
    return SchedulerService(SchedulerConfig(
        nats_url=nats_server, redis_url=redis_url, subject_prefix=prefix, redis_prefix=prefix,
        load_interval_s=FAST_LOAD_INTERVAL_S, persist_interval_s=0.1, **kw))


async def test_three_replicas_each_charge_every_decision(bus, nats_server, redis_server, prefix):
    """Requests split over three replicas by the queue group; each replica's load window
    holds all of them (the others' decisions too), not a third."""
    replicas = [_replica(nats_server, redis_server, prefix) for _ in range(3)]
    async with running(_worker(nats_server, prefix, "a")), \
            running(_worker(nats_server, prefix, "b")), \
            running(replicas[0]), running(replicas[1]), running(replicas[2]):
        await eventually(lambda: all(set(r.policy.workers) == {"a", "b"} for r in replicas))
        n = 90
        replies = await asyncio.gather(*(_route_retrying(
            bus, f"r{i}", [i % 7] * 48 + [i] * 32) for i in range(n)))
        assert all(r.worker_id in ("a", "b") for r in replies)
        made = [sum(r.decisions.values()) for r in replicas]
        assert sum(made) == n and all(m > 0 for m in made), made  # all three routed
        ids = {f"r{i}" for i in range(n)}
        # Every replica charged all n requests: its own and the two others' decisions.
        await eventually(lambda: all(
            {e.rid for e in r.policy.window.entries} == ids for r in replicas))
        # So a decision made by one raised every replica's load of that worker alike.
        for w in ("a", "b"):
            loads = [r.policy.worker_state(w).L for r in replicas]
            assert max(loads) - min(loads) < 1e-6 * max(max(loads), 1.0), loads


async def test_a_lone_replica_tells_its_decisions_only_once_another_says_hello(
        bus, nats_server, redis_server, prefix):
    """Alone, a scheduler publishes only its hellos (empty ``sched.decisions`` messages),
    no decision records; a new replica's hello is answered at once, and from then on every
    decision is told."""
    heard: list[RoutingDecisionsEvent] = []  # the scheduler's messages

    async def on_decisions(ev: object) -> None:
        if isinstance(ev, RoutingDecisionsEvent) and ev.scheduler_id != "peer-x":
            heard.append(ev)

    await bus.subscribe(bus.subjects.sched_decisions, BUS_EVENT, on_decisions)
    sched = _replica(nats_server, redis_server, prefix)
    sched.peers = Peers(hello_s=3600.0)  # no periodic hello in this test: only answers
    async with running(_worker(nats_server, prefix, "a")), running(sched):
        await eventually(lambda: "a" in sched.policy.workers)
        for i in range(5):
            await _route_retrying(bus, f"alone{i}", [i] * 40)
        # A record would have been published before its reply, on the same connection.
        await asyncio.sleep(0.2)
        assert heard and all(e.scheduler_id == sched.instance_id for e in heard)
        assert all(not e.decisions for e in heard), "decisions told with nobody to tell"
        seen = len(heard)
        # Another replica says hello: answered with a hello at once, then the decisions
        # follow.
        await bus.publish(bus.subjects.sched_decisions, RoutingDecisionsEvent(
            scheduler_id="peer-x", ts=time.time(), decisions=[]))
        await eventually(lambda: len(heard) > seen, timeout=5.0)
        for i in range(5):
            await _route_retrying(bus, f"told{i}", [i] * 40)
        await eventually(lambda: {d.request_id for e in heard for d in e.decisions}
                         == {f"told{i}" for i in range(5)})


async def test_a_booting_replica_routes_only_once_caught_up(bus, nats_server, redis_server,
                                                           prefix):
    """The replica starts with nothing (no snapshot): it must not route until the worker
    has resent its cache, which it delays here."""
    doc = list(range(500, 500 + 32 * BLOCK_SIZE))
    answer = asyncio.Event()

    async def on_resync(_m) -> None:
        await answer.wait()
        cache = BlockStored(block_hashes=block_hashes(doc), parent_block_hash=None,
                            token_ids=[], block_size=BLOCK_SIZE)
        await bus.publish(bus.subjects.kv("w"), KvEventBatch(
            worker_id="w", seq=1, ts=time.time(), events=[AllBlocksCleared(), cache]))

    async def reports() -> None:
        while True:
            await bus.publish(bus.subjects.load("w"), LoadReportEvent(
                worker_id="w", ts=time.time(), total_blocks=10_000, free_blocks=10_000))
            await asyncio.sleep(FAST_LOAD_INTERVAL_S)

    await bus.subscribe_raw(bus.subjects.worker_resync("w"), on_resync)
    sched = _replica(nats_server, redis_server, prefix, catchup_timeout_s=30.0)
    finish = asyncio.Event()

    async def serve() -> None:
        async with running(sched):
            await finish.wait()

    reporter = asyncio.create_task(reports())
    server = asyncio.create_task(serve())
    try:
        await eventually(lambda: "w" in sched.policy.workers)
        await asyncio.sleep(0.3)  # several report periods: it knows the worker, not its cache
        assert not sched.routing
        with pytest.raises(BusUnavailable):  # nobody in the queue group yet
            await bus.request(bus.subjects.route, TokenizedRequest(
                request_id="early", token_ids=doc, block_hashes=block_hashes(doc),
                sampling=SamplingParams(max_tokens=4)), ROUTE_REPLY, 0.3)
        answer.set()
        await eventually(lambda: sched.routing)
        # It joined after the resync: the worker's cache is in its tree from the first route.
        r = await _route_retrying(bus, "r0", doc + [1] * 16, patience_s=2)
        assert (r.worker_id, r.decision) == ("w", "exploit")
    finally:
        finish.set()
        await server
        reporter.cancel()


async def test_routing_survives_redis_going_down_and_persists_again_after(
        bus, nats_server, prefix, tmp_path):
    port = free_port()
    redis_proc, redis_url = start_redis(port=port, data_dir=tmp_path)
    # Lenient about the worker's silence: it shares this busy loop (a slow turn under a
    # loaded machine would take it out of routing, and its routed paths with it), and the
    # test is about Redis, not about workers leaving.
    cfg = SchedulerConfig(nats_url=nats_server, redis_url=redis_url, subject_prefix=prefix,
                          redis_prefix=prefix, load_interval_s=FAST_LOAD_INTERVAL_S,
                          persist_interval_s=0.1, missed_reports=40)
    sched = SchedulerService(cfg)
    try:
        async with running(sched), running(_worker(nats_server, prefix, "a")):
            await eventually(lambda: "a" in sched.policy.workers)
            await _route_retrying(bus, "before", [5] * 64, patience_s=2)
            # Off the loop: the services under test share it, and a blocking stop/start
            # would stall their load reports.
            await asyncio.to_thread(redis_proc.stop)
            for i in range(20):  # Redis is down: every request is still routed at once
                r = await bus.request(bus.subjects.route, TokenizedRequest(
                    request_id=f"down{i}", token_ids=[i] * 64, block_hashes=block_hashes([i] * 64),
                    sampling=SamplingParams(max_tokens=4)), ROUTE_REPLY, 2)
                assert r.worker_id == "a"
            assert sched.routing
            redis_proc, redis_url = await asyncio.to_thread(
                start_redis, port=port, data_dir=tmp_path)
            client = aioredis.from_url(redis_url)
            try:
                async def persisted() -> bool:
                    return bool(await client.get(sched.store.meta_key))

                await eventually_async(persisted)  # after Redis returned
                # Redis came back empty: the whole state was written again, including what
                # was routed while it was down.
                await eventually(lambda: sched.store.last.full, timeout=5)
                restored = make_policy("e2", PolicyConfig(), sched.cost)
                assert await StateStore(client, sched.state_key).load(restored)
                assert "a" in restored.workers
                for i in (0, 19):
                    node, m = restored.tree.match(block_hashes([i] * 64))
                    assert m == 4 and "a" in node.workers
                # The lease is re-taken too, so another replica would not also write snapshots.
                async def lease_held() -> bool:
                    return await client.get(sched.lease_key) == sched.instance_id.encode()

                await eventually_async(lease_held)
            finally:
                await client.aclose()
    finally:
        redis_proc.stop()


async def test_a_draining_scheduler_does_not_take_its_lease_back(nats_server, redis_server,
                                                                  prefix):
    """drain() releases the lease for another replica; the lease loop must not re-take it in the
    moments before the process exits (it would keep the others waiting a whole TTL)."""
    cfg = SchedulerConfig(nats_url=nats_server, redis_url=redis_server, subject_prefix=prefix,
                          redis_prefix=prefix, load_interval_s=FAST_LOAD_INTERVAL_S,
                          persist_interval_s=0.1, lease_ttl_s=0.6)
    sched = SchedulerService(cfg)
    client = aioredis.from_url(redis_server)
    calls: list[str] = []  # what the instance did with its lease, in order
    try:
        async with running(sched):
            assert await client.get(sched.lease_key) == sched.instance_id.encode()
            lease = sched.lease
            for name in ("try_acquire", "renew", "release"):
                setattr(lease, name, _recorded(calls, name, getattr(lease, name)))
            # The lease loop runs, and is between two renewals (drain() cancels it there;
            # a cancel that lands inside a Redis call can be lost: drain() then hangs).
            await eventually(lambda: "renew done" in calls and calls[-1].endswith(" done"))
            assert "scheduler-lease" in _running_tasks()
            await sched.drain()
            assert await client.get(sched.lease_key) is None
            # The lease loop is over once drain() returns: nothing is left to take it back.
            assert "scheduler-lease" not in _running_tasks()
        # Stopped: nothing of the instance runs any more, so what it did is all in ``calls``.
        # After the release the lease was never touched again (taken back, or renewed).
        released = calls.index("release")
        assert {c.removesuffix(" done") for c in calls[released:]} == {"release"}, calls
        assert await client.get(sched.lease_key) is None
    finally:
        await client.aclose()


def _running_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if not t.done()}


def _recorded(calls: list[str], name: str, method):
    """``method``, noting in ``calls`` when each call starts (``name``) and ends."""
    async def call(*args, **kwargs):
        calls.append(name)
        try:
            return await method(*args, **kwargs)
        finally:
            calls.append(f"{name} done")

    return call
