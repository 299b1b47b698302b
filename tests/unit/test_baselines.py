"""Baseline policies: each one's defining rule, the registry, and snapshots."""

from __future__ import annotations

import functools

import pytest

from prefixmesh.services.scheduler.policies import POLICY_NAMES, make_policy
from prefixmesh.services.scheduler.policies.base import (
    GlobalPolicy,
    NoWorkerError,
    PolicyConfig,
)
from prefixmesh.shared.blocks import BLOCK_SIZE
from prefixmesh.shared.wire import (
    BlockRemoved,
    BlockStored,
    LoadReportEvent,
    RequestDoneEvent,
)
from tests.helpers import default_cost, route_input, toks

COST = default_cost()
req = functools.partial(route_input, max_tokens=16)


def make(name: str, n: int = 4, cfg: PolicyConfig | None = None) -> GlobalPolicy:
    p = make_policy(name, cfg or PolicyConfig(), COST)
    for i in range(n):
        p.add_worker(f"w{i}", 0, 0.0)
    return p


def done(rid: str, worker: str) -> RequestDoneEvent:
    return RequestDoneEvent(request_id=rid, worker_id=worker, prompt_tokens=16, cached_tokens=0,
                            completion_tokens=4)


# --------------------------------------------------------------------------- registry


def test_registry_builds_every_policy_behind_the_protocol():
    assert POLICY_NAMES[0] == "e2" and len(set(POLICY_NAMES)) == 7
    for name in POLICY_NAMES:
        p = make(name, 3)
        assert isinstance(p, GlobalPolicy)
        assert set(p.workers) == {"w0", "w1", "w2"}
        d = p.route(req("r", toks(1, 8)), 1.0)
        assert d.worker_id in p.workers and d.kind
        with pytest.raises(NoWorkerError):
            p.route(req("x", toks(2, 8), exclude={"w0", "w1", "w2"}), 2.0)
        p.remove_worker("w0", 3.0)
        assert "w0" not in p.workers
    with pytest.raises(ValueError, match="unknown global policy"):
        make_policy("nope", PolicyConfig(), COST)


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "e2"])
def test_baseline_snapshot_restore(name):
    p = make(name)
    prefix = toks(1, 40)
    for i in range(6):
        p.route(req(f"r{i}", prefix, toks(10 + i, 2)), 100.0 + i)
    q = make_policy(name, PolicyConfig(), COST)
    q.state.restore(p.state.snapshot())
    assert list(q.workers) == list(p.workers)
    probe = req("probe", prefix, toks(99, 2))
    assert q.route(probe, 5.0) == p.route(probe, 106.0)


# --------------------------------------------------------------------------- load-only rules


def test_round_robin_takes_turns_and_skips_excluded():
    p = make("round_robin", 3)
    got = [p.route(req(f"r{i}", toks(i, 2)), 0.0).worker_id for i in range(6)]
    assert got == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert p.route(req("x", toks(9, 2), exclude={"w0"}), 0.0).worker_id != "w0"


def test_least_load_picks_fewest_outstanding_requests():
    p = make("least_load", 3)
    got = [p.route(req(f"r{i}", toks(i, 2)), 0.0).worker_id for i in range(3)]
    assert sorted(got) == ["w0", "w1", "w2"]
    # Completions free a worker: it is now the least loaded.
    p.on_done(done("r1", got[1]), 1.0)
    assert p.route(req("r3", toks(3, 2)), 1.0).worker_id == got[1]
    # Ties on request count go to fewer outstanding tokens.
    q = make("least_load", 2)
    q.route(req("a", toks(1, 50), exclude={"w1"}), 0.0)
    q.route(req("b", toks(2, 2), exclude={"w0"}), 0.0)
    assert q.route(req("c", toks(3, 2)), 0.0).worker_id == "w1"


def test_prefix_hash_is_sticky_spread_and_consistent():
    cfg = PolicyConfig(prefix_hash_tokens=256)
    p = make("prefix_hash", 16, cfg)
    heads = [toks(i, 16) for i in range(200)]
    owner = {
        i: p.route(req(f"a{i}", h, toks(1000 + i, 4)), 0.0).worker_id for i, h in enumerate(heads)
    }
    # The same first K tokens go to the same worker, whatever follows; load is ignored.
    for i, h in enumerate(heads[:20]):
        assert p.route(req(f"b{i}", h, toks(2000 + i, 30)), 1.0).worker_id == owner[i]
    assert len(set(owner.values())) >= 12
    # Removing a worker moves only the keys it owned.
    gone = owner[0]
    p.remove_worker(gone, 2.0)
    moved = [i for i, h in enumerate(heads) if p.route(req(f"c{i}", h), 3.0).worker_id != owner[i]]
    assert moved and all(owner[i] == gone for i in moved)


# --------------------------------------------------------------------------- cache-aware peers


def test_cache_aware_longest_match_above_threshold_else_least_loaded():
    p = make("cache_aware", 3)
    prefix = toks(1, 40)
    w = p.route(req("a", prefix, toks(2, 2)), 0.0).worker_id
    # Match ratio 40/43 > 0.3: the worker holding the longest match, despite its load.
    for i in range(5):
        assert p.route(req(f"b{i}", prefix, toks(10 + i, 3)), 1.0).worker_id == w
    # Match ratio 40/200 = 0.2 < 0.3: least loaded instead.
    assert p.route(req("c", prefix, toks(3, 160)), 2.0).worker_id != w


def test_cache_aware_balances_when_load_is_skewed():
    cfg = PolicyConfig(ca_balance_abs=4, ca_balance_rel=1.5)
    p = make("cache_aware", 2, cfg)
    prefix = toks(1, 40)
    for i in range(6):  # 6 outstanding on w0, 0 on w1: 6 - 0 > 4 and 6 > 1.5 * 0
        p.route(req(f"a{i}", prefix, toks(2 + i, 2), exclude={"w1"}), 0.0)
    # Only w0 holds the prefix, yet the imbalance guard sends the request to w1.
    assert p.route(req("b", prefix, toks(9, 2)), 1.0).worker_id == "w1"
    # Below the guard the longest match wins again: w0 (w1 now holds only 40 blocks of it).
    for i in range(5):
        p.on_done(done(f"a{i}", "w0"), 2.0)
    assert p.route(req("c", prefix, toks(2, 2)), 3.0).worker_id == "w0"


def test_kv_cost_prefers_cached_blocks_and_penalises_active_blocks():
    p = make("kv_cost", 3)
    prefix = toks(1, 60)
    r = req("a", prefix, toks(2, 4))
    # Dynamo's index comes from KV events, not from its own decisions.
    p.on_kv_events("w2", [BlockStored(block_hashes=r.block_hashes[:60], parent_block_hash=None,
                                      token_ids=[], block_size=BLOCK_SIZE)], 0.0)
    assert p.route(r, 1.0).worker_id == "w2"
    # 64 active blocks on w2 now outweigh 60 cached ones: a prompt of 64 blocks costs
    # 4 + 64 there and 64 + 0 elsewhere.
    d = p.route(req("b", prefix, toks(3, 4)), 2.0)
    assert d.worker_id != "w2"
    # Evicted blocks no longer count: with one active block on w2, a fresh request of the
    # prefix costs 64 + 1 there (it would be 4 + 1 with the cache) and 64 on the idle worker.
    p.on_done(done("a", "w2"), 3.0)
    p.on_kv_events("w2", [BlockRemoved(block_hashes=r.block_hashes[:1])], 3.0)
    p.route(req("e", toks(5, 1), exclude={"w0", "w1"}), 3.0)
    idle = ({"w0", "w1"} - {d.worker_id}).pop()
    assert p.route(req("c", prefix, toks(6, 4)), 4.0).worker_id == idle


def test_kv_cost_breaks_ties_at_random_but_reproducibly():
    def run(seed: int) -> list[str]:
        p = make("kv_cost", 8, PolicyConfig(seed=seed))
        out = []
        for i in range(20):
            d = p.route(req(f"r{i}", toks(i, 4)), float(i))
            p.on_done(done(f"r{i}", d.worker_id), float(i))
            out.append(d.worker_id)
        return out

    assert run(1) == run(1)
    assert len(set(run(1))) > 2 and run(1) != run(2)


def test_weighted_scores_prefix_queue_and_kv_free():
    p = make("weighted", 3)
    prefix = toks(1, 40)
    w = p.route(req("a", prefix, toks(2, 2)), 0.0).worker_id
    # Same queue and KV scores everywhere: the prefix scorer decides (3 * 40/42 > 0).
    assert p.route(req("b", prefix, toks(3, 2)), 1.0).worker_id == w
    # A long queue (2 * 1.0 lost) and a full cache (2 * 1.0 lost) outweigh the prefix.
    for x in ("w0", "w1", "w2"):
        full = x == w
        p.on_load(LoadReportEvent(worker_id=x, ts=2.0, waiting=10 if full else 0,
                                  total_blocks=100, free_blocks=0 if full else 100), 2.0)
    assert p.route(req("c", prefix, toks(4, 2)), 2.0).worker_id != w
    # Cold prompt, equal metrics apart from KV usage: the freest cache wins.
    q = make("weighted", 2)
    q.on_load(LoadReportEvent(worker_id="w0", ts=0.0, total_blocks=100, free_blocks=20), 0.0)
    q.on_load(LoadReportEvent(worker_id="w1", ts=0.0, total_blocks=100, free_blocks=80), 0.0)
    assert q.route(req("d", toks(5, 10)), 0.0).worker_id == "w1"
