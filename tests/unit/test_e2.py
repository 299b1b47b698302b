"""E2 (docs/design.md section 5): exploit, explore, prefill/decode balancing, the load
cost L + M + P, rebalancing, hot-prefix replication, KV-event feedback and snapshots."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from prefixmesh.services.scheduler.policies.base import NoWorkerError, PolicyConfig
from prefixmesh.services.scheduler.policies.e2 import E2Policy
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes
from prefixmesh.shared.wire import (
    AllBlocksCleared,
    BlockRemoved,
    LoadReportEvent,
    RequestDoneEvent,
)
from tests.helpers import default_cost, e2_policy, route_input, toks

COST = default_cost()
req = route_input
make = e2_policy


def others(p: E2Policy, keep: str) -> set[str]:
    return {w for w in p.workers if w != keep}


# --------------------------------------------------------------------------- exploit / explore


def test_exploit_routes_to_the_caching_worker():
    p = make()
    prefix = toks(1, 100)
    first = p.route(req("r0", prefix, toks(1000, 2)), 0.0)
    assert first.kind == "explore" and first.matched_tokens == 0
    for i in range(1, 10):
        d = p.route(req(f"r{i}", prefix, toks(1000 + i, 2)), 0.1 * i)
        assert (d.worker_id, d.kind) == (first.worker_id, "exploit")
        assert d.matched_tokens == 100 * BLOCK_SIZE
    # A short shared head does not outweigh a long new part: explore, not exploit.
    d = p.route(req("r-long", prefix[: 10 * BLOCK_SIZE], toks(2000, 40)), 1.0)
    assert d.kind == "explore"


def test_explore_spreads_cold_prompts_by_load():
    p = make()
    got = Counter(p.route(req(f"r{i}", toks(i, 40)), 0.01 * i).worker_id for i in range(8))
    assert sorted(got.values()) == [2, 2, 2, 2]
    # Three workers made heavy by huge prompts: the next cold prompts all go to the fourth,
    # whatever order ties would be broken in (each short one done before the next, as
    # the first eight are: only the huge ones stay in flight).
    for i in range(8):
        p.on_done(RequestDoneEvent(request_id=f"r{i}", worker_id=p.window.by_rid[f"r{i}"].ws.id,
                                   completion_tokens=64), 0.5)
    for i, w in enumerate(("w0", "w1", "w2")):
        p.route(req(f"big{i}", toks(99 + i, 600), exclude=others(p, w)), 1.0)
    later = []
    for i in range(4):
        later.append(p.route(req(f"s{i}", toks(200 + i, 40)), 1.1 + i).worker_id)
        p.on_done(RequestDoneEvent(request_id=f"s{i}", worker_id=later[-1],
                                   completion_tokens=64), 1.6 + i)
    assert later == ["w3"] * 4


def test_no_eligible_worker_raises():
    p = make(2)
    with pytest.raises(NoWorkerError):
        p.route(req("r", toks(1, 4), exclude={"w0", "w1"}), 0.0)
    with pytest.raises(NoWorkerError):
        make(0).route(req("r", toks(1, 4)), 0.0)
    # Excluding the caching worker sends the request elsewhere.
    prefix = toks(2, 50)
    w = p.route(req("a", prefix, toks(3, 1)), 0.0).worker_id
    d = p.route(req("b", prefix, toks(4, 1), exclude={w}), 0.1)
    assert d.worker_id != w


# --------------------------------------------------------------------------- KV feedback


def test_evicted_prefix_stops_attracting_exploit_routing():
    p = make()
    prefix = toks(1, 100)
    r = req("r0", prefix, toks(10, 2))
    w = p.route(r, 0.0).worker_id
    assert p.route(req("r1", prefix, toks(11, 2)), 0.1).kind == "exploit"
    # The worker evicts the prefix's first block: nothing of it is usable there any more.
    p.on_kv_events(w, [BlockRemoved(block_hashes=[r.block_hashes[0]])], 0.2)
    d = p.route(req("r2", prefix, toks(12, 2)), 0.3)
    # Cached nowhere: not an exploit (it may still go back to w by affinity).
    assert d.kind in ("explore", "affinity") and d.matched_tokens == 0
    # A whole-cache reset does the same for another prefix.
    other = toks(2, 100)
    w2 = p.route(req("o0", other, toks(20, 2)), 1.0).worker_id
    p.on_kv_events(w2, [AllBlocksCleared()], 1.1)
    assert p.route(req("o1", other, toks(21, 2)), 1.2).kind in ("explore", "affinity")


@pytest.mark.parametrize("events, knobs, queue_s, kept", [
    ([], {}, 0.0, False),  # no KV events: the LRU model evicts the first document
    # A reset the service passes on the worker's behalf (engine restart) is not the
    # worker's own event: the model stays.
    ([AllBlocksCleared()], {}, 0.0, False),
    # KV events and a queue (model_eviction_queue_s, 1 s): only its BlockRemoved evict ...
    ([BlockRemoved(block_hashes=[7])], {}, 3.0, True),
    # ... and with a short queue the model evicts: what is routed there runs soon.
    ([BlockRemoved(block_hashes=[7])], {}, 0.2, False),
    ([BlockRemoved(block_hashes=[7])], {"model_eviction_queue_s": 0.0}, 0.2, True),
    # An unbounded queue time: the model evicts at any queue.
    ([BlockRemoved(block_hashes=[7])], {"model_eviction_queue_s": math.inf}, 3.0, False),
])
def test_routing_models_eviction_without_kv_events_or_behind_a_short_queue(
        events, knobs, queue_s, kept):
    # One worker of 100 blocks, sent two 60-block documents: past its capacity, the model
    # would drop the first, least recently routed. A worker that sends KV events and
    # reports a queue has not said it evicted anything, so the first stays in the tree
    # (and its next question is an exploit) until a BlockRemoved comes.
    p = make(1, PolicyConfig(**knobs), capacity=100 * BLOCK_SIZE)
    first, second = toks(1, 60), toks(2, 60)
    if events:
        p.on_kv_events("w0", events, 0.0)
    p.on_load(LoadReportEvent(worker_id="w0", ts=0.05, avg_queue_s=queue_s), 0.05)
    p.route(req("a", first, toks(10, 1)), 0.1)
    p.route(req("b", second, toks(11, 1)), 0.2)
    assert bool(p.tree.cached_depths(*p.tree.match(block_hashes(first)))) is kept
    d = p.route(req("c", first, toks(12, 1)), 0.3)
    assert (d.kind == "exploit") is kept
    if kept:
        p.on_kv_events("w0", [BlockRemoved(block_hashes=block_hashes(first)[:1])], 0.4)
        assert not p.tree.cached_depths(*p.tree.match(block_hashes(first)))


def test_removed_worker_leaves_routing_and_the_tree():
    p = make(3)
    prefix = toks(1, 100)
    w = p.route(req("r0", prefix, toks(10, 2)), 0.0).worker_id
    p.remove_worker(w, 0.5)
    assert w not in p.workers
    chosen = {
        p.route(req(f"r{i}", prefix, toks(10 + i, 2)), 1.0 + i).worker_id for i in range(1, 6)
    }
    assert w not in chosen
    assert all(w not in n.workers for n in p.tree.nodes())


def test_removed_worker_stays_out_when_its_window_entries_expire():
    p = make(3, PolicyConfig(window_s=10.0))
    for i in range(5):
        p.route(req(f"a{i}", toks(1, 100), toks(10 + i, 2), exclude={"w1", "w2"}), 0.1 * i)
    p.remove_worker("w0", 1.0)
    chosen = Counter()
    for i in range(300):  # heavy exploit traffic: rebalancing looks for the lightest worker
        d = p.route(req(f"b{i}", toks(2, 250), toks(1000 + i, 62)), 2.0 + 0.1 * i)
        chosen[d.worker_id] += 1
    assert "w0" not in chosen and chosen["w1"] and chosen["w2"]


# ------------------------------------------------------------------ prefill / decode balance


def test_decode_heavy_worker_receives_the_next_cold_request():
    p = make()
    assert p.route(req("r0", toks(1, 40)), 0.0).kind == "explore"
    p.on_load(LoadReportEvent(worker_id="w2", ts=1.0, decode_share=0.9), 1.0)
    d = p.route(req("r1", toks(2, 40)), 1.1)
    assert (d.worker_id, d.kind) == ("w2", "pd_balance")
    # One cold request per report: the next one is explored normally.
    assert p.route(req("r2", toks(3, 40)), 1.2).kind == "explore"
    # A stale report does not count.
    p.on_load(LoadReportEvent(worker_id="w2", ts=2.0, decode_share=0.9), 2.0)
    assert p.route(req("r3", toks(4, 40)), 2.0 + 10 * p.cfg.load_report_stale_s).kind == "explore"
    # A prefill-dominated worker is not a target.
    p.on_load(LoadReportEvent(worker_id="w1", ts=50.0, decode_share=0.2), 50.0)
    assert p.route(req("r4", toks(5, 40)), 50.1).kind == "explore"



def test_equally_light_decode_heavy_workers_tie_to_the_smallest_id():
    # Eight idle decode-dominated workers (L = 0 on each), reported in reverse order: the
    # cold request goes to w0 whatever order the process's string hashing gives the set.
    p = make(8)
    for i in reversed(range(8)):
        p.on_load(LoadReportEvent(worker_id=f"w{i}", ts=1.0, decode_share=0.9), 1.0)
    d = p.route(req("r1", toks(2, 40)), 1.1)
    assert (d.worker_id, d.kind) == ("w0", "pd_balance")


@pytest.mark.parametrize("needs_room, kind", [(True, "explore"), (False, "pd_balance")])
def test_a_decode_heavy_worker_with_a_queue_takes_no_cold_request_when_it_needs_room(
        needs_room, kind):
    p = make(3, PolicyConfig(pd_needs_room=needs_room))
    # Decode-dominated but with requests waiting (its KV full): no spare prefill capacity.
    p.on_load(LoadReportEvent(worker_id="w2", ts=1.0, decode_share=0.9, waiting=3), 1.0)
    assert p.route(req("r1", toks(2, 40)), 1.1).kind == kind
    # Once its queue is gone it is a target again either way.
    p.on_load(LoadReportEvent(worker_id="w2", ts=2.0, decode_share=0.9), 2.0)
    d = p.route(req("r2", toks(3, 40)), 2.1)
    assert (d.worker_id, d.kind) == ("w2", "pd_balance")

# --------------------------------------------------------------------------- load cost


def test_load_is_incremental_and_expires_with_the_window():
    p = make(2, PolicyConfig(window_s=100.0))
    w0 = p.worker_state("w0")

    def cost(tokens: int, out: float) -> float:
        return COST.prefill_time(tokens) + COST.marginal_decode_time(tokens, 32) * out

    c1, c2 = cost(512, 10), cost(1024, 5)
    p.route(req("a", toks(1, 32), out=10, exclude={"w1"}), 0.0)
    assert w0.L == pytest.approx(c1) and w0.n == 1
    p.route(req("b", toks(2, 64), out=5, exclude={"w1"}), 50.0)
    assert w0.L == pytest.approx(c1 + c2) and w0.n == 2
    # DT is the marginal cost in a batch, far below a lone sequential decode step.
    assert COST.marginal_decode_time(1024, 32) < COST.decode_time(1024) / 10
    # Routing elsewhere after the window passed "a" expires it (and only it).
    p.route(req("c", toks(3, 8), exclude={"w0"}), 100.5)
    assert w0.L == pytest.approx(c2) and w0.n == 1
    p.tick(151.0)
    assert w0.L == 0.0 and w0.n == 0
    # A completion record replaces the predicted output by the real one.
    p.route(req("d", toks(4, 32), out=10, exclude={"w1"}), 200.0)
    p.on_done(
        RequestDoneEvent(request_id="d", worker_id="w0", prompt_tokens=512, cached_tokens=0,
                         completion_tokens=30),
        201.0,
    )
    assert w0.L == pytest.approx(cost(512, 30))
    # Without a prediction, the windowed average output length is charged.
    p.route(req("e", toks(5, 32), exclude={"w1"}), 202.0)
    assert w0.L == pytest.approx(2 * cost(512, 30))


def test_a_hit_is_charged_its_prefill_after_the_cached_prefix():
    # 4 blocks after a 1,600-block document: each chunk attends to the 25,600 cached
    # tokens, which a PT from scratch leaves out.
    doc, tail = toks(1, 1600), toks(2, 4)
    charged = {}
    for after in (True, False):
        p = make(1, PolicyConfig(pt_after_cached=after))
        p.route(req("doc", doc, toks(3, 1), out=1), 0.0)
        w0 = p.worker_state("w0")
        before = w0.L
        assert p.route(req("hit", doc, tail, out=1), 1.0).kind == "exploit"
        charged[after] = w0.L - before - COST.marginal_decode_time(1604 * BLOCK_SIZE, 32)
    assert charged[True] == pytest.approx(COST.prefill_time(4 * BLOCK_SIZE, 1600 * BLOCK_SIZE))
    assert charged[False] == pytest.approx(COST.prefill_time(4 * BLOCK_SIZE))
    assert charged[True] > 2 * charged[False]


@pytest.mark.parametrize("cap, home", [(20.0, "w0"), (0.0, "w1")])
def test_saturated_workers_compare_by_what_the_request_costs_there(cap, home):
    # w0 past saturation (L = 1.05 H), w1 just below it (L = 0.95 H): uncapped, the load
    # term prices w0 at L (105 s) and w1 at the M/M/1 delay, 95 s here; capped at 20 s,
    # both cost the cap and the prefix w0 caches decides.
    p = make(2, PolicyConfig(window_s=100.0, load_wait_cap_s=cap))
    prefix = toks(1, 40)

    def load(worker: str, target: float, first: list[int]) -> None:
        rest = [w for w in p.workers if w != worker]
        for i in range(5):  # five requests of target / 5 seconds each, outputs to come
            prompt = first if i == 0 else toks(100 + 10 * len(rest[0]) + i, 8)
            ctx = len(prompt) + BLOCK_SIZE
            out = (target / 5 - COST.prefill_time(ctx)) / COST.marginal_decode_time(ctx, 32)
            p.route(req(f"{worker}-{i}", prompt, toks(200 + i, 1), out=out,
                        max_tokens=1 << 30, exclude=rest), 0.1 * i)

    load("w0", 105.0, prefix)
    load("w1", 95.0, toks(7, 8))
    assert p.worker_state("w0").L == pytest.approx(105.0)
    assert p.worker_state("w1").L == pytest.approx(95.0)
    cold = req("r", prefix, toks(9, 60), out=10)  # 40 of 100 blocks cached: explore
    d = p.route(cold, 2.0)
    assert (d.worker_id, d.kind) == (home, "explore")


def test_eviction_term_penalises_evicting_a_heavily_shared_prefix():
    # Both workers cache 135 blocks of 140; a cold 125-block prompt forces each to evict.
    # On w0 that is a prefix all of its window requests share; on w1 one used once.
    p = make(2, capacity=140 * BLOCK_SIZE)
    shared = toks(1, 125)
    for i in range(10):
        p.route(req(f"a{i}", shared, toks(100 + i, 1), out=1, exclude={"w1"}), 0.1 * i)
    p.route(req("b0", toks(2, 125), toks(200, 1), out=20, exclude={"w0"}), 1.0)
    for i in range(9):
        p.route(req(f"b{i + 1}", toks(300 + i, 1), out=1, exclude={"w0"}), 1.1 + 0.1 * i)
    cold = req("cold", toks(3, 125))
    (l0, m0, p0), (l1, m1, p1) = (p.explain(cold, 3.0)[w] for w in ("w0", "w1"))
    assert p0 == p1 and l0 < l1  # w0 is lighter and would win on L + P alone ...
    assert m0 > m1 + (l1 - l0)  # ... but evicting its shared prefix costs more
    assert m0 == pytest.approx(COST.prefill_time(2000) + COST.prefill_time(16), rel=0.01)
    assert p.route(cold, 3.0).worker_id == "w1"


# ------------------------------------------------------------------ rebalance and replication


@pytest.mark.parametrize("th_bal, spreads", [(1.5, True), (float("inf"), False)])
def test_rebalancing_moves_exploit_traffic_from_an_overloaded_worker(th_bal, spreads):
    p = make(cfg=PolicyConfig(th_bal=th_bal))
    prefix = toks(1, 250)
    kinds: Counter = Counter()
    per_worker: Counter = Counter()
    for i in range(150):
        d = p.route(req(f"r{i}", prefix, toks(1000 + i, 62)), 0.1 * i)
        kinds[d.kind] += 1
        per_worker[d.worker_id] += 1
    loads = [p.worker_state(w).L for w in p.workers]
    if spreads:
        # Once the caching worker is busy and 1.5x heavier than the lightest, its traffic
        # moves on; the prefix ends up on several workers and none runs far ahead.
        busy = p.cfg.rebalance_min_util * p.cfg.window_s
        assert kinds["rebalance"] >= 2 and len(per_worker) >= 3
        assert max(loads) < busy + 1.0
    else:
        assert len(per_worker) == 1 and kinds["rebalance"] == 0 and max(loads) > 20.0


def _zipf_run(cfg: PolicyConfig, seconds: float, hot_on: bool, p: E2Policy | None = None,
              t0: float = 0.0, hot_worker: list | None = None) -> E2Policy:
    """Zipf(1.3) traffic over 20 prefixes on 4 workers at 20 req/s; the hottest prefix's
    worker reports a queueing time that doubles halfway through."""
    p = p or make(cfg=cfg)
    rng = random.Random(7)
    prefixes = [toks(10 + k, 100) for k in range(20)]
    weights = [1 / (k + 1) ** 1.3 for k in range(20)]
    t = t0
    i = 0
    while t < t0 + seconds:
        k = rng.choices(range(20), weights)[0]
        if k == 0 and not hot_on:
            k = 1 + rng.randrange(19)
        d = p.route(req(f"z{t:.2f}", prefixes[k], toks(50_000 + i, 4)), t)
        if k == 0 and hot_worker is not None and not hot_worker:
            hot_worker.append(d.worker_id)
        if int(t * 20) % 20 == 0:  # once a second: load reports and maintenance
            for w in p.workers:
                slow = hot_on and hot_worker and w == hot_worker[0] and t > seconds / 2
                p.on_load(LoadReportEvent(worker_id=w, ts=t, avg_queue_s=0.5 if slow else 0.05), t)
            p.tick(t)
        t += 0.05
        i += 1
    return p


@pytest.mark.parametrize("max_workers, replicated", [(8, True), (1, False)])
def test_zipf_hot_prefix_ends_up_on_several_workers(max_workers, replicated):
    # Route-time rebalancing off: only replication can spread the hot prefix.
    cfg = PolicyConfig(th_bal=float("inf"), window_s=60.0, replicate_cooldown_s=5.0,
                       replicate_max_workers=max_workers)
    hot: list[str] = []
    p = _zipf_run(cfg, 120.0, True, hot_worker=hot)
    node, m = p.tree.match(block_hashes(toks(10, 100)))
    assert m == 100
    if not replicated:
        assert set(node.workers) == {hot[0]}
        return
    assert len(node.workers) >= 2 and p.replicator.grown >= 1
    # Shrink back: the hot prefix's traffic stops, the queue is back to normal.
    before = len(node.workers)
    _zipf_run(cfg, 150.0, False, p=p, t0=120.0, hot_worker=hot)
    assert p.replicator.shrunk >= 1 and len(node.workers) < before


# --------------------------------------------------------------------------- persistence


def test_snapshot_restore_round_trip_on_another_clock():
    p = make(cfg=PolicyConfig(window_s=100.0))
    prefix = toks(1, 100)
    for i in range(6):
        p.route(req(f"r{i}", prefix if i % 2 else toks(50 + i, 60), toks(10 + i, 2)), 1000.0 + i)
    data = p.state.snapshot()
    q = E2Policy(PolicyConfig(window_s=100.0), COST)
    q.state.restore(data)
    assert set(q.workers) == set(p.workers)
    probe = req("probe", prefix, toks(99, 2))
    # The restored copy runs on a clock 995 s behind: times are rebased, nothing expires.
    before, after = p.explain(probe, 1005.0), q.explain(probe, 10.0)
    assert before.keys() == after.keys()
    for w in before:
        assert after[w] == pytest.approx(before[w])
    d1, d2 = p.route(probe, 1005.0), q.route(probe, 10.0)
    assert (d1.worker_id, d1.kind, d1.matched_tokens) == (d2.worker_id, d2.kind, d2.matched_tokens)
    for w in p.workers:
        assert q.worker_state(w).n == p.worker_state(w).n
        # Each output token is priced on the worker's GPU from the start, not from its
        # first load report.
        assert q.worker_state(w).step_s == p.worker_state(w).step_s > 0
    # Restored requests await their completion records but do not count as in flight (a
    # snapshot does not say which are done): the count starts again from new decisions.
    assert sum(p.worker_state(w).inflight for w in p.workers) == 7
    assert q.worker_state(d2.worker_id).inflight == 1
    assert sum(q.worker_state(w).inflight for w in q.workers) == 1
    # ... and the window still expires on the new clock.
    q.tick(200.0)
    assert all(q.worker_state(w).L == 0.0 for w in q.workers)
    assert all(q.worker_state(w).inflight == 0 for w in q.workers)


def test_memory_stays_bounded_under_an_endless_stream_of_unique_prompts():
    # tree_budget_factor=0: the configured budget, not the cluster's cache, bounds the tree.
    cfg = PolicyConfig(tree_max_nodes=200, tree_max_tokens=200 * 8 * BLOCK_SIZE, window_s=5.0,
                       tree_budget_factor=0.0)
    p = make(4, cfg)
    hard = 200 + 200 // 8
    for i in range(3_000):
        p.route(req(f"u{i}", toks(i, 8)), 0.01 * i)
        if i % 20 == 0:
            p.tick(0.01 * i)
        assert len(p.tree) <= hard and p.tree.n_blocks <= hard * 8
    # The window holds at most H seconds of requests, so nothing else grows either.
    assert len(p.window.entries) <= 5.0 / 0.01 + 1 and len(p.window.by_rid) <= 501
    assert p.tree.budget_evictions > 0
