"""E2 fixes from the simulator diagnosis (docs/sim-results.md): the tree budget follows
the cluster's KV capacity, and a prefix evicted everywhere keeps its home worker
(affinity) while that worker's load cost is close to the cheapest."""

from __future__ import annotations

import pytest

from services.scheduler.policies.base import PolicyConfig
from services.scheduler.policies.e2 import E2Policy
from shared.blocks import BLOCK_SIZE, block_hashes
from shared.messages import BlockRemoved
from tests.unit.test_e2 import COST, make, req, toks

pytestmark = pytest.mark.unit


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


def others_than(p: E2Policy, keep: str) -> set[str]:
    return {w for w in p.workers if w != keep}




# --------------------------------------------------------------------------- decode pressure


def _report(p: E2Policy, w: str, step_s: float, now: float) -> None:
    from shared.messages import LoadReportEvent

    p.on_load(LoadReportEvent(worker_id=w, ts=now, avg_step_s=step_s), now)


def test_decode_pressure_steers_long_outputs_off_slow_stepping_workers() -> None:
    # Equal L everywhere; w0 reports 200 ms steps (busy with long generations), the rest
    # 20 ms. With the knob on, a request expecting 2,000 output tokens avoids w0.
    for weight, avoid in ((1.0, True), (0.0, False)):
        p = make(4, PolicyConfig(decode_step_weight=weight))
        for i in range(4):
            _report(p, f"w{i}", 0.2 if i == 0 else 0.02, 0.0)
        picks = {p.route(req(f"r{j}", toks(50 + j, 4), out=2000.0, max_tokens=4096), 0.1 * j).worker_id
                 for j in range(8)}
        assert ("w0" not in picks) is avoid
