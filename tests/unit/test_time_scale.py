"""The sim time scale: the worker's model clock and step pacing (engine/pacing.py), the
scheduler's policy clock, and the conversion of a slowed run back to model time."""

from __future__ import annotations

import pytest

from prefixmesh.loadgen.results import RequestResult, send_lag, summarize, to_model_time
from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService
from prefixmesh.services.worker.engine.pacing import Pacer
from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import EngineRequest
from prefixmesh.shared.costmodel import CostModel


class FakeWall:
    """A wall clock the test moves by hand (seconds)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_model_clock_runs_k_times_slower() -> None:
    wall = FakeWall(100.0)
    pacer = Pacer(4.0, wall)
    assert pacer.now() == pytest.approx(25.0)
    wall.t += 8.0  # 8 wall seconds are 2 model seconds
    assert pacer.now() == pytest.approx(27.0)


def test_step_sleeps_k_times_its_modelled_duration() -> None:
    cost = CostModel.load("mistral-7b-a6000")
    wall = FakeWall(40.0)
    pacer = Pacer(4.0, wall)
    engine = SimEngine(cost)
    engine.add(EngineRequest(request_id="r", prompt_token_ids=list(range(100, 612)),
                             max_tokens=1, output_len=1), pacer.now())
    start = pacer.now()
    plan = engine.plan_step(start)
    assert plan is not None and plan.duration > 0
    deadline = start + plan.duration
    # The worker's loop sleeps this long: K times the modelled step, in wall seconds.
    assert pacer.sleep_for(deadline) == pytest.approx(4.0 * plan.duration)
    wall.t += 4.0 * plan.duration  # woke on time
    pacer.woke(deadline, plan.duration)
    out = engine.finish_step(plan, deadline)
    assert out[0].finished
    req_latency = deadline - start  # model seconds, as the engine records them
    assert req_latency == pytest.approx(plan.duration)
    lag = pacer.lag.as_dict()
    assert lag["steps"] == 1 and lag["lag_s"] == pytest.approx(0.0, abs=1e-9)
    assert lag["planned_s"] == pytest.approx(4.0 * plan.duration)


def test_late_wake_up_counts_as_step_lag_and_reset_clears_it() -> None:
    wall = FakeWall(0.0)
    pacer = Pacer(2.0, wall)
    assert pacer.sleep_for(-1.0) == 0.0  # a deadline already past: no sleep
    wall.t = 2.0 * 0.5 + 0.1  # a step planned to end at model 0.5 woke 0.1 s late
    pacer.woke(0.5, 0.5)
    wall.t = 2.0 * 1.0 + 0.3
    pacer.woke(1.0, 0.5)
    lag = pacer.lag.as_dict()
    assert lag["steps"] == 2 and lag["planned_s"] == pytest.approx(2.0)
    assert lag["lag_s"] == pytest.approx(0.4) and lag["max_lag_s"] == pytest.approx(0.3)
    assert lag["lag_ratio"] == pytest.approx(0.2)
    pacer.reset_lag()
    assert pacer.lag.as_dict()["steps"] == 0


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_time_scale_must_be_positive(scale: float) -> None:
    with pytest.raises(ValueError):
        Pacer(scale)
    with pytest.raises(ValueError):
        SchedulerService(SchedulerConfig(time_scale=scale))


def test_scheduler_policy_clock_is_model_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import prefixmesh.services.scheduler.service as svc

    monkeypatch.setattr(svc.time, "monotonic", lambda: 80.0)
    assert SchedulerService(SchedulerConfig(time_scale=8.0)).policy_now() == 10.0
    assert SchedulerService(SchedulerConfig()).policy_now() == 80.0


def test_results_convert_back_to_model_time() -> None:
    k = 4.0
    results = [RequestResult(ok=True, latency_s=k * x, ttft_s=k * 0.1, prompt_tokens=100,
                             cached_tokens=50, output_tokens=11, send_lag_s=0.002 * i)
               for i, x in enumerate((1.0, 2.0, 3.0, 4.0))]
    wall_row = summarize(results, 10.0 * k, policy="p", rate=2.0)
    wall_row.update(send_lag(results))
    row = to_model_time(wall_row, k)
    assert row["latency_avg_s"] == pytest.approx(2.5)
    assert row["latency_p50_s"] == pytest.approx(2.0)
    assert row["latency_p99_s"] == pytest.approx(4.0)
    assert row["ttft_avg_s"] == pytest.approx(0.1) and row["ttft_p99_s"] == pytest.approx(0.1)
    assert row["tpot_avg_s"] == pytest.approx(wall_row["tpot_avg_s"] / k)
    assert row["throughput_rps"] == pytest.approx(0.4)  # 4 requests in 10 model seconds
    # Ratios, counts, labels and wall-clock fields are unchanged.
    for key in ("cache_hit_ratio", "completed", "rate", "policy", "send_lag_max_wall_s"):
        assert row[key] == wall_row[key]
    assert row["send_lag_max_wall_s"] == pytest.approx(0.006)
    assert row["time_scale"] == k and row["times"] == "model"
    assert to_model_time(wall_row, 1.0)["times"] == "wall"
