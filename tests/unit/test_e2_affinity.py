"""E2 fixes from the simulator diagnosis (docs/sim-results.md): the tree budget follows
the cluster's KV capacity, and a prefix evicted everywhere keeps its home worker
(affinity) while that worker's load cost is close to the cheapest."""

from __future__ import annotations

import pytest

from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.scheduler.policies.e2 import E2Policy
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes
from prefixmesh.shared.wire import BlockRemoved
from tests.helpers import e2_policy as make
from tests.helpers import route_input as req
from tests.helpers import toks

# --------------------------------------------------------------------------- tree budget


def test_tree_budget_grows_with_the_cluster_cache() -> None:
    cfg = PolicyConfig(tree_max_tokens=1_000_000, tree_max_nodes=1_000)
    p = make(2, cfg, capacity=200_000)
    # 2 x 200k below the floor: the configured budget stands.
    assert p.tree.max_blocks == 1_000_000 // BLOCK_SIZE
    for i in range(2, 64):
        p.add_worker(f"w{i}", 200_000, 0.0)
    cluster = 64 * (200_000 // BLOCK_SIZE) * BLOCK_SIZE
    assert p.tree.max_blocks * BLOCK_SIZE >= cfg.tree_budget_factor * cluster - BLOCK_SIZE
    assert p.tree.max_nodes > cfg.tree_max_nodes
    for i in range(2, 64):
        p.remove_worker(f"w{i}", 0.0)
    assert p.tree.max_blocks == 1_000_000 // BLOCK_SIZE


def test_prefixes_cached_on_a_big_cluster_are_not_pruned() -> None:
    # 48 workers x 40 blocks cache more than a 256-block tree: every worker's document
    # must stay in the tree (and be exploited) after maintenance.
    cfg = PolicyConfig(tree_max_tokens=256 * BLOCK_SIZE)
    n, doc_blocks = 48, 8
    p = make(n, cfg, capacity=40 * BLOCK_SIZE)
    docs = [toks(1000 + i, doc_blocks) for i in range(n)]
    first = {}
    for i, d in enumerate(docs):
        first[i] = p.route(req(f"a{i}", d, toks(5000 + i, 1)), 0.0).worker_id
    p.tick(1.0)
    for i, d in enumerate(docs):
        dec = p.route(req(f"b{i}", d, toks(7000 + i, 1)), 2.0)
        assert (dec.kind, dec.worker_id) == ("exploit", first[i])


# --------------------------------------------------------------------------- affinity


def _evicted_everywhere(cfg: PolicyConfig) -> tuple[E2Policy, list[int], str]:
    """A document served once by some worker, then evicted from it (KV event)."""
    p = make(4, cfg)
    doc = toks(1, 40)
    d = p.route(req("r0", doc, toks(2, 1)), 0.0)
    p.on_kv_events(d.worker_id, [BlockRemoved(block_hashes=block_hashes(doc))], 0.5)
    assert not p.tree.cached_depths(*p.tree.match(block_hashes(doc)))
    return p, doc, d.worker_id


def test_evicted_prefix_returns_to_the_worker_that_served_it() -> None:
    p, doc, home = _evicted_everywhere(PolicyConfig())
    for i in range(3):
        d = p.route(req(f"r{i + 1}", doc, toks(10 + i, 1)), 1.0 + i)
        assert (d.worker_id, d.kind) in {(home, "affinity"), (home, "exploit")}


def test_affinity_off_spreads_an_evicted_prefix() -> None:
    p, doc, home = _evicted_everywhere(PolicyConfig(affinity_prefill_slack=0.0))
    d = p.route(req("r1", doc, toks(10, 1)), 1.0)
    assert d.kind == "explore" and d.worker_id != home


def test_affinity_yields_to_load() -> None:
    p, doc, home = _evicted_everywhere(PolicyConfig())
    # Load the home worker far beyond the others: affinity must not pin the prefix there.
    away = others_than(p, home)
    for i in range(30):
        p.route(req(f"x{i}", toks(100 + i, 60), out=2000.0, max_tokens=4096, exclude=away), 0.6)
    assert p.worker_state(home).L > PolicyConfig().rebalance_min_util * PolicyConfig().window_s
    d = p.route(req("r1", doc, toks(10, 1)), 1.0)
    assert d.worker_id != home and d.kind == "explore"


@pytest.mark.parametrize("cap, load_wait, kept",
                         [(20.0, True, True), (0.0, True, False), (20.0, False, False)])
def test_affinity_holds_on_a_fleet_whose_cheapest_placement_is_a_full_wait(
        cap: float, load_wait: bool, kept: bool) -> None:
    # Every worker has 27-32 s of long prefills ahead (L far below H: the window alone
    # does not call the fleet saturated); the home one prefill more than the others. The
    # cheapest placement costs more than the capped wait, so the fleet is saturated and
    # the home may cost up to affinity_saturated_ratio x that: a recompute elsewhere
    # would spend throughput the whole queue waits for. With Preble's L as the load term
    # (load_wait off) the cap is not in play: costs are in minutes, and only L says
    # saturated.
    p, doc, home = _evicted_everywhere(PolicyConfig(load_wait_cap_s=cap, load_wait=load_wait))
    for w in p.workers:
        for i in range(7 if w == home else 6):
            p.route(req(f"{w}-{i}", toks(100 * len(w) + 10 * int(w[1:]) + i, 1625),
                        exclude=others_than(p, w)), 0.6)
    d = p.route(req("r1", doc, toks(10, 1)), 1.0)
    assert max(ws.L for ws in map(p.worker_state, p.workers)) < PolicyConfig().window_s / 4
    assert (d.worker_id == home) is kept
    assert d.kind == ("affinity" if kept else "explore")


def others_than(p: E2Policy, keep: str) -> set[str]:
    return {w for w in p.workers if w != keep}


# --------------------------------------------------------------------------- decode pressure


def _report(p: E2Policy, w: str, step_s: float, now: float) -> None:
    from prefixmesh.shared.wire import LoadReportEvent

    p.on_load(LoadReportEvent(worker_id=w, ts=now, avg_step_s=step_s), now)


def test_decode_pressure_steers_long_outputs_off_slow_stepping_workers() -> None:
    # Equal L everywhere; w0 reports 200 ms steps (busy with long generations), the rest
    # 20 ms. With the knob on, a request expecting 2,000 output tokens avoids w0.
    for weight, avoid in ((1.0, True), (0.0, False)):
        p = make(4, PolicyConfig(decode_step_weight=weight))
        for i in range(4):
            _report(p, f"w{i}", 0.2 if i == 0 else 0.02, 0.0)
        picks = {p.route(req(f"r{j}", toks(50 + j, 4), out=2000.0, max_tokens=4096),
                         0.1 * j).worker_id
                 for j in range(8)}
        assert ("w0" not in picks) is avoid


# --------------------------------------------------------------------------- in-flight aging


def test_inflight_aging_recharges_a_generation_that_outlives_its_estimate() -> None:
    for factor in (2.0, 0.0):
        p = make(2, PolicyConfig(inflight_aging=factor))
        d = p.route(req("long", toks(7, 4), out=10.0, max_tokens=4096), 0.0)
        w = d.worker_id
        entry = p.window.by_rid["long"]
        prefill = entry.cost - entry.dt_tok * 10.0
        charged = p.worker_state(w).L
        for i in range(2):
            _report(p, f"w{i}", 0.05, 0.0)
        # 1 s at 50 ms steps: ~20 tokens produced, more than the 10 charged.
        p.tick(1.0)
        produced = (1.0 - prefill) / 0.05
        if factor:
            assert entry.out_est == pytest.approx(factor * produced)
            assert p.worker_state(w).L == pytest.approx(
                charged + entry.dt_tok * (factor * produced - 10.0))
        else:
            assert entry.out_est == 10.0 and p.worker_state(w).L == pytest.approx(charged)
        # The completion record still sets the exact charge.
        from prefixmesh.shared.wire import RequestDoneEvent

        p.on_done(RequestDoneEvent(request_id="long", worker_id=w, prompt_tokens=64,
                                   cached_tokens=0, completion_tokens=30), 1.5)
        assert p.worker_state(w).L == pytest.approx(prefill + entry.dt_tok * 30)


def test_inflight_aging_looks_at_a_slice_of_the_requests_in_flight_per_tick(monkeypatch) -> None:
    # With more requests in flight than a slice, each tick ages one slice, going on where
    # the last stopped; a request done meanwhile is skipped; every running one is aged
    # within ceil(n / slice) ticks.
    from prefixmesh.services.scheduler.policies import e2_load
    from prefixmesh.shared.wire import RequestDoneEvent

    monkeypatch.setattr(e2_load, "AGE_SLICE", 3)
    p = make(2, PolicyConfig(inflight_aging=2.0))
    for j in range(7):
        p.route(req(f"r{j}", toks(300 + j, 4), out=10.0, max_tokens=4096), 0.0)
    for i in range(2):
        _report(p, f"w{i}", 0.05, 0.0)
    entries = [p.window.by_rid[f"r{j}"] for j in range(7)]
    p.tick(2.0)
    assert [e.out_est > 10.0 for e in entries] == [True] * 3 + [False] * 4
    done = entries[4]
    p.on_done(RequestDoneEvent(request_id="r4", worker_id=done.ws.id, prompt_tokens=64,
                               cached_tokens=0, completion_tokens=12), 2.0)
    p.tick(2.0)
    assert [e.out_est > 10.0 for e in entries] == [True] * 4 + [True, True, False]
    assert done.out_est == 12.0  # its completion set it; aging left it alone
    p.tick(2.0)
    assert all(e.out_est > 10.0 for j, e in enumerate(entries) if j != 4)


def test_inflight_aging_steers_new_work_off_a_worker_busy_with_long_generations() -> None:
    # w0 and w1 each got two requests estimated at 10 tokens; w1's finished with 10
    # tokens, w0's are still running 30 s later (long generations). With aging w0 costs
    # more and the next cold request avoids it; without it, L cannot tell them apart.
    from prefixmesh.shared.wire import RequestDoneEvent

    for factor in (2.0, 0.0):
        p = make(2, PolicyConfig(inflight_aging=factor, imbalance_ratio=1.1))
        placed = {p.route(req(f"a{j}", toks(100 + j, 4), out=10.0, max_tokens=4096),
                          0.01 * j).worker_id: f"a{j}" for j in range(4)}
        assert len(placed) == 2
        for j in range(4):
            if p.window.by_rid[f"a{j}"].ws.id == "w1":
                p.on_done(RequestDoneEvent(request_id=f"a{j}", worker_id="w1",
                                           prompt_tokens=64, cached_tokens=0,
                                           completion_tokens=10), 1.0)
        for t in range(1, 31):
            for i in range(2):
                _report(p, f"w{i}", 0.05, float(t))
            p.tick(float(t))
        l0, l1 = p.worker_state("w0").L, p.worker_state("w1").L
        if factor:
            assert l0 > l1
            assert p.route(req("n", toks(500, 4), out=10.0), 30.0).worker_id == "w1"
        else:
            assert l0 == pytest.approx(l1)


# --------------------------------------------------------------------------- prefill backlog


def test_prefill_backlog_prefers_the_worker_whose_prefill_is_behind_it() -> None:
    # Both workers prefilled the same 2,000-block prompt inside the window, so their L is
    # equal; w_old's ran 100 s ago, w_new's was routed just now. With the backlog term a
    # new cold request goes to w_old; without it the two cost the same.
    for weight in (1.0, 0.0):
        p = make(2, PolicyConfig(prefill_backlog_weight=weight, imbalance_ratio=1.1))
        old = p.route(req("a", toks(1, 2000), out=1.0), 0.0).worker_id
        new = p.route(req("b", toks(2, 2000), out=1.0), 100.0).worker_id
        assert old != new
        assert p.worker_state(new).busy_until > 100.0 >= p.worker_state(old).busy_until
        costs = {w: p.price.cost(p.worker_state(w), 0, 64) for w in (old, new)}
        if weight:
            assert costs[new] > costs[old]
            assert p.route(req("c", toks(3, 4), out=1.0), 100.01).worker_id == old
        else:
            assert costs[new] == pytest.approx(costs[old])


def test_backlog_exploit_moves_a_hit_off_a_worker_busy_with_a_long_cold_prefill() -> None:
    """A short prompt whose 40-block prefix sits on w0 only, just after a 2,000-block cold
    prompt went there: off (the default) it waits behind that prefill; with
    ``backlog_exploit`` the wait outweighs the 40 blocks it saves, and it goes elsewhere."""
    prefix = toks(7, 40)
    for factor in (0.0, 1.0):
        p = make(2, PolicyConfig(backlog_exploit=factor, imbalance_ratio=1.1))
        home = p.route(req("a", prefix, toks(8, 1)), 0.0).worker_id
        p.route(req("doc", toks(9, 2000), exclude={w for w in p.workers if w != home}), 0.1)
        assert p.worker_state(home).busy_until > 0.2
        d = p.route(req("b", prefix, toks(10, 1)), 0.2)
        if factor:
            assert (d.kind, d.matched_tokens) == ("rebalance", 0)
            assert d.worker_id != home
        else:
            assert (d.worker_id, d.kind) == (home, "exploit")
        # Once the backlog is done, the next one is a plain hit again (the prefix is on
        # both workers by now with the knob on: the cheaper of them).
        later = p.route(req("c", prefix, toks(11, 1)), 100.0)
        assert later.kind == "exploit" and later.matched_tokens == 40 * BLOCK_SIZE


# --------------------------------------------------------------------------- P/D balancing


def test_pd_balancing_skips_a_worker_still_prefilling_what_it_got_since_its_report() -> None:
    from prefixmesh.shared.wire import LoadReportEvent

    p = make(4, PolicyConfig(imbalance_ratio=0.5))
    for i in range(4):
        p.on_load(LoadReportEvent(worker_id=f"w{i}", ts=0.0, decode_share=0.9 if i == 0
                                  else 0.1), 0.0)
    # w0 is decode-heavy by its report; the first cold request goes there ...
    first = p.route(req("a", toks(1, 400)), 0.01)
    assert (first.worker_id, first.kind) == ("w0", "pd_balance")
    # A new report that still says decode-heavy (its window lags) while that prefill
    # is under way does not make w0 a target ...
    until = p.worker_state("w0").busy_until
    assert until > 0.3
    p.on_load(LoadReportEvent(worker_id="w0", ts=0.3, decode_share=0.9), 0.3)
    assert p.route(req("b", toks(2, 400)), 0.31).kind != "pd_balance"
    # ... once the prefill is done, a fresh report does.
    p.on_load(LoadReportEvent(worker_id="w0", ts=until + 0.1, decode_share=0.9), until + 0.1)
    assert p.route(req("c", toks(3, 1600)), until + 0.11).kind == "pd_balance"


# --------------------------------------------------------------------------- interference


def test_interference_keeps_cold_prefills_off_a_worker_with_a_big_running_batch() -> None:
    from prefixmesh.shared.wire import LoadReportEvent

    for weight in (0.5, 0.0):
        # Counted from the load reports (interference_inflight=False).
        p = make(2, PolicyConfig(interference_weight=weight, imbalance_ratio=1.1,
                                 interference_inflight=False))
        p.on_load(LoadReportEvent(worker_id="w0", ts=0.0, running=8), 0.0)
        p.on_load(LoadReportEvent(worker_id="w1", ts=0.0, running=0), 0.0)
        p.price.now = 0.0
        cold = {w: p.price.cost(p.worker_state(w), 0, 4000) for w in ("w0", "w1")}
        hit = {w: p.price.cost(p.worker_state(w), 250, 4000) for w in ("w0", "w1")}
        if weight:
            # R's prefill would slow 8 decodes on w0: P x (1 + 0.5 x 8) there.
            assert cold["w0"] == pytest.approx(5 * cold["w1"])
            assert p.route(req("c", toks(1, 250)), 0.01).worker_id == "w1"
        else:
            assert cold["w0"] == pytest.approx(cold["w1"])
        # A full hit has no prefill, hence no interference.
        assert hit["w0"] == pytest.approx(hit["w1"])


def test_the_policy_counts_each_workers_requests_in_flight() -> None:
    """Routed and not done: up at each decision, down at its completion record or when it
    leaves the window unfinished; a request routed again counts on its new worker only."""
    from prefixmesh.shared.wire import RequestDoneEvent

    p = make(2, PolicyConfig(window_s=10.0))
    ws0, ws1 = p.worker_state("w0"), p.worker_state("w1")
    for i in range(3):
        p.route(req(f"a{i}", toks(i, 8), exclude={"w1"}), 0.1 * i)
    assert (ws0.inflight, ws1.inflight) == (3, 0)
    p.on_done(RequestDoneEvent(request_id="a0", worker_id="w0", completion_tokens=4), 1.0)
    p.on_done(RequestDoneEvent(request_id="a0", worker_id="w0", completion_tokens=4), 1.1)
    assert ws0.inflight == 2  # a repeated record counts once
    p.route(req("a1", toks(1, 8), exclude={"w0"}), 1.2)  # a1 placed again, on w1
    assert (ws0.inflight, ws1.inflight) == (1, 1)
    p.tick(20.0)  # a2 and a1's second placement leave the window unfinished
    assert (ws0.inflight, ws1.inflight) == (0, 0)


def test_interference_can_count_what_was_routed_since_the_last_report() -> None:
    """A report says nothing runs on w0, but three requests went there since: priced by
    the reports, w0 and w1 are alike; by the requests in flight, w0 is the dearer."""
    from prefixmesh.shared.wire import LoadReportEvent

    costs = {}
    for by_inflight in (False, True):
        p = make(2, PolicyConfig(interference_weight=0.5, prefill_backlog_weight=0.0,
                                 gpu_step_weight=0.0, interference_inflight=by_inflight))
        for w in ("w0", "w1"):
            p.on_load(LoadReportEvent(worker_id=w, ts=0.0, running=0), 0.0)
        for i in range(3):
            p.route(req(f"s{i}", toks(i, 1), exclude={"w1"}), 0.01)
        p.price.now = 0.02
        ws0, ws1 = p.worker_state("w0"), p.worker_state("w1")
        costs[by_inflight] = (p.price.cost(ws0, 0, 4000) - p.price.load(ws0),
                              p.price.cost(ws1, 0, 4000) - p.price.load(ws1))
    # Load terms (and backlog and the GPU's step, off) aside: equal by the reports; by
    # the count, w0 is P x (1 + 0.5 x 3).
    assert costs[False][0] == pytest.approx(costs[False][1], rel=0.05)
    assert costs[True][0] == pytest.approx(2.5 * costs[True][1], rel=0.05)


def _short_beside_a_document(ratio: float, doc: bool = True, blocks: int = 40) -> str:
    """w1 did earlier work (its window load, nothing in flight), w0 decodes two short
    requests, w2 was just sent a long cold document (or nothing, ``doc`` False). Where
    does a short cold request of ``blocks`` blocks go (w2 excluded)?"""
    from prefixmesh.shared.wire import RequestDoneEvent

    p = make(3, PolicyConfig(interference_mix_ratio=ratio, imbalance_ratio=1.1))
    for i in range(8):
        p.route(req(f"old{i}", toks(i, 120), exclude={"w0", "w2"}), 0.01 * i)
        p.on_done(RequestDoneEvent(request_id=f"old{i}", worker_id="w1",
                                   completion_tokens=64), 2.1)
    for i in range(2):
        p.route(req(f"s{i}", toks(10 + i, 4), exclude={"w1", "w2"}), 2.2)
    if doc:
        p.route(req("doc", toks(99, 1250), exclude={"w0", "w1"}), 2.3)
    assert p.worker_state("w0").inflight == 2 and p.worker_state("w1").inflight == 0
    return p.route(req("short", toks(50, blocks), exclude={"w2"}), 2.4).worker_id


def test_a_short_request_beside_long_documents_is_not_charged_interference() -> None:
    # Charged interference, the short request avoids w0's two decoding sequences...
    assert _short_beside_a_document(0.0) == "w1"
    assert _short_beside_a_document(10.0, doc=False) == "w1"  # no long prefill lately
    # ... but under a tenth of the document's prefill, it is priced without it and joins
    # them: w1's earlier work makes it the dearer worker, and it stays free of decodes.
    assert _short_beside_a_document(10.0) == "w0"
    # A prompt of 200 blocks is not short next to the document (it would be under 1/1).
    assert _short_beside_a_document(10.0, blocks=200) == "w1"
    assert _short_beside_a_document(1.0, blocks=200) == "w0"


def test_recent_max_keeps_the_largest_value_of_its_horizon() -> None:
    from prefixmesh.services.scheduler.policies.e2_load import RecentMax

    m = RecentMax(10.0)
    assert m.get(0.0) == 0.0
    for t, v in ((0.0, 3.0), (1.0, 1.0), (2.0, 2.0), (5.0, 0.5)):
        m.add(t, v)
    assert m.get(5.0) == 3.0
    assert m.get(10.5) == 2.0  # 3.0 (at 0) left the horizon; 2.0 (at 2) is the largest
    assert m.get(12.5) == 0.5
    assert m.get(15.5) == 0.0
    m.add(16.0, 4.0)
    m.clear()
    assert m.get(16.0) == 0.0


# --------------------------------------------------------------------------- explore wait


def _docs_behind_one_worker(cfg: PolicyConfig, n: int = 3) -> str:
    """Workers w1.. decode 60 short requests between them; w0 was just sent three cold
    20k-token documents (a prefill backlog of about three times one's prefill). Where does
    a fourth cold document go?"""
    p = make(n, cfg)
    for i in range(60):
        p.route(req(f"s{i}", toks(i, 4), exclude={"w0"}), 0.001 * i)
    others = {f"w{i}" for i in range(1, n)}
    for i in range(3):
        p.route(req(f"d{i}", toks(100 + i, 1250), exclude=others), 0.1)
    return p.route(req("d3", toks(103, 1250)), 0.11).worker_id


@pytest.mark.parametrize("n", [2, 3])
def test_a_cold_request_is_not_queued_far_behind_where_the_fleet_is_not(n: int) -> None:
    # By cost alone the document joins the others: P x 0.5 x the short requests in flight
    # on any other worker against about 3 P of waiting on w0.
    assert _docs_behind_one_worker(PolicyConfig(explore_wait=0.0), n) == "w0"
    # Bounded: w0 would hold it behind more than 2 x its prefill, and w0's backlog is more
    # than twice the others' mean, so the cheapest worker that starts it sooner gets it.
    got = _docs_behind_one_worker(PolicyConfig(explore_wait=2.0, explore_wait_fleet=2.0), n)
    assert got != "w0"
    # Judged against the fleet too: with its bar out of reach (100 x the others' mean
    # backlog), the cost's choice stands.
    got = _docs_behind_one_worker(PolicyConfig(explore_wait=2.0, explore_wait_fleet=100.0), n)
    assert got == "w0"
