"""Virtual-time cluster simulator: real policy objects against simulated GPUs, one process.

The global policy (``prefixmesh.services.scheduler.policies``), the local policies and the ``sim``
engine are the very objects the live mesh runs; only the clock and the bus are replaced.
An event heap orders arrivals, engine step completions, load reports and policy ticks.
Messages the live mesh carries over NATS are delivered here at the instant they are sent
(the live mesh adds ~1 ms per hop), so the two agree closely; the fidelity benchmark
(``loadgen/fidelity.py``) measures by how much.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixmesh.loadgen.ideal import IDEAL, IdealPolicy, ideal_engine
from prefixmesh.loadgen.results import RequestResult
from prefixmesh.loadgen.sim_replicas import ReplicaConfig, ReplicatedPolicy
from prefixmesh.loadgen.trail_preds import (
    PREDICTION_MODES,
    TRAIL_MODES,
    Refiner,
    TrailPredictions,
)
from prefixmesh.loadgen.workloads import WorkloadRequest
from prefixmesh.services.scheduler.policies import make_policy
from prefixmesh.services.scheduler.policies.base import (
    Decision,
    NoWorkerError,
    PolicyConfig,
    RouteInput,
)
from prefixmesh.services.worker.engine.sim import SimEngine, SimEngineConfig
from prefixmesh.services.worker.engine.types import EngineRequest, StepPlan
from prefixmesh.services.worker.local import LocalPolicyConfig, make_local_policy
from prefixmesh.services.worker.reports import done_record, load_report
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel
from prefixmesh.shared.wire import KvEvent, LoadReportEvent, RequestDoneEvent

# Event kinds, in tie-break order at equal times: finish steps before new arrivals so a
# freed slot is visible to the request that arrives at the same instant.
_STEP, _LOAD, _TICK, _ARRIVAL = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One simulated cluster."""

    gpus: int = 4
    policy: str = "e2"
    local_policy: str = "prefix_fair"
    # The local policy's knobs (its config type, e.g. SprptConfig); None: its defaults.
    local_config: LocalPolicyConfig | None = None
    profile: str = DEFAULT_PROFILE
    # One cost-model profile per worker (a fleet mixing GPU types; its length overrides
    # ``gpus``); empty: ``gpus`` workers on ``profile``. The policy's own cost model stays
    # ``profile``; E2 prices each worker with the profile its load reports name.
    gpu_profiles: tuple[str, ...] = ()
    # Period of each worker's load report to the global policy (seconds, as live).
    load_interval_s: float = 0.25
    # Period of the global policy's background maintenance (seconds, as live).
    tick_interval_s: float = 0.1
    # Requests still unfinished this long after the last arrival count as failed (seconds).
    drain_limit_s: float = 600.0
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    engine_config: SimEngineConfig | None = None
    # Output-length predictions on requests, for sprpt_limited: "none"; "oracle" (the
    # workload's real output length as predicted_output); "initial" or "refined" (the
    # trained TRAIL predictor's outputs from ``trail``, see loadgen/trail_preds.py).
    predictions: str = "none"
    trail: TrailPredictions | None = None
    # Scheduler replicas and their sync delay (loadgen/sim_replicas.py); default: one
    # scheduler that sees every event at once.
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)

    def __post_init__(self) -> None:
        if self.gpu_profiles and self.gpus != len(self.gpu_profiles):
            object.__setattr__(self, "gpus", len(self.gpu_profiles))
        if self.predictions not in PREDICTION_MODES:
            raise ValueError(f"predictions must be one of {PREDICTION_MODES}")
        if self.predictions in TRAIL_MODES and self.trail is None:
            raise ValueError(f"predictions={self.predictions!r} needs the predictor's outputs")


@dataclass(slots=True)
class SimRun:
    """What one simulation produced."""

    results: list[RequestResult]
    # Virtual seconds from the first arrival to the last completion.
    duration_s: float
    wall_s: float
    steps: int
    decisions: dict[str, int]
    # Requests routed to each worker (load balance, for diagnosis).
    worker_requests: dict[str, int] = field(default_factory=dict)
    # Running requests preempted (by recompute), all engines together.
    preemptions: int = 0
    # Tokens computed as prefill, recompute after preemption included (all engines), and
    # the engines' busy time (modelled seconds of steps, summed over engines).
    prefill_tokens: int = 0
    busy_s: float = 0.0


def token_prompt(req: WorkloadRequest) -> list[int]:
    """A request's prompt token ids: the simulator runs token workloads, not text ones."""
    if isinstance(req.prompt, str):
        raise TypeError(f"{req.prefix_id}: the simulator takes token prompts, not text")
    return req.prompt


class SimPolicy(Protocol):
    """What the simulator drives of a ``GlobalPolicy``: routing fed by the workers' events,
    without persistence or statistics, so a fixed plan (batch_sim.PlannedRouting) fits."""

    def add_worker(self, worker_id: str, capacity_tokens: int, now: float) -> None: ...

    def route(self, req: RouteInput, now: float) -> Decision: ...

    def on_kv_events(self, worker_id: str, events: list[KvEvent], now: float) -> None: ...

    def on_load(self, report: LoadReportEvent, now: float) -> None: ...

    def on_done(self, done: RequestDoneEvent, now: float) -> None: ...

    def tick(self, now: float) -> None: ...


class ClusterSim:
    """Replays requests at their arrival times through a global policy onto sim engines."""

    def __init__(self, cfg: ClusterConfig) -> None:
        if cfg.gpus < 1:
            raise ValueError("gpus must be at least 1")
        self.cfg = cfg
        self.cost = CostModel.load(cfg.profile)
        self.workers = [f"gpu{i}" for i in range(cfg.gpus)]
        # Each worker's profile name, as its load reports state it.
        self.profiles = dict(zip(self.workers, cfg.gpu_profiles or [cfg.profile] * cfg.gpus))
        self.engines = {
            w: SimEngine(CostModel.load(self.profiles[w]),
                         make_local_policy(cfg.local_policy, cfg.local_config),
                         ideal_engine(CostModel.load(self.profiles[w]), cfg.engine_config)
                         if cfg.policy == IDEAL else cfg.engine_config)
            for w in self.workers}
        # The ``ideal`` reference (loadgen/ideal.py) also fills the chosen GPU's cache.
        self.ideal = IdealPolicy(self.engines) if cfg.policy == IDEAL else None
        self.policy: SimPolicy = self.ideal or (
            ReplicatedPolicy(cfg.policy, cfg.policy_config, self.cost, cfg.replicas)
            if cfg.replicas.replicated
            else make_policy(cfg.policy, cfg.policy_config, self.cost))
        self.plans: dict[str, StepPlan | None] = {w: None for w in self.workers}
        self.refiner = Refiner() if cfg.predictions == "refined" else None
        # (time, kind, push order, payload: request index, worker or None for a tick)
        self._heap: list[tuple[float, int, int, int | str | None]] = []
        self._seq = 0

    def _push(self, t: float, kind: int, payload: int | str | None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def _kick(self, w: str, now: float) -> None:
        """Start the next step on ``w`` if it is idle and has work."""
        if self.plans[w] is not None:
            return
        plan = self.engines[w].plan_step(now)
        self.plans[w] = plan
        if plan is not None:
            self._push(now + plan.duration, _STEP, w)

    def _prediction(self, rid: str, req: WorkloadRequest) -> float:
        """``predicted_output`` of a new request (0: none); follows it for refinement."""
        mode = self.cfg.predictions
        if mode == "oracle":
            return float(req.output_len or req.max_tokens)
        if mode not in TRAIL_MODES:
            return 0.0
        trail = self.cfg.trail
        assert trail is not None  # ClusterConfig requires it in the TRAIL modes
        p = trail.requests.get(req.prefix_id)
        if p is None:
            raise ValueError(f"no prediction for {req.prefix_id!r}")
        if self.refiner is not None:
            self.refiner.attach(rid, p)
        return p.initial

    def run(self, requests: Sequence[WorkloadRequest], arrivals: Sequence[float]) -> SimRun:
        """Simulate; returns one RequestResult per request, in input order."""
        if len(requests) != len(arrivals):
            raise ValueError("one arrival time per request")
        wall0 = time.perf_counter()
        # The edge computes block hashes before routing (off the virtual clock); done at
        # arrival, not up front, so a large run holds only in-flight requests' hashes.
        results = [RequestResult(ok=False, error="unfinished") for _ in requests]
        index: dict[str, int] = {}
        decisions: dict[str, int] = {}
        per_worker = dict.fromkeys(self.workers, 0)
        for w in self.workers:
            engine = self.engines[w]
            self.policy.add_worker(w, engine.cache.num_blocks * engine.cost_model.block_size, 0.0)
            self._push(0.0, _LOAD, w)
        self._push(0.0, _TICK, None)
        for i, t in enumerate(arrivals):
            self._push(t, _ARRIVAL, i)
        last_arrival = max(arrivals, default=0.0)
        deadline = last_arrival + self.cfg.drain_limit_s
        pending = len(requests)
        steps = prefill_tokens = 0
        busy_s = 0.0
        now = 0.0
        while self._heap and pending:
            now, kind, _, payload = heapq.heappop(self._heap)
            if now > deadline:
                break
            if kind == _ARRIVAL:
                assert isinstance(payload, int)
                i = payload
                req = requests[i]
                prompt = token_prompt(req)
                rid = f"r{i}"
                index[rid] = i
                hashes = block_hashes(prompt, req.tenant)
                try:
                    d = self.policy.route(RouteInput(
                        request_id=rid, block_hashes=hashes, prompt_tokens=len(prompt),
                        max_tokens=req.max_tokens, tenant=req.tenant), now)
                except NoWorkerError as exc:
                    results[i].error = str(exc)
                    pending -= 1
                    continue
                if self.ideal is not None:
                    self.ideal.seed(d.worker_id, prompt, hashes)
                decisions[d.kind] = decisions.get(d.kind, 0) + 1
                per_worker[d.worker_id] += 1
                self.engines[d.worker_id].add(EngineRequest(
                    request_id=rid, prompt_token_ids=list(prompt),
                    max_tokens=max(req.max_tokens, req.output_len, 1),
                    output_len=req.output_len or req.max_tokens, tenant=req.tenant,
                    block_hashes=hashes, batch_id=req.batch_id,
                    predicted_output=self._prediction(rid, req)), now)
                self._kick(d.worker_id, now)
            elif kind == _STEP:
                assert isinstance(payload, str)
                w = payload
                engine = self.engines[w]
                plan, self.plans[w] = self.plans[w], None
                assert plan is not None  # a step event is pushed with its plan (_kick)
                steps += 1
                prefill_tokens += plan.prefill_tokens
                busy_s += plan.duration
                finished = engine.finish_step(plan, now, finished_only=True)
                if self.refiner is not None:
                    self.refiner.after_step(engine, plan.requests)
                for out in finished:
                    if not out.finished:
                        continue
                    r = out.request
                    i = index[r.request_id]
                    results[i] = RequestResult(
                        ok=True, latency_s=r.latency_s or 0.0, ttft_s=r.ttft_s or 0.0,
                        prompt_tokens=r.num_prompt_tokens,
                        cached_tokens=max(r.num_cached_tokens, 0),
                        output_tokens=r.num_output_tokens)
                    pending -= 1
                    self.policy.on_done(done_record(w, r, out.finish_reason or "length"), now)
                events = engine.take_kv_events()
                if events:
                    self.policy.on_kv_events(w, events, now)
                self._kick(w, now)
            elif kind == _LOAD:
                assert isinstance(payload, str)
                w = payload
                self.policy.on_load(load_report(w, self.engines[w].stats(now), now,
                                                profile=self.profiles[w]), now)
                self._push(now + self.cfg.load_interval_s, _LOAD, w)
            else:
                self.policy.tick(now)
                self._push(now + self.cfg.tick_interval_s, _TICK, None)
        first = min(arrivals, default=0.0)
        return SimRun(results=results, duration_s=max(now - first, 1e-9),
                      wall_s=time.perf_counter() - wall0, steps=steps, decisions=decisions,
                      worker_requests=per_worker,
                      preemptions=sum(e.stats(now).preemptions for e in self.engines.values()),
                      prefill_tokens=prefill_tokens, busy_s=busy_s)


def working_set_blocks(requests: Sequence[WorkloadRequest]) -> int:
    """Distinct KV blocks the requests' prompts make (tenant-salted, as the engines hash)."""
    seen: set[int] = set()
    for req in requests:
        seen.update(block_hashes(token_prompt(req), req.tenant))
    return len(seen)


def pressure_blocks(requests: Sequence[WorkloadRequest], gpus: int, pressure: float) -> int:
    """KV blocks per GPU that make the requests' working set ``pressure`` times the fleet's
    aggregate cache (``pressure`` 2-4: a cache pressure test). Never fewer than the largest
    request needs (prompt and output), or it could never run."""
    if pressure <= 0:
        raise ValueError("cache pressure must be positive")
    largest = max((-(-(len(token_prompt(r)) + max(r.output_len, r.max_tokens)) // BLOCK_SIZE))
                  for r in requests) if requests else 1
    return max(largest + 1, round(working_set_blocks(requests) / (pressure * gpus)))
