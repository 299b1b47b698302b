"""The soak run's verdict logic: capacity from a rate sweep, warm-up end, growth."""

import pytest

from prefixmesh.loadgen.soak import capacity, growth, metric_sum, warmup_end


def row(rate, p99, failed=0):
    return {"rate": rate, "latency_p99_s": p99, "failed": failed}


def test_capacity_is_the_last_rate_before_p99_climbs():
    rows = [row(4, 2.0), row(8, 2.5), row(12, 3.9), row(16, 4.5), row(20, 3.0)]
    # 16 misses (4.5 > 2 x 2.0); 20 is past the first miss and does not count.
    assert capacity(rows, 2.0) == 12
    assert capacity(rows, 3.0) == 20


def test_capacity_stops_at_failures_and_handles_nothing():
    assert capacity([row(4, 1.0), row(8, 1.1, failed=3), row(12, 1.2)], 2.0) == 4
    assert capacity([row(4, 1.0, failed=1)], 2.0) is None
    assert capacity([], 2.0) is None


def sample(t, evicted, rss=100, tree=50):
    return {"t_s": t, "evicted_blocks": evicted, "rss_kib": {"edge": rss},
            "tree": {"prefixmesh_scheduler_tree_tokens": tree}}


def test_auto_warmup_waits_for_every_worker_to_evict():
    samples = [sample(0, {"worker-0": 0, "worker-1": 0}),
               sample(10, {"worker-0": 5, "worker-1": 0}),
               sample(20, {"worker-0": 9, "worker-1": 2}),
               sample(30, {"worker-0": 9, "worker-1": 4})]
    assert warmup_end(samples, "auto", 180.0) == 200.0
    assert warmup_end(samples[:2], "auto", 180.0) is None
    assert warmup_end(samples, "45", 180.0) == 45.0


def test_growth_reports_last_and_peak_after_the_warmup():
    samples = [sample(0, {}, rss=10, tree=1), sample(10, {}, rss=100, tree=50),
               sample(20, {}, rss=130, tree=60), sample(30, {}, rss=105, tree=55)]
    g = growth(samples, 10)
    assert g["rss_kib:edge"]["growth"] == pytest.approx(0.05)
    assert g["rss_kib:edge"]["peak"] == pytest.approx(0.30)
    assert g["tree:prefixmesh_scheduler_tree_tokens"]["growth"] == pytest.approx(0.10)
    assert growth(samples, 30) == {}  # one sample: nothing to compare


def test_metric_sum_adds_label_sets():
    text = ("# HELP x y\n"
            'prefixmesh_worker_kv_blocks_evicted_total{worker="w0"} 3.0\n'
            'prefixmesh_worker_kv_blocks_evicted_total{worker="w1"} 4.0\n'
            "prefixmesh_scheduler_tree_nodes 17.0\n")
    assert metric_sum(text, "prefixmesh_worker_kv_blocks_evicted_total") == 7.0
    assert metric_sum(text, "prefixmesh_scheduler_tree_nodes") == 17.0
    assert metric_sum(text, "prefixmesh_missing") is None


def test_auto_warmup_also_ends_once_the_tree_has_levelled_off():
    # worker-1 never evicts (its share fits its cache); the tree stops growing at t = 20.
    samples = [sample(t, {"worker-0": 1 if t >= 10 else 0, "worker-1": 0}, tree=tree)
               for t, tree in ((0, 100), (10, 200), (20, 300), (30, 301), (40, 302))]
    # At 30 the tree is 301 vs 200 at 10 (settle 20): still growing. At 40: 302 vs 300.
    assert warmup_end(samples, "auto", 20.0) == 40
    # Not before some worker evicted: a flat tree on an idle mesh proves nothing.
    idle = [sample(t, {"worker-0": 0}, tree=50) for t in (0, 10, 20, 30)]
    assert warmup_end(idle, "auto", 10.0) is None
