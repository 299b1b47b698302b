"""``sprpt_limited`` (TRAIL): shortest predicted remaining first, limited preemption."""

from __future__ import annotations

import random
import zlib

import pytest

from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import EngineRequest, SimEngineConfig
from prefixmesh.services.worker.local import (
    LOCAL_POLICIES,
    EngineView,
    SprptConfig,
    SprptPolicy,
    make_local_policy,
)
from prefixmesh.shared.blocks import block_hashes
from prefixmesh.shared.costmodel import CostModel
from tests.helpers import FakeView, SimDriver, request_ids

BS = 16
UNLIMITED = 10**9


def _req(rid: str, predicted: float = 0.0, n: int = 64, generated: int = 0,
         blocks: int = 0) -> EngineRequest:
    base = zlib.crc32(rid.encode()) * 1_000
    prompt = list(range(base, base + n))
    req = EngineRequest(rid, prompt, max_tokens=4096, predicted_output=predicted,
                        block_hashes=block_hashes(prompt))
    req.output_token_ids.extend([7] * generated)  # as if it had run that far
    req.block_ids = list(range(blocks))
    return req


def test_sprpt_is_registered_and_configurable() -> None:
    assert "sprpt_limited" in LOCAL_POLICIES
    policy = make_local_policy("sprpt_limited", SprptConfig(preempt_fraction=0.5))
    assert isinstance(policy, SprptPolicy) and policy.config.preempt_fraction == 0.5
    assert isinstance(FakeView(), EngineView)
    with pytest.raises(ValueError):
        SprptConfig(preempt_fraction=1.5)


def test_shorter_predicted_remaining_goes_first() -> None:
    policy = SprptPolicy(SprptConfig(default_prediction=40))
    view = FakeView()
    for rid, pred in [("p50", 50), ("p10", 10), ("none", 0), ("p30", 30)]:
        policy.push(_req(rid, pred), 0.0)
    # A preempted request with 95 of 100 predicted tokens done has 5 left.
    policy.push(_req("p100-done95", 100, generated=95), 0.0)
    assert len(policy) == 5
    assert request_ids(policy.select(0.0, 2, UNLIMITED, view)) == ["p100-done95", "p10"]
    # The request without a prediction counts as default_prediction (40) tokens.
    assert request_ids(policy.select(0.0, 10, UNLIMITED, view)) == ["p30", "none", "p50"]
    assert len(policy) == 0


def test_select_respects_budget_requeue_and_remove() -> None:
    policy = SprptPolicy()
    view = FakeView()
    reqs = [_req(f"r{i}", predicted=10 * (i + 1)) for i in range(4)]
    for r in reversed(reqs):
        policy.push(r, 0.0)
    assert request_ids(policy.select(0.0, 10, 65, view)) == ["r0", "r1"]  # 64 tokens each
    policy.requeue_front([reqs[1]])  # the engine could not place it: offered first
    assert policy.remove("r3") is reqs[3] and policy.remove("r3") is None
    assert {r.request_id for r in policy} == {"r1", "r2"}
    assert request_ids(policy.select(0.0, 10, UNLIMITED, view)) == ["r1", "r2"]


def test_update_prediction_reranks_a_waiting_request() -> None:
    policy = SprptPolicy()
    view = FakeView()
    a, b, c = _req("a", 50), _req("b", 30), _req("c", 40)
    for r in (a, b, c):
        policy.push(r, 0.0)
    policy.update_prediction(a, 5)  # the refined predictor now says a is nearly done
    policy.update_prediction(b, 100)
    assert a.refined_output == 5 and b.refined_output == 100
    assert len(policy) == 3  # re-ranking does not duplicate
    assert request_ids(policy.select(0.0, 10, UNLIMITED, view)) == ["a", "c", "b"]


def test_many_reranks_keep_the_heap_small_and_the_order_right() -> None:
    policy = SprptPolicy()
    view = FakeView()
    rng = random.Random(0)
    reqs = [_req(f"r{i}", predicted=rng.randint(1, 1000)) for i in range(500)]
    for r in reqs:
        policy.push(r, 0.0)
    for _ in range(5000):
        policy.update_prediction(rng.choice(reqs), rng.randint(1, 1000))
    assert len(policy._heap) <= 2 * len(policy) + 64  # stale entries get compacted
    picked = policy.select(0.0, 1000, UNLIMITED, view)
    keys = [r.refined_output or r.predicted_output for r in picked]
    assert len(picked) == 500 and keys == sorted(keys)


def test_preempts_only_inside_the_window_of_floor_c_times_r() -> None:
    policy = SprptPolicy()  # c = 0.8: requests predicted at 1000 are preemptable for 800
    assert policy.preempt_window(_req("x", 1000)) == 800
    past = _req("past", 1000, generated=800, blocks=60)  # 200 left, window over
    inside = _req("inside", 1000, generated=799, blocks=60)  # 201 left, still inside
    for rid in ("s1", "s2"):
        policy.push(_req(rid, 10), 0.0)
    view = FakeView(max_num_seqs=2, num_free_blocks=0)  # no slot and no memory
    assert policy.preempt(0.0, [past, inside], view) == [inside]
    assert len(policy) == 2  # looking at candidates leaves them waiting
    assert request_ids(policy.select(0.0, 10, UNLIMITED, view)) == ["s1", "s2"]


def test_preempts_longest_first_and_only_for_a_shorter_request_without_room() -> None:
    policy = SprptPolicy()
    running = [_req("r300", 300, blocks=10), _req("r900", 900, blocks=10),
               _req("r500", 500, blocks=10)]
    policy.push(_req("w400", 400), 0.0)
    # A free slot and enough KV memory: admit without preempting anyone.
    assert policy.preempt(0.0, running, FakeView(max_num_seqs=4)) == []
    # Slots full: only requests predicted longer than the waiting one (400) qualify,
    # the longest first, one per waiting request.
    assert request_ids(policy.preempt(0.0, running, FakeView(max_num_seqs=3))) == ["r900"]
    # A free slot but no KV memory for its 4 blocks: memory also triggers preemption.
    view = FakeView(max_num_seqs=4, num_free_blocks=3)
    assert request_ids(policy.preempt(0.0, running, view)) == ["r900"]
    # Nothing waiting is shorter than what runs: no preemption.
    policy.select(0.0, 10, UNLIMITED, FakeView())
    policy.push(_req("w950", 950), 0.0)
    assert policy.preempt(0.0, running, FakeView(max_num_seqs=3)) == []


# --------------------------------------------------------------------------- on the engine


@pytest.mark.parametrize(("long_done", "preempted"), [(10, True), (90, False)])
def test_on_the_engine_a_short_request_preempts_a_long_one_only_early(
    long_done: int, preempted: bool
) -> None:
    cost = CostModel.load("mistral-7b-a6000")
    engine = SimEngine(cost, SprptPolicy(), SimEngineConfig(max_num_seqs=1))
    d = SimDriver(engine)
    long = EngineRequest("long", list(range(100)), max_tokens=100, output_len=100,
                         predicted_output=100)
    engine.add(long, 0.0)
    d.step_until(lambda: long.num_output_tokens >= long_done)  # window: first 80 tokens
    short = EngineRequest("short", list(range(5000, 5100)), max_tokens=5, output_len=5,
                          predicted_output=5)
    engine.add(short, d.now)
    d.run()
    done = d.finished()
    short_done, long_done_at = done["short"].finish_time, done["long"].finish_time
    assert short_done is not None and long_done_at is not None
    assert (short_done < long_done_at) is preempted
    assert done["long"].num_preemptions == int(preempted)
    assert done["long"].num_output_tokens == 100


def test_a_reading_on_a_running_request_changes_the_victim() -> None:
    policy = SprptPolicy()
    a, b = _req("a", 600, blocks=10), _req("b", 500, blocks=10)
    policy.push(_req("w", 100), 0.0)
    view = FakeView(max_num_seqs=2)  # both slots taken
    assert request_ids(policy.preempt(0.0, [a, b], view)) == ["a"]
    # The probe now reads b as the longer one (and a as nearly done): b becomes the victim.
    policy.update_prediction(b, 900)
    policy.update_prediction(a, 50)
    assert request_ids(policy.preempt(0.0, [a, b], view)) == ["b"]
    # A reading that makes every running request shorter than the waiting one: no victim.
    policy.update_prediction(b, 80)
    assert policy.preempt(0.0, [a, b], view) == []


def test_a_preempted_request_waits_with_its_latest_reading() -> None:
    policy = SprptPolicy()
    view = FakeView()
    victim = _req("victim", 100, generated=20)  # initial: 80 left
    policy.update_prediction(victim, 300)  # read while it ran: 300 left
    policy.push(victim, 0.0)  # the engine preempted it
    policy.push(_req("mid", 200), 0.0)
    assert request_ids(policy.select(0.0, 10, UNLIMITED, view)) == ["mid", "victim"]


def test_predictions_past_the_budget_count_as_the_budget() -> None:
    policy = SprptPolicy()
    view = FakeView()
    capped = EngineRequest("capped", list(range(64)), max_tokens=50, predicted_output=400)
    capped.output_token_ids.extend([7] * 10)
    assert policy.remaining(capped) == 40  # 50 at most, 10 out
    assert policy.preempt_window(capped) == 40  # floor(0.8 * 50)
    policy.push(capped, 0.0)
    policy.push(_req("p60", 60), 0.0)  # max_tokens 4096: 60 left
    assert request_ids(policy.select(0.0, 10, UNLIMITED, view)) == ["capped", "p60"]
