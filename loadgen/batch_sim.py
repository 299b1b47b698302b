"""An offline batch on the virtual-time cluster: planned (BatchLLM) vs ordinary traffic.

The same requests (``batch`` workload: documents shared by groups of prompts) are run
three ways on ``gpus`` simulated GPUs, all submitted at t = 0, and the batch completion
time (first submission to last completion, virtual seconds) is compared:

- ``planned``: the batch planner (``services/edge/batch_plan.py``: enlarged first-level prefix
  groups, ordered, placed on workers by E2's cost model) decides each request's worker and
  the submission order; workers run ``batch_groups`` (requests keep their ``batch_id``);
- ``planned_count_capped``: the same, but batch requests hold sequence slots, so
  ``max_num_seqs`` caps them as it caps ordinary traffic (request-count batching instead
  of the KV token threshold);
- ``e2_prefix_fair``: ordinary traffic (no ``batch_id``) under E2 + ``prefix_fair``;
- ``rr_fcfs``: ordinary traffic under ``round_robin`` + ``fcfs`` (vLLM behind a plain
  load balancer).

It also reports BatchLLM's token-saving ratios on the batch: naive and enlarged first-level
prefixes and the full multi-level tree, next to the cache hit ratio each run achieved.

    python -m prefixmesh.loadgen.batch_sim --gpus 4 --count 1000 --json results/batch/sim.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from prefixmesh.loadgen.cluster_sim import ClusterConfig, ClusterSim, token_prompt
from prefixmesh.loadgen.workloads import WorkloadRequest, build_workload
from prefixmesh.services.edge.batch_plan import BatchPlan, plan_batch
from prefixmesh.services.scheduler.policies.base import Decision, RouteInput
from prefixmesh.services.worker.local import BatchGroupsConfig, LocalPolicyConfig
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel


@dataclass(frozen=True, slots=True)
class Mode:
    """One way of running the batch."""

    name: str
    policy: str
    local_policy: str
    planned: bool = False
    # The local policy's knobs (None: its defaults).
    local_config: LocalPolicyConfig | None = None


MODES = {
    "planned": Mode("planned", "batch_plan", "batch_groups", planned=True),
    "planned_count_capped": Mode("planned_count_capped", "batch_plan", "batch_groups",
                                 planned=True,
                                 local_config=BatchGroupsConfig(batch_slots=True)),
    "e2_prefix_fair": Mode("e2_prefix_fair", "e2", "prefix_fair"),
    "rr_fcfs": Mode("rr_fcfs", "round_robin", "fcfs"),
}


class PlannedRouting:
    """A global policy that follows the batch plan: request id -> planned worker."""

    def __init__(self, assignment: dict[str, str]) -> None:
        self.assignment = assignment
        self._workers: list[str] = []

    def add_worker(self, worker_id: str, capacity_tokens: int, now: float) -> None:
        self._workers.append(worker_id)

    @property
    def workers(self) -> Collection[str]:
        return self._workers

    def route(self, req: RouteInput, now: float) -> Decision:
        return Decision(self.assignment[req.request_id], "planned")

    def on_kv_events(self, worker_id: str, events: list, now: float) -> None:
        """The plan is fixed: cache events change nothing."""

    def on_load(self, report: object, now: float) -> None:
        """The plan is fixed: load reports change nothing."""

    def on_done(self, done: object, now: float) -> None:
        """The plan is fixed: completions change nothing."""

    def tick(self, now: float) -> None:
        """No background work."""


def plan_for(requests: Sequence[WorkloadRequest], gpus: int, cost: CostModel) -> BatchPlan:
    """The planner's decision for ``requests`` on workers gpu0..gpu{n-1}."""
    prompts = [list(token_prompt(r)) for r in requests]
    outputs = [r.output_len or r.max_tokens for r in requests]
    return plan_batch(prompts, outputs, [f"gpu{i}" for i in range(gpus)], cost)


def run_mode(requests: Sequence[WorkloadRequest], gpus: int, mode: Mode, profile: str,
             plan: BatchPlan | None = None) -> dict:
    """Simulate one mode; the row has the batch completion time and cache figures."""
    cfg = ClusterConfig(gpus=gpus, policy="round_robin" if mode.planned else mode.policy,
                        local_policy=mode.local_policy, local_config=mode.local_config,
                        profile=profile)
    sim = ClusterSim(cfg)
    if mode.planned:
        plan = plan or plan_for(requests, gpus, sim.cost)
        order = plan.run_order()
        reqs = [requests[i] for _, i in order]
        # ClusterSim names the k-th submitted request "r<k>".
        sim.policy = PlannedRouting({f"r{k}": w for k, (w, _) in enumerate(order)})
    else:
        reqs = [replace(r, batch_id="") for r in requests]
    run = sim.run(reqs, [0.0] * len(reqs))
    ok = [r for r in run.results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {"mode": mode.name, "policy": mode.policy, "local_policy": mode.local_policy,
            "gpus": gpus, "profile": profile, "requests": len(reqs), "completed": len(ok),
            "failed": len(reqs) - len(ok), "makespan_s": round(run.duration_s, 3),
            "throughput_rps": round(len(ok) / run.duration_s, 3),
            "cache_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
            "worker_requests": run.worker_requests, "wall_s": round(run.wall_s, 2)}


def compare(requests: Sequence[WorkloadRequest], gpus: int, modes: Sequence[str],
            profile: str = DEFAULT_PROFILE) -> dict:
    """Every mode on the same batch, plus the plan's token-saving ratios."""
    plan = plan_for(requests, gpus, CostModel.load(profile))
    runs = [run_mode(requests, gpus, MODES[m], profile, plan) for m in modes]
    base = {r["mode"]: r["makespan_s"] for r in runs}
    if "planned" in base:
        for r in runs:
            r["planned_speedup"] = round(r["makespan_s"] / base["planned"], 3)
    return {"runs": runs, "plan": {k: round(v, 4) for k, v in plan.summary().items()}}


def plot(result: dict, path: Path) -> None:
    """Bar chart of batch completion time per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    ax.bar([r["mode"] for r in runs], [r["makespan_s"] for r in runs],
           color=["tab:green", "tab:olive", "tab:blue", "tab:gray"][:len(runs)])
    for i, r in enumerate(runs):
        ax.text(i, r["makespan_s"], f'{r["makespan_s"]:.0f}s', ha="center", va="bottom")
    ax.set_ylabel("batch completion time (virtual s)")
    first = runs[0]
    ax.set_title(f'batch workload, {first["requests"]} requests, {first["gpus"]} GPUs')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.batch_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=4, help="simulated GPUs")
    ap.add_argument("--count", type=int, default=1000, help="requests in the batch")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--doc-tokens", type=int, default=None,
                    help="tokens of each shared document (workload default when absent)")
    ap.add_argument("--prefixes", type=int, default=None,
                    help="shared documents, the requests spread evenly over them (workload "
                    "default when absent: 4-16 requests each)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="cost-model profile")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {list(MODES)}")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}")
    reqs = build_workload("batch", a.count, a.seed, doc_tokens=a.doc_tokens,
                          prefixes=a.prefixes)
    result = compare(reqs, a.gpus, modes, a.profile)
    result["workload"] = {"name": "batch", "count": a.count, "seed": a.seed,
                          "doc_tokens": a.doc_tokens, "prefixes": a.prefixes}
    print(json.dumps(result, indent=2))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2))
    if a.plot:
        a.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(result, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
