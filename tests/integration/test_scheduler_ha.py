"""Scheduler failover and Redis outages, with real processes, NATS and Redis."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest
import redis.asyncio as aioredis

from prefixmesh.services.scheduler.policies import make_policy
from prefixmesh.services.scheduler.policies.base import PolicyConfig
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
from prefixmesh.shared.wire import ROUTE_REPLY, SamplingParams, TokenizedRequest
from tests.helpers import (
    FAST_LOAD_INTERVAL_S,
    default_cost,
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


async def _persisted(client: aioredis.Redis, prefix: str, docs: dict[str, list[int]],
                     owners: dict[str, str]) -> bool:
    """Whether the e2 state in Redis (what a standby restores) has every doc on its owner."""
    policy = make_policy("e2", PolicyConfig(), default_cost())
    if not await StateStore(client, f"{prefix}:sched:e2").load(policy):
        return False
    for name, doc in docs.items():
        node, matched = policy.tree.match(block_hashes(doc))
        if matched < len(doc) // BLOCK_SIZE or owners[name] not in node.workers:
            return False
    return True


async def test_standby_takes_over_from_a_killed_active_and_keeps_affinity(
        bus, nats_server, redis_server, prefix, tmp_path):
    docs = {f"doc{i}": list(range(10_000 * (i + 1), 10_000 * (i + 1) + 1600)) for i in range(4)}
    active = _scheduler_process(nats_server, redis_server, prefix, tmp_path / "a.log")
    standby = None
    client = aioredis.from_url(redis_server)
    try:
        async with running(_worker(nats_server, prefix, "a")), \
                running(_worker(nats_server, prefix, "b")):
            owners = {}
            for name, doc in docs.items():
                owners[name] = (await _route_retrying(bus, name, doc)).worker_id
            standby = _scheduler_process(nats_server, redis_server, prefix, tmp_path / "b.log")
            # The standby is up and waiting on the lease; what it will restore has every doc.
            await eventually(lambda: "standing by" in (tmp_path / "b.log").read_text(),
                             timeout=30)
            await eventually_async(lambda: _persisted(client, prefix, docs, owners))

            results: list = []

            async def stream() -> None:
                for i in range(60):
                    name = f"doc{i % 4}"
                    r = await _route_retrying(bus, f"s{i}", docs[name] + [i] * 32)
                    results.append((name, r))
                    await asyncio.sleep(0.05)

            streamer = asyncio.create_task(stream())
            await eventually(lambda: len(results) >= 4)  # the active routes the stream
            killed_after = len(results)
            active.signal(signal.SIGKILL)
            await streamer
            assert len(results) == 60  # none lost: every request got a worker
            after = results[killed_after + 1:]  # (one may have been answered as it died)
            assert after, "no request was routed after the kill"
            # The standby restored the tree: known prefixes still go to their workers.
            late = after[-8:]
            assert all(r.worker_id == owners[n] and r.decision == "exploit" for n, r in late)
    finally:
        active.stop()
        if standby is not None:
            standby.stop()
        await client.aclose()


async def test_routing_survives_redis_going_down_and_persists_again_after(
        bus, nats_server, prefix, tmp_path):
    port = free_port()
    redis_proc, redis_url = start_redis(port=port, data_dir=tmp_path)
    cfg = SchedulerConfig(nats_url=nats_server, redis_url=redis_url, subject_prefix=prefix,
                          redis_prefix=prefix, load_interval_s=FAST_LOAD_INTERVAL_S,
                          persist_interval_s=0.1)
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
            assert sched.active
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
                # The lease is re-taken too, so a standby would not also become active.
                async def lease_held() -> bool:
                    return await client.get(sched.lease_key) == sched.instance_id.encode()

                await eventually_async(lease_held)
            finally:
                await client.aclose()
    finally:
        redis_proc.stop()


async def test_a_draining_scheduler_does_not_take_its_lease_back(nats_server, redis_server,
                                                                  prefix):
    """drain() releases the lease for the standby; the lease loop must not re-take it in the
    moments before the process exits (it would keep the standby waiting a whole TTL)."""
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
