"""``srjf_calibrated`` (PrefillOnly): cache- and wait-calibrated shortest job first."""

from __future__ import annotations

import pytest

from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import EngineRequest, SimEngineConfig
from prefixmesh.services.worker.local import (
    LOCAL_POLICIES,
    SrjfConfig,
    SrjfPolicy,
    make_local_policy,
)
from prefixmesh.shared.costmodel import CostModel
from tests.helpers import FakeView, SimDriver, span

BS = 16
UNLIMITED = 10**9


def _req(rid: str, prompt: list[int], arrival: float = 0.0) -> EngineRequest:
    req = EngineRequest(rid, prompt, max_tokens=1, output_len=1)
    req.arrival = arrival  # the engine stamps this on add()
    return req


def test_srjf_is_registered_and_configurable() -> None:
    assert "srjf_calibrated" in LOCAL_POLICIES
    policy = make_local_policy("srjf_calibrated", SrjfConfig(lambda_tokens_per_s=0))
    assert isinstance(policy, SrjfPolicy) and policy.config.lambda_tokens_per_s == 0
    with pytest.raises(ValueError):
        SrjfConfig(lambda_tokens_per_s=-1)


def test_one_request_per_step_shortest_uncached_first_requeued_first() -> None:
    policy = SrjfPolicy()
    cache = FakeView()
    big, mid, small = (_req("big", span(0, 900)), _req("mid", span(10_000, 500)),
                       _req("small", span(20_000, 100)))
    for r in (big, mid, small):
        policy.push(r, 0.0)
    assert policy.select(0.0, 10, UNLIMITED, cache) == [small]  # never more than one
    policy.requeue_front([small])  # the engine could not place it
    assert policy.select(0.0, 10, UNLIMITED, cache) == [small]
    assert policy.remove("mid") is mid and len(policy) == 1
    assert policy.select(0.0, 0, UNLIMITED, cache) == []  # no free slot
    assert policy.select(0.0, 1, UNLIMITED, cache) == [big]
    assert policy.select(0.0, 1, UNLIMITED, cache) == []


@pytest.mark.parametrize(("now", "first"), [(3.5, "small"), (3.7, "big")])
def test_aging_lets_a_long_waiting_big_request_pass_a_fresh_small_one(
    now: float, first: str
) -> None:
    # Gap: 2000 - 200 = 1800 tokens, so at 500 tokens/s the big one wins after 3.6 s.
    policy = SrjfPolicy()
    cache = FakeView()
    big = _req("big", span(0, 2000), arrival=0.0)
    policy.push(big, 0.0)
    policy.push(_req("small", span(50_000, 200), arrival=now), now)
    assert policy.score(big, now, cache) == pytest.approx(2000 - 500 * now)
    assert [r.request_id for r in policy.select(now, 1, UNLIMITED, cache)] == [first]


def test_prefillonly_four_request_example_on_the_sim_engine() -> None:
    """PrefillOnly's example: A < C < B < D by length, A and D share one prefix, B and C
    another, and the cache holds one prefix at a time. Calibrated SRJF runs A, D, C, B
    (two cache hits); length alone would run A, C, B, D (one)."""
    p1, p2 = span(0, 640), span(100_000, 640)  # 40 blocks each
    prompts = {
        "A": p1 + span(200_000, 64),   # 704 tokens
        "C": p2 + span(300_000, 160),  # 800
        "B": p2 + span(400_000, 256),  # 896
        "D": p1 + span(500_000, 512),  # 1152 = 72 blocks
    }
    cost = CostModel.load("mistral-7b-a6000")
    # 72 KV blocks: the largest request fits, two 40-block prefixes never do together.
    engine = SimEngine(cost, SrjfPolicy(), SimEngineConfig(num_blocks=72))
    for rid in ("D", "B", "C", "A"):  # arrival order is not the answer
        engine.add(EngineRequest(rid, prompts[rid], max_tokens=1, output_len=1), 0.0)
    d = SimDriver(engine)
    d.run()
    assert all(len(plan.requests) == 1 for plan in d.plans)  # one request per step
    assert all(len(outs) == 1 for outs in d.outputs.values())
    order = list(d.outputs)  # by first (here: only) output
    cached = {rid: outs[0].num_cached_tokens for rid, outs in d.outputs.items()}
    assert order == ["A", "D", "C", "B"]
    assert cached == {"A": 0, "D": 640, "C": 0, "B": 640}
