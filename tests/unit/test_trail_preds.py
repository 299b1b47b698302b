"""The trained predictor's outputs attached to simulated requests (loadgen/trail_preds.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import prefixmesh.loadgen.workloads.sharegpt as sharegpt
from prefixmesh.loadgen.cluster_sim import ClusterConfig, ClusterSim
from prefixmesh.loadgen.trail_preds import (
    Refiner,
    RequestPredictions,
    TrailPredictions,
    trail_requests,
)
from prefixmesh.loadgen.workloads import WorkloadRequest
from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import EngineRequest

# Readings every 8 steps; remaining tokens as the probe + update said at each.
P = RequestPredictions(initial=40.0, steps=(0, 8, 16), remaining=(30.0, 20.0, 6.0))


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def update_prediction(self, request_id: str, remaining_tokens: float) -> bool:
        self.calls.append((request_id, remaining_tokens))
        return True


def _req(rid: str, generated: int) -> EngineRequest:
    r = EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], max_tokens=64)
    r.output_token_ids.extend([7] * generated)
    return r


def test_refiner_passes_each_reading_once_token_t_exists() -> None:
    ref, eng = Refiner(), _Engine()
    ref.attach("a", P)
    req = _req("a", 0)
    assert ref.after_step(eng, [req]) == 0  # prefill only: no token, no hidden state yet
    req.output_token_ids.append(7)  # token 0 exists: reading 0 (remaining 30 from step 0)
    assert ref.after_step(eng, [req]) == 1
    assert eng.calls == [("a", 29.0)]  # 0 + 30 - 1 generated
    req.output_token_ids.extend([7] * 7)  # 8 tokens: reading 8 needs token 8, not yet
    assert ref.after_step(eng, [req]) == 0
    req.output_token_ids.extend([7] * 10)  # 18 tokens: readings 8 and 16 reached, pass 16
    assert ref.after_step(eng, [req]) == 1
    assert eng.calls[-1] == ("a", 4.0)  # 16 + 6 - 18
    req.output_token_ids.extend([7] * 10)
    assert ref.after_step(eng, [req]) == 0  # no readings left
    req.finish_time = 1.0
    ref.after_step(eng, [req])
    assert len(ref) == 0
    assert ref.after_step(eng, [_req("unknown", 5)]) == 0


def test_refined_prediction_never_negative() -> None:
    ref, eng = Refiner(), _Engine()
    ref.attach("a", RequestPredictions(10.0, (0,), (2.0,)))
    ref.after_step(eng, [_req("a", 5)])
    assert eng.calls == [("a", 0.0)]


def test_load_reads_the_eval_file(tmp_path: Path) -> None:
    path = tmp_path / "preds.json"
    path.write_text(json.dumps({"forget": 1.0, "stride": 8, "requests": {
        "conv7": {"length": 20, "initial": 40.0, "steps": [0, 8, 16],
                  "remaining": [30.0, 20.0, 6.0]},
        "conv3": {"length": 5, "initial": 9.5, "steps": [0], "remaining": [4.0]}}}))
    preds = TrailPredictions.load(path)
    assert preds.requests["conv7"] == dataclasses.replace(P, length=20)
    assert preds.budget is None  # ShareGPT's replies: no budget
    assert preds.conversations() == [3, 7]


def test_trail_requests_reuse_conversations_under_new_tenants(monkeypatch) -> None:
    def fake(indices: list[int], tenant: str = "") -> list[WorkloadRequest | None]:
        return [None if i == 5 else WorkloadRequest(prompt=[i] * 20, max_tokens=i,
                                                    prefix_id=f"conv{i}", output_len=i,
                                                    tenant=tenant) for i in indices]

    monkeypatch.setattr(sharegpt, "conversation_requests", fake)
    preds = TrailPredictions({f"conv{i}": P for i in (2, 5, 9)})
    out = trail_requests(preds, 5, seed=0)
    assert [r.prefix_id for r in out[:2]] == [r.prefix_id for r in out[2:4]]
    assert {r.prefix_id for r in out} == {"conv2", "conv9"}  # conv5 fails the filter
    assert [r.tenant for r in out] == ["", "", "~reuse1", "~reuse1", "~reuse2"]
    assert out == trail_requests(preds, 5, seed=0)  # seeded


def test_model_replies_set_the_requests_lengths(monkeypatch, tmp_path: Path) -> None:
    def fake(indices: list[int], tenant: str = "") -> list[WorkloadRequest | None]:
        return [WorkloadRequest(prompt=[i] * 20, max_tokens=900, prefix_id=f"conv{i}",
                                output_len=700, tenant=tenant) for i in indices]

    monkeypatch.setattr(sharegpt, "conversation_requests", fake)
    path = tmp_path / "preds.json"
    path.write_text(json.dumps({"forget": 1.0, "stride": 8, "budget": 512, "requests": {
        "conv1": {"length": 37, "initial": 40.0, "steps": [0], "remaining": [30.0]},
        "conv2": {"length": 512, "initial": 300.0, "steps": [0], "remaining": [400.0]}}}))
    preds = TrailPredictions.load(path)
    assert preds.budget == 512
    out = {r.prefix_id: r for r in trail_requests(preds, 2, seed=0)}
    assert (out["conv1"].output_len, out["conv2"].output_len) == (37, 512)
    assert out["conv1"].max_tokens == out["conv2"].max_tokens == 512
    # Without a budget (ShareGPT's replies) the workload's own lengths stay.
    plain = trail_requests(TrailPredictions(preds.requests), 2, seed=0)
    assert {r.output_len for r in plain} == {700}


def test_cluster_sim_attaches_initial_and_feeds_refinements(monkeypatch) -> None:
    seen: list[tuple[str, float]] = []
    orig = SimEngine.update_prediction

    def spy(self, request_id: str, remaining_tokens: float) -> bool:
        seen.append((request_id, remaining_tokens))
        return orig(self, request_id, remaining_tokens)

    monkeypatch.setattr(SimEngine, "update_prediction", spy)
    reqs = [WorkloadRequest(prompt=list(range(10 + i, 50 + i)), max_tokens=20,
                            prefix_id=f"conv{i}", output_len=20) for i in range(3)]
    preds = TrailPredictions({f"conv{i}": P for i in range(3)})
    cfg = ClusterConfig(gpus=1, policy="round_robin", local_policy="sprpt_limited",
                        predictions="refined", trail=preds)
    run = ClusterSim(cfg).run(reqs, [0.0, 0.0, 0.0])
    assert all(r.ok and r.output_tokens == 20 for r in run.results)
    # Each request: readings 0, 8 and 16 reached (20 tokens), one decode step at a time.
    assert sorted(seen) == sorted((f"r{i}", x) for i in range(3) for x in (29.0, 19.0, 5.0))
    # Initial mode: no refinement at all; the TRAIL modes need the predictor's outputs.
    seen.clear()
    ClusterSim(ClusterConfig(gpus=1, policy="round_robin", local_policy="sprpt_limited",
                             predictions="initial", trail=preds)).run(reqs, [0.0] * 3)
    assert seen == []
    with pytest.raises(ValueError):
        ClusterConfig(predictions="refined")
    with pytest.raises(ValueError):
        ClusterConfig(predictions="psychic")
