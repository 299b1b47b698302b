"""What the scheduler service consumes from the bus: KV event sequence numbers (gaps,
restarts, lost tails -> resync requests), AllBlocksCleared, and worker liveness from load
reports (dropped after 3 missed reports, re-added when it reports again). The workers here
are the test itself publishing on their subjects, so every message is under its control."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.wire import (
    ROUTE_REPLY,
    WORKER_REQUEST,
    AllBlocksCleared,
    BlockStored,
    KvEventBatch,
    LoadReportEvent,
    ResyncRequest,
    SamplingParams,
    SubmitReply,
    TokenizedRequest,
)
from tests.helpers import eventually, running

pytestmark = pytest.mark.timeout(60)

LOAD_INTERVAL_S = 0.1
DOC = list(range(3_000, 3_000 + 64 * BLOCK_SIZE))


@pytest.fixture
async def sched(nats_server, redis_server, prefix):
    cfg = SchedulerConfig(nats_url=nats_server, redis_url=redis_server, subject_prefix=prefix,
                          redis_prefix=prefix, load_interval_s=LOAD_INTERVAL_S,
                          resync_min_interval_s=0.0)
    s = SchedulerService(cfg)
    async with running(s):
        yield s


async def report(bus: Bus, w: str, kv_seq: int = 0, engine_id: str = "") -> None:
    await bus.publish(bus.subjects.load(w), LoadReportEvent(
        worker_id=w, ts=time.time(), total_blocks=10_000, free_blocks=10_000, kv_seq=kv_seq,
        engine_id=engine_id))


async def kv(bus: Bus, w: str, seq: int, events: list, engine_id: str = "") -> None:
    await bus.publish(bus.subjects.kv(w), KvEventBatch(worker_id=w, seq=seq, ts=time.time(),
                                                       events=events, engine_id=engine_id))


def stored(tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=block_hashes(tokens), parent_block_hash=None, token_ids=[],
                       block_size=BLOCK_SIZE)


async def route(bus: Bus, rid: str, tokens: list[int]):
    return await bus.request(bus.subjects.route, TokenizedRequest(
        request_id=rid, token_ids=tokens, block_hashes=block_hashes(tokens),
        sampling=SamplingParams(max_tokens=4)), ROUTE_REPLY, 5)


def resyncs_sent() -> float:
    """Resync requests the schedulers of this process have sent (their counter)."""
    return REGISTRY.get_sample_value("prefixmesh_scheduler_resyncs_total") or 0.0


async def resync_inbox(bus: Bus, w: str) -> list[ResyncRequest]:
    got: list[ResyncRequest] = []

    async def on(msg) -> SubmitReply:
        if isinstance(msg, ResyncRequest):
            got.append(msg)
        return SubmitReply(request_id="", worker_id=w)

    await bus.serve(bus.subjects.worker_resync(w), WORKER_REQUEST, on,
                    lambda why: SubmitReply(request_id="", worker_id=w, accepted=False))
    return got


async def test_kv_sequence_gaps_restarts_and_lost_tails_ask_for_a_resync(bus, sched):
    asked = await resync_inbox(bus, "a")
    await report(bus, "a")
    await report(bus, "b")
    await eventually(lambda: set(sched.policy.workers) == {"a", "b"})
    await kv(bus, "a", 1, [stored(DOC)])
    await eventually(lambda: sched.kv_seq.get("a") == 1)
    r = await route(bus, "r0", DOC + [7] * 16)
    assert (r.worker_id, r.decision) == ("a", "exploit")
    assert asked == []  # in order so far
    # Batch 2 is lost: batch 3 reveals the gap.
    await kv(bus, "a", 3, [])
    await eventually(lambda: len(asked) == 1)
    assert "gap 1 -> 3" in asked[0].reason
    # The worker answers with its whole cache, which no longer holds DOC.
    await kv(bus, "a", 4, [AllBlocksCleared()])
    await eventually(lambda: sched.kv_seq.get("a") == 4)
    r = await route(bus, "r1", DOC + [8] * 16)
    assert r.decision != "exploit" and r.matched_tokens == 0
    # The worker restarted: its sequence starts over.
    await kv(bus, "a", 1, [])
    await eventually(lambda: len(asked) == 2)
    assert "restart" in asked[1].reason
    # Its last batch (2) is lost and nothing follows: two load reports naming seq 2 tell.
    # One report alone asks nothing (it may just have overtaken the batch): b's report,
    # published after it, is handled after it (one subscription, in order).
    resyncs, seen_b = resyncs_sent(), sched.last_seen.get("b", float("-inf"))
    await report(bus, "a", kv_seq=2)
    await report(bus, "b")
    await eventually(lambda: sched.last_seen.get("b", float("-inf")) > seen_b)
    assert resyncs_sent() == resyncs and len(asked) == 2
    await report(bus, "a", kv_seq=2)
    await eventually(lambda: len(asked) == 3)
    assert "tail" in asked[2].reason


async def test_first_contact_after_a_takeover_asks_for_a_resync(bus, sched):
    asked = await resync_inbox(bus, "c")
    await report(bus, "c", kv_seq=41)
    await kv(bus, "c", 42, [stored(DOC)])
    await eventually(lambda: len(asked) == 1)
    assert asked[0].reason == "first contact"


async def test_silent_worker_is_dropped_and_re_added_when_it_reports_again(bus, sched):
    stop_b = asyncio.Event()

    async def reporter(w: str, until: asyncio.Event) -> None:
        while not until.is_set():
            await report(bus, w)
            await asyncio.sleep(LOAD_INTERVAL_S)

    never = asyncio.Event()
    ta = asyncio.create_task(reporter("a", never))
    tb = asyncio.create_task(reporter("b", stop_b))
    try:
        await eventually(lambda: set(sched.policy.workers) == {"a", "b"})
        await kv(bus, "b", 1, [stored(DOC)])
        await eventually(lambda: sched.kv_seq.get("b") == 1)
        assert (await route(bus, "r0", DOC + [1] * 16)).worker_id == "b"
        stop_b.set()
        await tb
        # 3 missed reports (0.3 s): b leaves routing and the cache model.
        await eventually(lambda: set(sched.policy.workers) == {"a"}, timeout=5)
        picks = {(await route(bus, f"s{i}", DOC + [i] * 16)).worker_id for i in range(4)}
        assert picks == {"a"}
        # b reports again: it is routable again.
        tb = asyncio.create_task(reporter("b", asyncio.Event()))
        await eventually(lambda: set(sched.policy.workers) == {"a", "b"}, timeout=5)
        picks = {(await route(bus, f"t{i}", list(range(90_000 + 64 * i, 90_000 + 64 * i + 640)))
                  ).worker_id for i in range(8)}
        assert "b" in picks
    finally:
        never.set()
        tb.cancel()
        await asyncio.gather(ta, tb, return_exceptions=True)


async def test_an_engine_restart_drops_its_stale_blocks_at_once(bus, sched):
    """A sequence that starts again is a new engine: what the old one cached is gone, even
    before the resync it is asked for comes back (that worker never answers here)."""
    await report(bus, "r")
    await eventually(lambda: "r" in sched.policy.workers)
    await kv(bus, "r", 1, [stored(DOC)])
    await kv(bus, "r", 2, [])
    await eventually(lambda: sched.kv_seq.get("r") == 2)
    assert (await route(bus, "x0", DOC + [3] * 16)).decision == "exploit"
    await kv(bus, "r", 1, [])  # restarted: its first batch, nothing about DOC
    await eventually(lambda: sched.kv_seq.get("r") == 1)
    node, _ = sched.policy.tree.match(block_hashes(DOC))
    assert "r" not in node.workers
    r = await route(bus, "x1", DOC + [4] * 16)
    assert r.matched_tokens == 0


async def _cached_on(bus: Bus, sched, w: str, engine_id: str) -> None:
    """``w`` (engine ``engine_id``) joins and caches DOC; the scheduler exploits it."""
    await report(bus, w, engine_id=engine_id)
    await eventually(lambda: w in sched.policy.workers)
    await kv(bus, w, 1, [stored(DOC)], engine_id=engine_id)
    await eventually(lambda: sched.kv_seq.get(w) == 1)
    assert (await route(bus, "x0", DOC + [3] * 16)).decision == "exploit"


async def test_a_new_engine_id_in_a_load_report_drops_the_stale_blocks(bus, sched):
    """An engine that restarted and has cached nothing yet sends no KV event: its load
    report's new engine id is what tells the scheduler its cache is empty."""
    await _cached_on(bus, sched, "e", "engine-1")
    await report(bus, "e", engine_id="engine-2")
    await eventually(lambda: sched.engines.ids.get("e") == "engine-2")
    node, _ = sched.policy.tree.match(block_hashes(DOC))
    assert "e" not in node.workers and sched.kv_seq.get("e") is None
    assert (await route(bus, "x1", DOC + [4] * 16)).matched_tokens == 0
    # The new engine's own events count from its first batch: no gap, no restart.
    before = resyncs_sent()
    await kv(bus, "e", 1, [stored(DOC)], engine_id="engine-2")
    await eventually(lambda: sched.kv_seq.get("e") == 1)
    assert (await route(bus, "x2", DOC + [5] * 16)).decision == "exploit"
    assert resyncs_sent() == before


async def test_a_new_engine_id_in_kv_events_drops_the_stale_blocks(bus, sched):
    """Caught from the KV batch too (it may come before the next load report), even when
    its sequence number happens to follow the old engine's."""
    await _cached_on(bus, sched, "k", "engine-1")
    await kv(bus, "k", 2, [], engine_id="engine-2")
    await eventually(lambda: sched.engines.ids.get("k") == "engine-2")
    node, _ = sched.policy.tree.match(block_hashes(DOC))
    assert "k" not in node.workers
    # The same engine again changes nothing.
    await kv(bus, "k", 3, [stored(DOC)], engine_id="engine-2")
    await eventually(lambda: sched.kv_seq.get("k") == 3)
    await report(bus, "k", kv_seq=3, engine_id="engine-2")
    await asyncio.sleep(0.2)
    node, _ = sched.policy.tree.match(block_hashes(DOC))
    assert "k" in node.workers
