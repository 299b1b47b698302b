"""Local policies (prefixmesh.services.worker.local): registry, fcfs, prefix_fair."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence

import pytest

from prefixmesh.services.worker.engine.types import EngineRequest
from prefixmesh.services.worker.local import (
    LOCAL_POLICIES,
    CacheProbe,
    FcfsConfig,
    FcfsPolicy,
    LocalPolicy,
    PrefixFairConfig,
    PrefixFairPolicy,
    make_local_policy,
    prefill_estimate,
)
from prefixmesh.shared.blocks import block_hashes
from tests.helpers import request_ids

BS = 16
PROMPT = 160  # 10 blocks, so cached fractions land on exact groups
UNLIMITED = 10**9


class FakeCache:
    """A CacheProbe whose cached prefix is set per request (keyed by its first block hash)."""

    block_size = BS

    def __init__(self) -> None:
        self.cached: dict[int, int] = {}

    def cached_prefix_tokens(self, block_hashes: Sequence[int]) -> int:
        return self.cached.get(block_hashes[0], 0) if block_hashes else 0

    def set(self, req: EngineRequest, tokens: int) -> None:
        self.cached[req.block_hashes[0]] = tokens


def _req(rid: str, n: int = PROMPT) -> EngineRequest:
    base = zlib.crc32(rid.encode()) * 1_000  # distinct prompts per id, same in every run
    prompt = list(range(base, base + n))
    return EngineRequest(rid, prompt, max_tokens=8, block_hashes=block_hashes(prompt))


# --------------------------------------------------------------------------- registry


def test_registry_builds_policies_by_name() -> None:
    assert set(LOCAL_POLICIES) >= {"fcfs", "prefix_fair"}
    assert isinstance(make_local_policy("fcfs"), FcfsPolicy)
    fair = make_local_policy("prefix_fair", PrefixFairConfig(num_groups=4))
    assert isinstance(fair, PrefixFairPolicy) and fair.config.num_groups == 4
    for name in LOCAL_POLICIES:
        policy = make_local_policy(name)
        assert isinstance(policy, LocalPolicy) and policy.name == name
    assert isinstance(FakeCache(), CacheProbe)
    with pytest.raises(ValueError, match="unknown local policy"):
        make_local_policy("lifo")
    with pytest.raises(TypeError):
        make_local_policy("fcfs", PrefixFairConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PrefixFairConfig(num_groups=0)


def test_prefill_estimate_never_counts_the_last_block_as_cached() -> None:
    cache = FakeCache()
    req = _req("a")
    cache.set(req, PROMPT)
    assert prefill_estimate(req, cache) == BS
    cache.set(req, 64)
    assert prefill_estimate(req, cache) == PROMPT - 64


# --------------------------------------------------------------------------- fcfs


def test_fcfs_admits_in_arrival_order_within_limits() -> None:
    cache = FakeCache()
    policy = FcfsPolicy(FcfsConfig())
    reqs = [_req(f"r{i}") for i in range(6)]
    for i, r in enumerate(reqs):
        policy.push(r, float(i))
    assert len(policy) == 6
    assert request_ids(policy.select(0.0, 2, UNLIMITED, cache)) == ["r0", "r1"]
    # Budget: each needs 160 tokens; 161 left means a second one would be chunked, so it
    # is still offered, and then the budget is spent.
    assert request_ids(policy.select(0.0, 10, PROMPT + 1, cache)) == ["r2", "r3"]
    assert policy.remove("r4") is reqs[4] and policy.remove("r4") is None
    assert request_ids(policy.select(0.0, 10, UNLIMITED, cache)) == ["r5"]
    assert policy.select(0.0, 10, UNLIMITED, cache) == [] and len(policy) == 0


def test_fcfs_requeued_requests_go_first_in_order() -> None:
    cache = FakeCache()
    policy = FcfsPolicy()
    for i in range(3):
        policy.push(_req(f"r{i}"), 0.0)
    picked = policy.select(0.0, 3, UNLIMITED, cache)
    policy.requeue_front(picked[1:])  # r1, r2 could not be admitted
    policy.push(_req("r3"), 1.0)
    policy.requeue_front([_req("preempted")])
    assert {r.request_id for r in policy} == {"preempted", "r1", "r2", "r3"}
    assert policy.remove("r2") is not None  # abort reaches the front lane too
    assert request_ids(policy.select(0.0, 10, UNLIMITED, cache)) == ["preempted", "r1", "r3"]


# --------------------------------------------------------------------------- prefix_fair


def test_prefix_fair_groups_by_cached_fraction() -> None:
    cache = FakeCache()
    policy = PrefixFairPolicy()
    req = _req("a", 100)
    for cached, group in [(0, 0), (9, 0), (10, 1), (63, 6), (99, 9), (100, 9)]:
        cache.set(req, cached)
        assert policy.group_of(req, cache) == group, cached


def _fill_groups(policy: PrefixFairPolicy, cache: FakeCache, per_group: int) -> None:
    for i in range(per_group):
        for g in range(policy.config.num_groups):
            r = _req(f"g{g}-{i}")
            cache.set(r, g * PROMPT // policy.config.num_groups)
            policy.push(r, float(i))


def _group(rid: str) -> int:
    return int(rid[1 : rid.index("-")])


def test_prefix_fair_quotas_are_proportional_to_rank() -> None:
    cache = FakeCache()
    policy = PrefixFairPolicy()
    _fill_groups(policy, cache, per_group=30)
    picked = request_ids(policy.select(0.0, 55, UNLIMITED, cache))
    counts = Counter(_group(rid) for rid in picked)
    assert [counts[g] for g in range(10)] == list(range(1, 11))  # group 9 gets 10 of 55
    # Over several batches (steps) too.
    picked = [rid for _ in range(11)
              for rid in request_ids(policy.select(0.0, 10, UNLIMITED, cache))]
    counts = Counter(_group(rid) for rid in picked)
    assert [counts[g] for g in range(10)] == [2 * (g + 1) for g in range(10)]


def test_prefix_fair_is_fcfs_inside_a_group() -> None:
    cache = FakeCache()
    policy = PrefixFairPolicy()
    _fill_groups(policy, cache, per_group=5)
    picked = request_ids(policy.select(0.0, 50, UNLIMITED, cache))
    for g in range(10):
        mine = [rid for rid in picked if _group(rid) == g]
        assert mine == [f"g{g}-{i}" for i in range(5)]


def test_prefix_fair_starved_cold_request_runs_within_bound() -> None:
    cache = FakeCache()
    policy = PrefixFairPolicy()
    cold = _req("cold")
    policy.push(cold, 0.0)
    bound = policy.config.group_wait_bound  # 55 picks
    steps = 0
    while True:
        steps += 1
        # A steady stream of well-cached requests in every other group.
        for g in range(1, 10):
            r = _req(f"g{g}-{steps}")
            cache.set(r, g * PROMPT // 10)
            policy.push(r, float(steps))
        if "cold" in request_ids(policy.select(float(steps), 1, UNLIMITED, cache)):
            break
        assert steps <= bound + 1
    assert steps > 1  # it did wait behind better-cached work


def test_prefix_fair_starvation_guard_overrides_credit() -> None:
    cache = FakeCache()
    policy = PrefixFairPolicy(PrefixFairConfig(max_group_wait=3))
    policy.push(_req("cold"), 0.0)
    for i in range(20):
        r = _req(f"g9-{i}")
        cache.set(r, PROMPT)
        policy.push(r, 0.0)
    # Smooth WRR alone (ranks 1 and 10) would serve "cold" only at pick 11.
    picked = request_ids(policy.select(0.0, 4, UNLIMITED, cache))
    assert picked[-1] == "cold" and "cold" not in picked[:-1]


def test_prefix_fair_regroups_as_the_cache_changes() -> None:
    cache = FakeCache()
    policy = PrefixFairPolicy()
    early, late = _req("early"), _req("late")
    policy.push(early, 0.0)
    policy.push(late, 1.0)
    cache.set(late, PROMPT)  # late's prefix got cached by someone else meanwhile
    assert request_ids(policy.select(2.0, 1, UNLIMITED, cache)) == ["late"]


def test_prefix_fair_requeue_scan_limit_and_budget() -> None:
    cache = FakeCache()
    policy = PrefixFairPolicy(PrefixFairConfig(scan_limit=2))
    reqs = [_req(f"r{i}") for i in range(4)]
    for r in reqs:
        policy.push(r, 0.0)
    cache.set(reqs[3], PROMPT)  # best cached, but outside the 2-request window
    assert request_ids(policy.select(0.0, 1, UNLIMITED, cache)) == ["r0"]
    policy.requeue_front([reqs[0]])  # the engine could not place it
    # Requeued first, then the window (r1, r2); two prompts use up the budget.
    assert request_ids(policy.select(0.0, 10, 2 * PROMPT, cache)) == ["r0", "r1"]
    # Now r3 is inside the window and jumps ahead of r2.
    assert request_ids(policy.select(0.0, 10, UNLIMITED, cache)) == ["r3", "r2"]
    assert len(policy) == 0
