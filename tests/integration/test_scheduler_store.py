"""Incremental write-behind of the policy state to a real Redis (services/scheduler/store.py)."""

from __future__ import annotations

import asyncio
import functools

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from prefixmesh.services.scheduler.policies import make_policy
from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.scheduler.policies.e2 import E2Policy
from prefixmesh.services.scheduler.store import RespBatch, StateStore, StoreLimits
from prefixmesh.shared.wire import BlockRemoved, RequestDoneEvent
from tests.helpers import default_cost, route_input, toks

pytestmark = pytest.mark.timeout(60)

COST = default_cost()
# Virtual wall clock of the tests (the policies run on virtual time too).
EPOCH = 1.7e9


req = functools.partial(route_input, max_tokens=32)


@pytest.fixture
async def client(redis_server: str):
    c = aioredis.from_url(redis_server)
    yield c
    await c.aclose()


def drive(p, start: int, n: int, t0: float) -> float:
    """Shared prefixes, unique tails, completions and an eviction now and then."""
    prefixes = [toks(k, 40 + 10 * k) for k in range(6)]
    t = t0
    for i in range(start, start + n):
        t += 0.05
        r = req(f"r{i}", prefixes[i % 6], toks(10_000 + i, 1 + i % 3))
        d = p.route(r, t)
        if i % 4 == 0:
            p.on_done(RequestDoneEvent(request_id=r.request_id, worker_id=d.worker_id,
                                       prompt_tokens=r.prompt_tokens, cached_tokens=0,
                                       completion_tokens=5 + i % 7), t)
        if i % 37 == 0:
            p.on_kv_events(d.worker_id, [BlockRemoved(block_hashes=[r.block_hashes[-1]])], t)
        if i % 50 == 0:
            p.tick(t)
    return t


def lru(p, w: str) -> list[tuple[int, tuple[int, ...]]]:
    return [(n.start, n.hashes) for n in p.tree.worker_lru(w)]


def assert_same(p: E2Policy, q: E2Policy, now: float, shift: float = 0.0) -> None:
    assert set(q.workers) == set(p.workers)
    assert len(q.tree) == len(p.tree) and q.tree.n_blocks == p.tree.n_blocks
    for w in p.workers:
        assert lru(q, w) == lru(p, w)
        a, b = p.worker_state(w), q.worker_state(w)
        assert (b.n, b.L) == (a.n, pytest.approx(a.L))
    assert len(q.window.entries) == len(p.window.entries)
    assert q.window.out_sum == p.window.out_sum
    for k in range(6):
        probe = req(f"probe{k}", toks(k, 40 + 10 * k), toks(99, 2))
        e1, e2 = p.explain(probe, now), q.explain(probe, now + shift)
        for w in e1:
            assert e2[w] == pytest.approx(e1[w])


async def test_incremental_flushes_restore_the_same_e2_state(client, prefix):
    cfg = PolicyConfig(window_s=20.0)
    p = E2Policy(cfg, COST)
    for i in range(4):
        p.add_worker(f"w{i}", 60_000, 0.0)
    t = 0.0
    store = StateStore(client, f"{prefix}:e2", clock=lambda: t, wall=lambda: t + EPOCH)
    p.state.track_changes()
    fulls = []
    for step in range(4):  # 4 flushes: the first is full, the rest incremental
        t = drive(p, step * 150, 150, t)
        fulls.append((await store.flush(p)).full)
    assert fulls == [True, False, False, False]
    # The window moved on: early entries expired, their nodes' counts were released.
    assert p.window.entries[0].t > 5.0
    assert store.last.gone > 0 and store.last.expired > 0
    q = E2Policy(cfg, COST)
    # A standby whose clock reads 1000 s more: times are mapped onto it.
    assert await StateStore(client, f"{prefix}:e2", clock=lambda: t + 1000.0,
                            wall=lambda: t + EPOCH).load(q)
    assert_same(p, q, t, 1000.0)
    probe = req("again", toks(2, 60), toks(5, 2))
    d1, d2 = p.route(probe, t + 0.1), q.route(probe, t + 1000.1)
    assert (d1.worker_id, d1.kind, d1.matched_tokens) == (d2.worker_id, d2.kind, d2.matched_tokens)


async def test_flush_is_sliced_so_routing_runs_during_it(client, prefix):
    p = E2Policy(PolicyConfig(), COST)
    for i in range(4):
        p.add_worker(f"w{i}", 0, 0.0)
    for i in range(2_000):  # 2,000 unique prompts: a big tree
        p.route(req(f"u{i}", toks(i, 8)), 0.001 * i)
    store = StateStore(client, f"{prefix}:e2", StoreLimits(slice_nodes=64, slice_log=256),
                       clock=lambda: 3.0)
    routed_during = 0
    flushing = True

    async def router() -> None:
        nonlocal routed_during
        i = 0
        while flushing:
            p.route(req(f"x{i}", toks(50_000 + i, 4)), 3.0 + 0.001 * i)
            routed_during += 1
            i += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(router())
    stats = await store.flush(p)
    flushing = False
    await task
    assert stats.full and stats.slices >= 2_000 // 64
    assert routed_during >= stats.slices // 2
    # What was routed during the full write is in the next (incremental) flush.
    nxt = await store.flush(p)
    assert not nxt.full and nxt.nodes >= 1
    q = E2Policy(PolicyConfig(), COST)
    assert await StateStore(client, f"{prefix}:e2", clock=lambda: 5.0).load(q)
    assert len(q.tree) == len(p.tree) and len(q.window.entries) == len(p.window.entries)


async def test_redis_wiped_between_flushes_gets_a_full_rewrite(client, prefix):
    p = E2Policy(PolicyConfig(), COST)
    for i in range(3):
        p.add_worker(f"w{i}", 0, 0.0)
    t = 0.0
    store = StateStore(client, f"{prefix}:e2", clock=lambda: t, wall=lambda: t + EPOCH)
    t = drive(p, 0, 100, 0.0)
    await store.flush(p)
    t = drive(p, 100, 20, t)
    assert not (await store.flush(p)).full
    await client.delete(store.meta_key, store.nodes_key, store.log_key, store.logidx_key)
    t = drive(p, 120, 20, t)
    assert (await store.flush(p)).full
    q = E2Policy(PolicyConfig(), COST)
    loader = StateStore(client, f"{prefix}:e2", clock=lambda: t, wall=lambda: t + EPOCH)
    assert await loader.load(q)
    assert_same(p, q, t)


@pytest.mark.parametrize("name", ["cache_aware", "kv_cost", "weighted", "round_robin"])
async def test_baseline_state_round_trips_through_the_store(client, prefix, name):
    p = make_policy(name, PolicyConfig(kv_use_events=False), COST)
    for i in range(3):
        p.add_worker(f"w{i}", 0, 0.0)
    store = StateStore(client, f"{prefix}:{name}", clock=lambda: 3.0)
    p.state.track_changes()
    for i in range(30):
        p.route(req(f"r{i}", toks(i % 5, 30), toks(100 + i, 2)), 0.1 * i)
        if i == 10:
            await store.flush(p)
    await store.flush(p)
    q = make_policy(name, PolicyConfig(kv_use_events=False), COST)
    assert await StateStore(client, f"{prefix}:{name}", clock=lambda: 3.0).load(q)
    assert list(q.workers) == list(p.workers) and len(q.tree) == len(p.tree)
    probe = req("probe", toks(3, 30), toks(7, 2))
    assert q.route(probe, 3.5) == p.route(probe, 3.5)


async def test_resp_batch_writes_what_the_commands_say(client, prefix):
    out = RespBatch(client)
    key = f"{prefix}:h"
    out.hset(key.encode(), {1: b"one", 22: b"\x00\r\nbinary", 333: b""})
    out.command(b"HSET", key, 4, "vier")
    out.command(b"ZADD", f"{prefix}:z", 1.7e9 + 0.25, 7)
    out.hdel(key.encode(), [22, 999])  # 999: not there, nothing to delete
    assert out.commands == 4
    await out.send()
    assert out.commands == 0 and not out.parts
    assert await client.hgetall(key) == {b"1": b"one", b"333": b"", b"4": b"vier"}
    assert await client.zrange(f"{prefix}:z", 0, -1, withscores=True) == [(b"7", 1.7e9 + 0.25)]
    await out.send()  # nothing queued: nothing sent


async def test_resp_batch_error_reply_raises_after_every_reply_is_read(client, prefix):
    await client.set(f"{prefix}:s", "a string")
    out = RespBatch(client)
    out.command(b"SET", f"{prefix}:before", 1)
    out.command(b"HSET", f"{prefix}:s", 1, b"x")  # WRONGTYPE
    out.command(b"SET", f"{prefix}:after", 2)
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await out.send()
    # As a pipeline without a transaction: the other commands ran, and the connection,
    # back in the pool, holds no reply of this batch that the next command would read.
    assert await client.mget(f"{prefix}:before", f"{prefix}:after") == [b"1", b"2"]
    assert await client.get(f"{prefix}:s") == b"a string"


async def test_resp_batch_cancelled_mid_reply_leaves_no_reply_behind(redis_server: str,
                                                                      prefix):
    """A flush cancelled while its replies are still coming (the service stopping) must
    not hand its connection back with replies unread: the next command on it would read
    one of them as its own answer."""
    own = aioredis.from_url(redis_server, max_connections=1)
    try:
        await own.set(f"{prefix}:k", "mine")
        out = RespBatch(own)
        out.command(b"BLPOP", f"{prefix}:empty", "0.3")  # answers nil after 0.3 s
        out.command(b"SET", f"{prefix}:later", 1)
        task = asyncio.create_task(out.send())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await own.get(f"{prefix}:k") == b"mine"  # not BLPOP's nil
    finally:
        await own.aclose()
