"""The simulated GPU engine (services/worker/engine/sim.py): vLLM-like behaviour in virtual
time."""

from __future__ import annotations

import zlib

import pytest

from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import (
    DEFAULT_OUTPUT_TOKEN_POOL,
    EngineRequest,
    SimEngineConfig,
    StepPlan,
)
from prefixmesh.services.worker.local import FcfsPolicy, LocalPolicy, PrefixFairPolicy
from prefixmesh.shared.blocks import block_hashes
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.wire import AllBlocksCleared, BlockStored
from tests.helpers import SimDriver, replay_kv_events, span

BS = 16


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel.load("mistral-7b-a6000")


def _req(rid: str, prompt: list[int], out: int = 4, max_tokens: int = 64, **kw) -> EngineRequest:
    return EngineRequest(rid, prompt, max_tokens=max_tokens, output_len=out, **kw)


def _driven(cost: CostModel, policy: LocalPolicy | None = None,
            **config: object) -> tuple[SimEngine, SimDriver]:
    """A sim engine (``config``: SimEngineConfig fields) and a driver for it, at time 0."""
    engine = SimEngine(cost, policy, SimEngineConfig(**config))  # type: ignore[arg-type]
    return engine, SimDriver(engine)


def _t(value: float | None) -> float:
    """A timing that must have been recorded."""
    assert value is not None
    return value


def _expected_tokens(rid: str, n: int) -> list[int]:
    pool = DEFAULT_OUTPUT_TOKEN_POOL
    seed = zlib.crc32(rid.encode())
    return [pool[(seed + i) % len(pool)] for i in range(n)]


# --------------------------------------------------------------------------- step timing


def test_prefill_time_matches_cost_model_chunking(cost: CostModel) -> None:
    engine, d = _driven(cost)
    prompt_len = 5000  # three chunks of the 2048-token budget
    engine.add(_req("a", span(0, prompt_len), out=1), 0.0)
    d.run()
    assert [p.batch for p in d.plans] == [[(2048, 2048)], [(2048, 4096)], [(904, 5000)]]
    req = d.outputs["a"][-1].request
    assert req.ttft_s == pytest.approx(cost.prefill_time(prompt_len))
    assert [len(o.new_token_ids) for o in d.outputs["a"]] == [0, 0, 1]  # final chunk samples
    assert [o.first_token for o in d.outputs["a"]] == [False, False, True]


def test_cached_prefix_cuts_prefill(cost: CostModel) -> None:
    engine, d = _driven(cost)
    prompt = span(0, 3000)
    engine.add(_req("cold", prompt, out=2), d.now)
    d.run()
    engine.add(_req("warm", prompt, out=2), d.now)
    d.run()
    cold = d.outputs["cold"][-1].request
    warm = d.outputs["warm"][-1].request
    assert cold.num_cached_tokens == 0
    # Whole blocks, never the block holding the last token: 2992 of 3000.
    assert warm.num_cached_tokens == (3000 - 1) // BS * BS == 2992
    assert all(o.num_cached_tokens == 2992 for o in d.outputs["warm"])
    warm_prefill = _t(warm.first_token_time) - _t(warm.first_scheduled)
    assert warm_prefill == pytest.approx(cost.prefill_time(8, 2992))
    assert warm_prefill < (_t(cold.first_token_time) - _t(cold.first_scheduled)) / 10


def test_prompt_fully_cached_recomputes_its_last_block(cost: CostModel) -> None:
    engine, d = _driven(cost)
    engine.add(_req("a", span(0, 64), out=1), 0.0)
    d.run()
    engine.add(_req("b", span(0, 64), out=1), d.now)
    d.run()
    assert d.outputs["b"][0].num_cached_tokens == 48
    assert d.plans[-1].batch == [(16, 64)]


def test_decode_step_time_grows_with_batch_context(cost: CostModel) -> None:
    def decode_step(prompt_len: int) -> StepPlan:
        engine, d = _driven(cost)
        for i in range(8):
            engine.add(_req(f"r{i}", span(i * 100_000, prompt_len), out=100), 0.0)
        while True:
            plan = d.step()
            assert plan is not None
            if plan.decode_tokens == 8:
                return plan

    short, long = decode_step(200), decode_step(4000)
    assert short.batch == [(1, 201)] * 8
    assert long.prefill_tokens == 0 and all(e == 1 for e, _ in long.batch)
    ctx = sum(s for _, s in long.batch)
    assert ctx > 8 * 4000
    assert short.duration == pytest.approx(cost.step_time(short.batch))
    # Profile: 8 tokens -> linear floor 22 ms; attention 1.86e-4 * ctx + 0.159 ms; / 0.9.
    assert long.duration == pytest.approx((22 + 1.86e-4 * ctx + 0.159) / 0.9 * 1e-3)
    assert long.duration > short.duration


# --------------------------------------------------------------------------- batching


def test_decodes_first_then_prefill_chunks_with_budget(cost: CostModel) -> None:
    engine, d = _driven(cost, max_batched_tokens=1000)
    engine.add(_req("short", span(0, 100), out=50), 0.0)
    d.step()
    engine.add(_req("long", span(10_000, 2500), out=1), d.now)
    plans = [d.step() for _ in range(3)]
    assert [p.batch for p in plans] == [  # type: ignore[union-attr]
        [(1, 101), (999, 999)],
        [(1, 102), (999, 1998)],
        [(1, 103), (502, 2500)],
    ]
    assert [o.new_token_ids for o in d.outputs["long"]] == [[], [], [d.tokens("long")[0]]]


def test_prefill_chunk_cap(cost: CostModel) -> None:
    engine, d = _driven(cost, max_prefill_chunk=512)
    engine.add(_req("a", span(0, 1200), out=1), 0.0)
    d.run()
    assert [p.batch for p in d.plans] == [[(512, 512)], [(512, 1024)], [(176, 1200)]]
    with pytest.raises(ValueError):
        SimEngine(cost, config=SimEngineConfig(max_num_seqs=300, max_batched_tokens=256))


def test_max_num_seqs_queues_the_rest(cost: CostModel) -> None:
    engine, d = _driven(cost, max_num_seqs=2)
    for i in range(3):
        engine.add(_req(f"r{i}", span(i * 1000, 32), out=3), 0.0)
    d.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    d.run()
    r0, r2 = d.outputs["r0"][-1].request, d.outputs["r2"][-1].request
    assert r2.first_scheduled == r0.finish_time  # admitted once a slot freed
    assert r2.queue_s == pytest.approx(r0.latency_s)
    assert r0.queue_s == 0.0


# --------------------------------------------------------------------------- outputs


@pytest.mark.parametrize(
    ("output_len", "max_tokens", "n", "reason"),
    [(5, 10, 5, "stop"), (10, 10, 10, "length"), (50, 10, 10, "length"), (0, 7, 7, "length")],
)
def test_output_length_rules(
    cost: CostModel, output_len: int, max_tokens: int, n: int, reason: str
) -> None:
    engine, d = _driven(cost)
    engine.add(_req("x", span(0, 40), out=output_len, max_tokens=max_tokens), 0.0)
    d.run()
    outs = d.outputs["x"]
    assert d.tokens("x") == _expected_tokens("x", n)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == reason and outs[-1].request.finish_reason == reason
    assert sum(o.first_token for o in outs) == 1
    req = outs[-1].request
    assert req.arrival == 0.0 and req.first_scheduled == 0.0
    assert 0 < req.first_token_time < req.finish_time == d.now  # type: ignore[operator]


def test_output_tokens_are_deterministic_across_engines(cost: CostModel) -> None:
    runs = []
    for _ in range(2):
        engine, d = _driven(cost)
        engine.add(_req("same-id", span(0, 20), out=30, max_tokens=30), 0.0)
        d.run()
        runs.append(d.tokens("same-id"))
    assert runs[0] == runs[1] == _expected_tokens("same-id", 30)


# --------------------------------------------------------------------------- memory


def test_running_blocks_are_protected_and_admission_waits(cost: CostModel) -> None:
    # 8 blocks: A holds 5 (70 prompt + 9 output tokens), B needs 4 at admission.
    engine, d = _driven(cost, num_blocks=8)
    engine.add(_req("A", span(0, 70), out=10), 0.0)
    d.step()
    held = list(engine.get("A").block_ids)  # type: ignore[union-attr]
    engine.add(_req("B", span(5000, 60), out=1), d.now)
    d.step()
    assert engine.num_waiting == 1  # no room: B waits rather than evicting A's blocks
    assert all(engine.cache.ref_count(b) == 1 for b in held)
    d.run()
    b, a = d.outputs["B"][-1].request, d.outputs["A"][-1].request
    assert _t(b.first_scheduled) >= _t(a.finish_time)


class _CountingFcfs(FcfsPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.selects = 0

    def select(self, now, max_requests, token_budget, cache):  # type: ignore[no-untyped-def]
        self.selects += 1
        return super().select(now, max_requests, token_budget, cache)


def test_admission_blocked_on_memory_waits_for_free_blocks(cost: CostModel) -> None:
    policy = _CountingFcfs()
    engine, d = _driven(cost, num_blocks=8, policy=policy)
    engine.add(_req("A", span(0, 70), out=10), 0.0)
    d.step()
    engine.add(_req("B", span(5000, 60), out=1), d.now)
    for _ in range(5):
        d.step()
    assert policy.selects == 2  # A's admission, then B's failed try; no retry while full
    d.run()
    assert d.tokens("B") == _expected_tokens("B", 1)


def test_preemption_by_recompute_when_memory_runs_out(cost: CostModel) -> None:
    # 12 blocks; three requests of 48 prompt + 60 output tokens need 7 blocks each.
    engine, d = _driven(cost, num_blocks=12)
    for i in range(3):
        engine.add(_req(f"r{i}", span(i * 1000, 48), out=60), 0.0)
    d.run()
    preempted = [rid for p in d.plans for rid in p.preempted]
    assert preempted and preempted[0] == "r2"  # the most recently admitted goes first
    for i in range(3):
        rid = f"r{i}"
        assert d.tokens(rid) == _expected_tokens(rid, 60)  # no token lost or repeated
        assert d.outputs[rid][-1].finish_reason == "stop"
    victim = d.outputs["r2"][-1].request
    assert victim.num_preemptions >= 1 and victim.num_cached_tokens == 0
    # Admission is skipped in a step that preempted (vLLM).
    for p in d.plans:
        if p.preempted:
            assert all(r.first_scheduled != p.started for r in p.requests)
    assert engine.cache.num_free == 12
    assert engine.stats(d.now).preemptions == len(preempted)


def test_abort_frees_blocks_at_once(cost: CostModel) -> None:
    engine, d = _driven(cost, num_blocks=64, max_num_seqs=1)
    engine.add(_req("run", span(0, 100), out=50), 0.0)
    engine.add(_req("wait", span(1000, 100), out=5), 0.0)
    d.step()
    assert engine.cache.num_free == 64 - 7
    assert engine.abort("run", d.now) and engine.cache.num_free == 64
    assert not engine.abort("run", d.now) and not engine.abort("nope", d.now)
    # Its full prompt blocks stay cached (evictable).
    assert engine.cached_prefix_tokens(block_hashes(span(0, 100))) == 96
    engine.add(_req("gone", span(2000, 10), out=5), d.now)
    assert engine.abort("gone", d.now) and engine.num_waiting == 1
    # Abort while a step is in flight: the request is dropped from the plan's results.
    plan = engine.plan_step(d.now)
    assert plan is not None and plan.requests[0].request_id == "wait"
    assert engine.abort("wait", d.now)
    assert engine.finish_step(plan, d.now + plan.duration) == []
    assert engine.plan_step(d.now) is None and not engine.has_work()


# --------------------------------------------------------------------------- KV events


def test_kv_events_cover_prompt_and_output_blocks(cost: CostModel) -> None:
    engine, d = _driven(cost)
    prompt = span(0, 40)  # 2 full blocks + 8 tokens
    engine.add(_req("a", prompt, out=30, tenant="t1"), 0.0)
    d.step()
    hashes = block_hashes(prompt, "t1")
    assert d.events == [
        BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=prompt[:32], block_size=BS
        )
    ]
    d.run()
    seq = prompt + d.tokens("a")  # 70 tokens; KV exists for the first 69
    all_hashes = block_hashes(seq, "t1")
    stored = [ev for ev in d.events if isinstance(ev, BlockStored)]
    assert [ev.block_hashes for ev in stored] == [all_hashes[:2], [all_hashes[2]], [all_hashes[3]]]
    assert stored[1].parent_block_hash == all_hashes[1]
    assert stored[1].token_ids == seq[32:48] and stored[2].token_ids == seq[48:64]
    assert engine.cached_prefix_tokens(all_hashes) == 64  # multi-turn continuations hit


def test_multi_turn_continuation_hits_output_blocks(cost: CostModel) -> None:
    engine, d = _driven(cost)
    first = span(0, 40)
    engine.add(_req("turn1", first, out=30), 0.0)
    d.run()
    second = first + d.tokens("turn1") + span(9000, 20)
    engine.add(_req("turn2", second, out=2), d.now)
    d.run()
    assert d.outputs["turn2"][0].num_cached_tokens == 64


def test_eviction_emits_block_removed(cost: CostModel) -> None:
    engine, d = _driven(cost, num_blocks=6)
    a = span(0, 64)
    engine.add(_req("a", a, out=1), 0.0)
    d.run()
    d.events.clear()
    engine.add(_req("b", span(5000, 64), out=1), d.now)
    d.step()
    removed = d.removed()
    # 6 blocks: "a" left 4 cached and 2 empty; "b" needs 4: the 2 empty ones first, then 2
    # evictions, the last block of "a" first (its prefix stays usable).
    assert removed == block_hashes(a)[::-1][:2]
    assert engine.cached_prefix_tokens(block_hashes(a)) == 32


def test_eviction_is_least_recently_used_first(cost: CostModel) -> None:
    engine, d = _driven(cost, num_blocks=8)
    a, b = span(0, 64), span(5000, 64)
    for rid, prompt in [("a", a), ("b", b), ("a-again", a)]:  # "a" is now the fresher one
        engine.add(_req(rid, prompt, out=1), d.now)
        d.run()
    assert d.outputs["a-again"][0].num_cached_tokens == 48
    d.events.clear()
    engine.add(_req("c", span(9000, 64), out=1), d.now)
    d.run()
    removed = d.removed()
    assert removed[:4] == block_hashes(b)[::-1]  # all of "b" goes before any of "a"
    assert engine.cached_prefix_tokens(block_hashes(a)) > 0
    assert engine.cached_prefix_tokens(block_hashes(b)) == 0


def test_snapshot_events_match_the_event_stream(cost: CostModel) -> None:
    engine, d = _driven(cost, num_blocks=40)
    base = span(0, 100)
    for i in range(6):
        engine.add(_req(f"r{i}", base + span(1000 * (i + 1), 60 + 7 * i), out=20), d.now)
        d.step()
    d.run()
    live = replay_kv_events(d.events)
    assert live and set(live) == set(engine.cache.cached_hashes())
    snap = engine.snapshot_events()
    assert isinstance(snap[0], AllBlocksCleared)
    assert replay_kv_events(snap) == live


def test_reset_cache_only_when_idle(cost: CostModel) -> None:
    engine, d = _driven(cost)
    engine.add(_req("a", span(0, 100), out=3), 0.0)
    d.step()
    assert engine.reset_cache() is False
    d.run()
    assert engine.reset_cache() is True
    assert engine.take_kv_events()[-1] == AllBlocksCleared()
    assert engine.cached_prefix_tokens(block_hashes(span(0, 100))) == 0


def test_tenant_salt_prevents_cross_tenant_hits(cost: CostModel) -> None:
    engine, d = _driven(cost)
    prompt = span(0, 500)
    for rid, tenant in [("a1", "acme"), ("b1", "bravo"), ("a2", "acme")]:
        engine.add(_req(rid, prompt, out=1, tenant=tenant), d.now)
        d.run()
    assert d.outputs["b1"][0].num_cached_tokens == 0
    assert d.outputs["a2"][0].num_cached_tokens == 496


# --------------------------------------------------------------------------- API contract


def test_stats_window(cost: CostModel) -> None:
    engine, d = _driven(cost, stats_window_s=5.0)
    prompt = span(0, 1000)
    engine.add(_req("a", prompt, out=10), 0.0)
    engine.add(_req("b", prompt, out=10), 0.0)
    st = engine.stats(0.0)
    assert (st.running, st.waiting, st.outstanding_tokens) == (0, 2, 2020)
    d.step()
    st = engine.stats(d.now)
    # Same-step admissions do not share: both prefill 1000 tokens and sample one.
    assert (st.running, st.waiting, st.outstanding_tokens) == (2, 0, 18)
    # 62 full prompt blocks computed twice are stored once (the copy is given back) + 2 tails.
    assert st.free_blocks == st.total_blocks - 62 - 2
    d.run()
    engine.add(_req("c", prompt, out=10), d.now)
    d.run()
    st = engine.stats(d.now)
    assert st.hit_ratio == pytest.approx(992 / 3000)
    # Decode: 9 tokens each after the first; prefill: 2 x 1000 + 8 uncached tokens of "c".
    assert st.decode_share == pytest.approx(27 / (27 + 2008))
    assert st.steps == len(d.plans) and st.avg_step_s == pytest.approx(d.now / len(d.plans))
    assert st.avg_queue_s == 0.0 and st.outstanding_tokens == 0
    later = engine.stats(d.now + 10.0)
    assert (later.steps, later.decode_share, later.hit_ratio) == (0, 0.0, 0.0)


def test_add_validates(cost: CostModel) -> None:
    engine = SimEngine(cost, config=SimEngineConfig(num_blocks=4))
    engine.add(_req("a", span(0, 10)), 0.0)
    with pytest.raises(ValueError, match="already"):
        engine.add(_req("a", span(0, 10)), 0.0)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add(_req("big", span(0, 60), out=10), 0.0)
    with pytest.raises(ValueError, match="block_hashes"):
        engine.add(_req("bad", span(0, 40), block_hashes=[1]), 0.0)
    with pytest.raises(ValueError, match="empty"):
        _req("empty", [])


def test_plan_must_be_finished_before_the_next(cost: CostModel) -> None:
    engine = SimEngine(cost)
    assert engine.plan_step(0.0) is None
    engine.add(_req("a", span(0, 10)), 0.0)
    plan = engine.plan_step(0.0)
    assert plan is not None
    with pytest.raises(RuntimeError):
        engine.plan_step(0.0)
    engine.finish_step(plan, plan.duration)
    with pytest.raises(RuntimeError):
        engine.finish_step(plan, plan.duration)


class _EvictFirstRunning(FcfsPolicy):
    """FCFS that asks to preempt the oldest running request whenever someone waits."""

    def preempt(self, now, running, cache):  # type: ignore[no-untyped-def]
        return [running[0]]


def test_policy_preemption_still_admits_in_the_same_step(cost: CostModel) -> None:
    engine, d = _driven(cost, max_num_seqs=1, policy=_EvictFirstRunning())
    engine.add(_req("old", span(0, 100), out=20), 0.0)
    d.step()
    engine.add(_req("new", span(1000, 100), out=1), d.now)
    plan = d.step()
    assert plan is not None and plan.preempted == ["old"]
    assert [r.request_id for r in plan.requests] == ["new"]
    d.run()
    assert d.tokens("old") == _expected_tokens("old", 20)  # resumed by recompute
    assert d.outputs["old"][-1].request.num_preemptions == 1


def test_prefix_fair_policy_drives_the_engine(cost: CostModel) -> None:
    engine, d = _driven(cost, max_num_seqs=1, policy=PrefixFairPolicy())
    shared = span(0, 960)
    engine.add(_req("seed", shared + span(50_000, 40), out=1), 0.0)
    d.run()
    engine.add(_req("cold", span(90_000, 1000), out=1), d.now)
    engine.add(_req("hot", shared + span(60_000, 40), out=1), d.now)
    d.run()
    # The mostly cached request is admitted first although it arrived second.
    hot, cold = d.outputs["hot"][0].request, d.outputs["cold"][0].request
    assert hot.first_scheduled < cold.first_scheduled  # type: ignore[operator]
    assert hot.num_cached_tokens == 960


def test_finished_only_outputs_change_nothing_but_the_outputs(cost: CostModel) -> None:
    """The cluster simulator's mode: same steps, timings and events; only finished outputs."""
    runs = []
    for finished_only in (False, True):
        engine = SimEngine(cost, config=SimEngineConfig(max_num_seqs=4))
        for i in range(6):
            engine.add(_req(f"r{i}", span(0, 40) + span(1000 * i, 200), out=5 + i), 0.0)
        now, outs, durations, events = 0.0, [], [], []
        while (plan := engine.plan_step(now)) is not None:
            now += plan.duration
            durations.append(plan.duration)
            outs.append(engine.finish_step(plan, now, finished_only=finished_only))
            events += engine.take_kv_events()
        runs.append((outs, durations, events))
    (all_outs, d1, e1), (fin_outs, d2, e2) = runs
    assert d1 == d2 and e1 == e2
    assert any(not o.finished for step in all_outs for o in step)
    assert [[o.request_id for o in s if o.finished] for s in all_outs] == [
        [o.request_id for o in s] for s in fin_outs]
    assert all(o.finished for step in fin_outs for o in step)
