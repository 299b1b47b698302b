"""The metrics service's pure parts: hot prefixes from the scheduler's tree, the cluster
view's snapshot, history and forgetting of silent workers."""

from __future__ import annotations

import pytest

from prefixmesh.services.metrics.cluster import (
    FORGET_AFTER_S,
    HISTORY_WINDOW_S,
    ClusterView,
    percentile,
)
from prefixmesh.services.scheduler.prefix_tree import PrefixTree
from prefixmesh.services.scheduler.stats import HotPrefixWalk, hot_prefixes
from prefixmesh.shared.wire import (
    LoadReportEvent,
    RequestDoneEvent,
    SchedulerStatsEvent,
)


def _route(tree: PrefixTree, hashes: list[int], worker: str, now: float = 0.0) -> None:
    node, matched = tree.match(hashes)
    tree.record(node, matched, hashes, worker, now)  # extends the path and counts it


def test_hot_prefix_is_reported_where_traffic_fans_out() -> None:
    tree = PrefixTree(block_size=16)
    shared = [1, 2, 3, 4]
    for i in range(6):
        _route(tree, shared + [100 + i], "w0" if i % 2 else "w1")
    _route(tree, [7, 8], "w2")
    hot = hot_prefixes(tree)
    assert hot[0].tokens == 4 * 16 and hot[0].requests == 6
    assert hot[0].workers == ["w0", "w1"]
    assert hot[0].requests_by_worker == {"w0": 3, "w1": 3}
    # The one-off prompts rank below; their shared ancestor is not repeated.
    assert all(h.requests == 1 for h in hot[1:])
    assert len([h for h in hot if h.tokens == 64]) == 1


def test_hot_prefixes_keep_the_top_k() -> None:
    tree = PrefixTree(block_size=16)
    for p in range(5):
        for i in range(p + 1):
            _route(tree, [1000 * (p + 1), 1000 * (p + 1) + 1, 10_000 + 100 * p + i], "w0")
    assert [h.requests for h in hot_prefixes(tree, k=3)] == [5, 4, 3]
    assert hot_prefixes(PrefixTree()) == []


def _busy_tree() -> PrefixTree:
    tree = PrefixTree(block_size=16)
    for p in range(12):
        shared = [10_000 * (p + 1) + j for j in range(3)]
        for i in range(p + 2):
            _route(tree, shared + [10_000 * (p + 1) + 100 + i], f"w{i % 3}")
    return tree


def test_hot_prefix_walk_in_slices_finds_what_one_walk_finds() -> None:
    tree = _busy_tree()
    walk = HotPrefixWalk(tree)
    slices = 1
    while not walk.step(1):  # one node a slice: many yields
        slices += 1
    assert slices > 3
    assert walk.result() == hot_prefixes(tree)


def test_the_walk_leaves_quiet_subtrees_unvisited() -> None:
    """Busiest first: once k prefixes are found, what has less traffic is not visited."""
    tree = _busy_tree()
    for i in range(200):  # one-off prompts: a node each, one request each
        _route(tree, [500_000 + 10 * i, 500_001 + 10 * i], "w0")
    walk = HotPrefixWalk(tree, k=3)
    while not walk.step(10_000):
        pass
    assert walk._visited < 50 < len(tree)
    assert [h.requests for h in walk.result()] == [13, 12, 11]


def _reported_everywhere(tree: PrefixTree, k: int) -> list[int]:
    """Every node where traffic does not all go on into one child, by requests: the top k's
    request counts, found without any pruning."""
    got = []
    for n in tree.nodes():
        if n is tree.root or not n.counts:
            continue
        total = sum(n.counts.values())
        busiest = max((sum(c.counts.values()) for c in n.children.values() if c.counts),
                      default=-1)
        if busiest < total:
            got.append(total)
    return sorted(got, reverse=True)[:k]


def test_the_walk_finds_the_top_k_of_every_fanned_out_node() -> None:
    """Random trees with wide fan-outs: the walk, keeping only each node's k busiest
    children, reports the same request counts as looking at every node."""
    import random

    rng = random.Random(3)
    for trial in range(20):
        tree = PrefixTree(block_size=16)
        heads = [[1_000_000 * (h + 1) + j for j in range(rng.randint(1, 4))]
                 for h in range(rng.randint(1, 6))]
        for i in range(rng.randint(50, 400)):
            head = heads[rng.randrange(len(heads))]
            mid = [rng.randrange(3) + 10 * len(head)] * rng.randint(0, 1)
            _route(tree, head + mid + [rng.randrange(60) + 5_000_000], f"w{i % 3}")
        for k in (1, 3, 10):
            want = _reported_everywhere(tree, k)
            assert [h.requests for h in hot_prefixes(tree, k=k)] == want, (trial, k)
            walk = HotPrefixWalk(tree, k=k)
            while not walk.step(7):  # in slices, expansions cut mid-way
                pass
            assert [h.requests for h in walk.result()] == want, (trial, k)


def test_a_wide_fan_out_keeps_the_frontier_small() -> None:
    """A shared prompt and 5,000 distinct turns after it: the walk holds at most k of
    that node's children, not all of them."""
    tree = PrefixTree(block_size=16)
    for i in range(5_000):
        _route(tree, [1, 2, 3, 10_000 + i], "w0")
    for _ in range(40):  # one turn asked again and again
        _route(tree, [1, 2, 3, 10_007], "w1")
    walk = HotPrefixWalk(tree, k=3)
    biggest = 0
    while not walk.step(64):
        biggest = max(biggest, len(walk._frontier))
    assert biggest <= 3
    assert [h.requests for h in walk.result()] == [5_040, 41, 1]


def _load(w: str, running: int = 1) -> LoadReportEvent:
    return LoadReportEvent(worker_id=w, ts=0.0, running=running, waiting=2, free_blocks=25,
                           total_blocks=100, hit_ratio=0.5)


def _done(w: str, latency: float, prompt: int = 100, cached: int = 60) -> RequestDoneEvent:
    return RequestDoneEvent(request_id=f"r{latency}", worker_id=w, prompt_tokens=prompt,
                            cached_tokens=cached, completion_tokens=4, ttft_s=latency / 4,
                            latency_s=latency)


def test_snapshot_workers_scheduler_and_percentiles() -> None:
    view = ClusterView()
    view.on_load(_load("w1"), now=10.0)
    view.on_load(_load("w0", running=3), now=10.0)
    for i in range(1, 11):
        view.on_done(_done("w0" if i % 2 else "w1", latency=i / 10), now=10.0)
    view.on_scheduler(SchedulerStatsEvent(scheduler_id="s", ts=0.0, policy="e2",
                                          decisions={"exploit": 3, "explore": 1}), now=10.0)
    snap = view.snapshot(now=10.5)
    assert [w["worker_id"] for w in snap["workers"]] == ["w0", "w1"]
    w0 = snap["workers"][0]
    assert w0["kv_usage"] == pytest.approx(0.75) and w0["completed"] == 5 and not w0["stale"]
    assert w0["hit_ratio_total"] == pytest.approx(0.6)
    assert snap["recent"]["latency_p50_s"] == pytest.approx(0.6)
    assert snap["recent"]["cache_hit_ratio"] == pytest.approx(0.6)
    assert snap["scheduler"]["decision_share"] == {"exploit": 0.75, "explore": 0.25}
    assert view.snapshot(now=20.0)["scheduler"]["stale"]
    assert view.snapshot(now=20.0)["workers"][0]["stale"]


def test_history_summarizes_the_trailing_window() -> None:
    view = ClusterView()
    view.on_load(_load("w0", running=2), now=0.0)
    view.on_done(_done("w0", 1.0), now=0.0)
    view.on_done(_done("w0", 3.0), now=HISTORY_WINDOW_S + 1)
    point = view.sample(now=HISTORY_WINDOW_S + 1, wall=1234.0)
    assert point["t"] == 1234.0 and point["latency_p50_s"] == 3.0
    assert point["throughput_rps"] == pytest.approx(1 / HISTORY_WINDOW_S)
    assert point["running"] == 0.0  # w0's report is stale by then
    assert view.snapshot(now=HISTORY_WINDOW_S + 1)["history"] == [point]


def test_silent_workers_are_forgotten() -> None:
    view = ClusterView()
    view.on_load(_load("w0"), now=0.0)
    view.on_load(_load("w1"), now=FORGET_AFTER_S)
    assert view.forget_silent(now=FORGET_AFTER_S + 1) == ["w0"]
    assert list(view.workers) == ["w1"]


def test_percentile() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
