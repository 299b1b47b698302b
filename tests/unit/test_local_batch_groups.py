"""``batch_groups`` (BatchLLM): prefix groups run together, memory-bounded batches."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import (
    EngineRequest,
    RequestStatus,
    SimEngineConfig,
)
from prefixmesh.services.worker.local import (
    LOCAL_POLICIES,
    BatchGroupsConfig,
    BatchGroupsPolicy,
    EngineView,
    FcfsPolicy,
    LocalPolicy,
    make_local_policy,
)
from prefixmesh.shared.blocks import block_hashes
from prefixmesh.shared.costmodel import CostModel
from tests.helpers import FakeView, SimDriver, request_ids, span

BS = 16
UNLIMITED = 10**9
ROOM = 100_000  # KV blocks of a view where memory never binds


def _req(rid: str, prompt: list[int], batch: str = "job", max_tokens: int = 16) -> EngineRequest:
    return EngineRequest(rid, prompt, max_tokens=max_tokens, output_len=max_tokens,
                         batch_id=batch, block_hashes=block_hashes(prompt))


def _group(name: str, base: int, prefix: int, distinct: Sequence[int]) -> list[EngineRequest]:
    """Requests ``name0, name1, ...`` sharing a ``prefix``-token prefix."""
    shared = span(base, prefix)
    return [_req(f"{name}{i}", shared + span(base + 10_000 * (i + 1), n))
            for i, n in enumerate(distinct)]


def test_batch_groups_is_registered_and_configurable() -> None:
    assert "batch_groups" in LOCAL_POLICIES
    policy = make_local_policy("batch_groups", BatchGroupsConfig(memory_threshold=0.5))
    assert isinstance(policy, BatchGroupsPolicy) and policy.config.memory_threshold == 0.5
    assert isinstance(FakeView(ROOM, ROOM), EngineView)
    with pytest.raises(ValueError):
        BatchGroupsConfig(memory_threshold=0.0)
    with pytest.raises(ValueError):
        BatchGroupsConfig(kv_tokens=-1)
    # The worker's knob: --batch-kv-tokens / PM_BATCH_KV_TOKENS.
    cfg = WorkerConfig(local_policy="batch_groups", batch_kv_tokens=4096)
    assert cfg.local_policy_config() == BatchGroupsConfig(kv_tokens=4096)
    assert WorkerConfig(local_policy="fcfs", batch_kv_tokens=4096).local_policy_config() is None


def test_requests_are_grouped_by_their_shared_prefix() -> None:
    policy = BatchGroupsPolicy()
    common = span(0, 64)  # a system prompt every request shares: 4 blocks
    docs = [common + span(1000 * (d + 1), 320) for d in range(2)]  # 24 blocks each
    reqs = [_req(f"d{d}q{q}", docs[d] + span(50_000 + 100 * (3 * d + q), 40))
            for d in range(2) for q in range(3)]
    lone = _req("lone", common + span(90_000, 200))
    for r in [*reqs, lone]:
        policy.push(r, 0.0)
    # Each document group shares its 24 blocks; the loner only the 4-block system prompt.
    assert [policy.shared_blocks(r) for r in reqs] == [24] * 6
    assert policy.shared_blocks(lone) == 4
    groups = policy.plan_groups(BS)
    assert sorted(sorted(request_ids(g.members)) for g in groups) == [
        ["d0q0", "d0q1", "d0q2"], ["d1q0", "d1q1", "d1q2"], ["lone"]]


def test_groups_run_by_largest_inverse_total_tokens_first() -> None:
    # L_prefix + sum L_distinct: g1 = 320 + 4 * 32 = 448; g2 = 160 + 2 * 400 = 960;
    # the single request = 300. Count or prefix length would put g1 first, arrival g2.
    g1 = _group("g1-", 0, 320, [32] * 4)
    g2 = _group("g2-", 1_000_000, 160, [400] * 2)
    single = _req("single", span(2_000_000, 300))
    policy = BatchGroupsPolicy()
    rng = random.Random(0)
    reqs = [*g2, *g1, single]
    rng.shuffle(reqs)
    for r in reqs:
        policy.push(r, 0.0)
    view = FakeView(ROOM, ROOM)
    view.cached.update(h for r in reqs for h in r.block_hashes)  # prefixes all cached
    picked = request_ids(policy.select(0.0, 256, UNLIMITED, view))
    assert [rid.split("-")[0].rstrip("0123456789") for rid in picked] == (
        ["single"] + ["g"] * 6)
    assert [rid[:2] for rid in picked[1:]] == ["g1"] * 4 + ["g2"] * 2


def test_a_group_runs_together_after_its_leader_caches_the_prefix() -> None:
    a = _group("a", 0, 480, [40, 48, 56, 64])  # smaller total: runs first
    b = _group("b", 1_000_000, 960, [40, 48, 56])
    policy = BatchGroupsPolicy()
    for r in (b[0], a[2], b[1], a[0], a[3], b[2], a[1]):
        policy.push(r, 0.0)
    view = FakeView(ROOM, ROOM)
    # Step 1: the leader alone, so the others reuse its prefix instead of recomputing it.
    (leader,) = policy.select(0.0, 256, UNLIMITED, view)
    assert leader.request_id.startswith("a")
    leader.status = leader.status.RUNNING  # the engine admitted it
    assert policy.select(0.1, 256, UNLIMITED, view) == []  # prefix not cached yet
    view.cache(leader)  # its prefill step finished
    # Step 3: the rest of group a together, then group b's leader (alone, as before).
    picked = request_ids(policy.select(0.2, 256, UNLIMITED, view))
    assert sorted(picked[:3]) == sorted({"a0", "a1", "a2", "a3"} - {leader.request_id})
    assert picked[3:] == ["b0"]
    assert len(policy) == 2
    # A leader that stopped without caching the prefix hands over to the next member.
    b_leader = next(r for r in b if r.request_id == "b0")
    b_leader.status = b_leader.status.ABORTED
    assert request_ids(policy.select(0.3, 256, UNLIMITED, view)) == ["b1"]


def test_batch_admission_is_bounded_by_kv_memory_not_by_request_count() -> None:
    # Single requests of 160 prompt + 32 output tokens: 12 KV blocks each.
    def fresh(n: int = 300) -> BatchGroupsPolicy:
        policy = BatchGroupsPolicy(BatchGroupsConfig(memory_threshold=0.5))
        for i in range(n):
            policy.push(_req(f"r{i}", span(1000 * i, 160), max_tokens=32), 0.0)
        return policy

    # 1000 blocks, threshold 0.5: 500 blocks = 41 requests, though only 4 slots are free
    # (batch requests hold none).
    assert len(fresh().select(0.0, 4, UNLIMITED, FakeView(1000, 1000))) == 41
    # 300 blocks already referenced by running requests: 200 more = 16 requests.
    assert len(fresh().select(0.0, 256, UNLIMITED, FakeView(1000, 700))) == 16
    # Over the threshold already: nothing; with nothing running, one goes anyway.
    assert fresh().select(0.0, 256, UNLIMITED, FakeView(1000, 400)) == []
    assert len(fresh().select(0.0, 256, UNLIMITED, FakeView(10, 10))) == 1
    # The token budget (chunk size) bounds a step too: 13 prompts start in 2048 tokens.
    assert len(fresh().select(0.0, 256, 2048, FakeView(1000, 1000))) == 13
    # The threshold in tokens: 240 blocks' worth = 20 requests, whatever the pool.
    kv = BatchGroupsPolicy(BatchGroupsConfig(kv_tokens=240 * BS))
    for i in range(30):
        kv.push(_req(f"r{i}", span(1000 * i, 160), max_tokens=32), 0.0)
    assert len(kv.select(0.0, 4, UNLIMITED, FakeView(10_000, 10_000))) == 20


def test_interactive_requests_go_first_and_are_never_starved() -> None:
    policy = BatchGroupsPolicy(BatchGroupsConfig(memory_threshold=0.5))
    for i in range(100):
        policy.push(_req(f"b{i}", span(1000 * i, 160), max_tokens=32), 0.0)
    chat = [_req(f"chat{i}", span(900_000 + 1000 * i, 160), batch="") for i in range(3)]
    assert policy.takes_slot(chat[0]) and not policy.takes_slot(_req("b", span(0, 16)))
    for i, r in enumerate(chat):
        policy.push(r, float(i))
    view = FakeView(1000, 1000)
    picked = request_ids(policy.select(0.0, 10, UNLIMITED, view))
    # 10 slots bound the interactive requests only; batch ones fill the 500-block
    # threshold: (500 - 3 * 12) // 12 = 38 of them.
    assert picked[:3] == ["chat0", "chat1", "chat2"] and len(picked) == 3 + 38
    # With no slot free, interactive requests wait and batch ones still go.
    policy.push(_req("chat3", span(980_000, 160), batch=""), 0.5)
    picked = request_ids(policy.select(0.5, 0, UNLIMITED, FakeView(1000, 900)))
    assert picked == [f"b{i}" for i in range(38, 38 + 33)]  # (500 - 100) // 12
    # Batch work fills memory up to the threshold; a new interactive request still goes.
    late = _req("late", span(990_000, 160), batch="")
    policy.push(late, 1.0)
    assert request_ids(policy.select(1.0, 10, UNLIMITED, FakeView(1000, 500))) == [
        "chat3", "late"]


def _run(policy: LocalPolicy, reqs: list[EngineRequest]) -> list[EngineRequest]:
    """Run ``reqs`` to completion; returns them in the order they were first scheduled."""
    cost = CostModel.load("mistral-7b-a6000")
    engine = SimEngine(cost, policy, SimEngineConfig())
    for r in reqs:
        engine.add(r, 0.0)
    d = SimDriver(engine)
    d.run()
    assert all(r.finish_time is not None for r in reqs)
    return d.started()


def test_on_the_engine_groups_share_their_prefix_and_run_contiguously() -> None:
    def workload() -> list[EngineRequest]:
        reqs = [r for g in range(4) for r in _group(f"g{g}-", 1_000_000 * g, 1600,
                                                    [40 + 8 * i for i in range(5)])]
        random.Random(1).shuffle(reqs)
        return reqs

    done = _run(BatchGroupsPolicy(), workload())
    assert len(done) == 20
    order = [r.request_id.split("-")[0] for r in done]
    assert order == sorted(order, key=order.index)  # each group's requests are contiguous
    # Every member but the leader reuses the 1600-token prefix.
    assert sorted(r.num_cached_tokens for r in done) == [0] * 4 + [1600] * 16
    # FCFS admits the shuffled requests together and recomputes each prefix repeatedly.
    fcfs_cached = sum(r.num_cached_tokens for r in _run(FcfsPolicy(), workload()))
    assert fcfs_cached < 16 * 1600


def _sim(policy: LocalPolicy, **limits: int) -> tuple[SimEngine, SimDriver]:
    engine = SimEngine(CostModel.load("mistral-7b-a6000"), policy, SimEngineConfig(**limits))
    return engine, SimDriver(engine)


def _used_kv_tokens(engine: SimEngine) -> int:
    return (engine.num_blocks - engine.num_free_blocks) * engine.block_size


def test_a_planned_batch_runs_beyond_max_num_seqs_up_to_the_kv_token_threshold() -> None:
    # 32-token prompts + 160 output tokens: 12 blocks (192 tokens) each at their end, 2 at
    # admission; the threshold holds 10 of them, the engine has 4 sequence slots.
    threshold = 10 * 192
    engine, d = _sim(BatchGroupsPolicy(BatchGroupsConfig(kv_tokens=threshold)),
                     max_num_seqs=4)
    batch = [_req(f"b{i}", span(1000 * i, 32), max_tokens=160) for i in range(30)]
    for r in batch:
        engine.add(r, 0.0)
    d.step()
    assert engine.num_running == 10 > engine.max_num_seqs
    # Held at the threshold while the batch drains: never more KV than it allows.
    peak = 0
    while d.step() is not None:
        peak = max(peak, engine.num_running)
        assert _used_kv_tokens(engine) <= threshold
    assert peak == 10 and all(r.finish_time is not None for r in batch)
    # Under fcfs, or with batch_slots (the request-count baseline), the same requests are
    # capped at max_num_seqs.
    for policy in (FcfsPolicy(), BatchGroupsPolicy(BatchGroupsConfig(batch_slots=True))):
        engine, d = _sim(policy, max_num_seqs=4)
        for i in range(30):
            engine.add(_req(f"b{i}", span(1000 * i, 32), max_tokens=160), 0.0)
        d.step()
        assert engine.num_running == 4


def test_interactive_requests_keep_every_slot_beside_a_batch() -> None:
    engine, d = _sim(BatchGroupsPolicy(BatchGroupsConfig(kv_tokens=10 * 192)), max_num_seqs=4)
    for i in range(30):
        engine.add(_req(f"b{i}", span(1000 * i, 160), max_tokens=32), 0.0)
    d.step()
    assert engine.num_running == 10
    chat = [_req(f"chat{i}", span(900_000 + 1000 * i, 160), batch="", max_tokens=32)
            for i in range(6)]
    for r in chat:
        engine.add(r, d.now)
    d.step()
    # All four slots go to interactive requests at once; the batch keeps running.
    assert [r.request_id for r in chat if r.first_scheduled is not None] == [
        "chat0", "chat1", "chat2", "chat3"]
    assert engine.num_running == 14
    d.step_until(lambda: chat[4].first_scheduled is not None)
    assert all(r.finish_time is not None for r in chat[:4])


def test_requests_without_a_slot_stop_where_a_step_could_not_decode_them_all() -> None:
    # 64 tokens a step, 60 slots: at most 4 batch requests beside the slot holders.
    engine, d = _sim(BatchGroupsPolicy(), max_num_seqs=60, max_batched_tokens=64)
    batch = [_req(f"b{i}", span(1000 * i, 8), max_tokens=64) for i in range(10)]
    for r in batch:
        engine.add(r, 0.0)
    chat = [_req(f"chat{i}", span(900_000 + 1000 * i, 8), batch="", max_tokens=64)
            for i in range(7)]
    for r in chat:
        engine.add(r, 0.0)
    most = 0
    for _ in range(30):
        d.step()
        running = sum(r.status is RequestStatus.RUNNING for r in batch)
        assert running <= 4 and engine.num_running <= 64
        most = max(most, running)
    assert most == 4
    assert all(r.first_scheduled is not None for r in chat)
