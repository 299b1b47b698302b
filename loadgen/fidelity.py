"""Fidelity of the simulator: the same config through the live mesh and in virtual time.

Starts the mesh (``LocalMesh``: own NATS/Redis, sim workers), replays a seeded workload
with ``prefixmesh bench``'s client, then runs ``prefixmesh sim``'s simulator on the very
same requests and arrival times, and reports both rows and the ratio of average latency.
docs/design.md section 8 describes the simulator it checks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.loadgen.bench import run_bench
from prefixmesh.loadgen.cluster_sim import ClusterConfig
from prefixmesh.loadgen.options import WorkloadSpec, add_workload_args
from prefixmesh.loadgen.sim_replicas import ReplicaConfig
from prefixmesh.loadgen.sweep import simulate
from prefixmesh.services.scheduler.policies import POLICY_NAMES
from prefixmesh.services.up import LocalMesh, MeshOptions
from prefixmesh.services.worker.local import LOCAL_POLICIES
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, available_profiles
from prefixmesh.shared.runtime.servers import free_port


def run_fidelity(spec: WorkloadSpec, workers: int, rate: float, duration_s: float,
                 policy: str, local_policy: str, profile: str, schedulers: int = 1) -> dict:
    """Live and virtual rows for one configuration, with their latency ratios.

    ``schedulers``: scheduler replicas routing at once, live (``up --schedulers``) and in
    the simulator (each replica learning the others' decisions without delay)."""
    opts = MeshOptions(workers=workers, schedulers=schedulers, policy=policy,
                       local_policy=local_policy,
                       profile=profile, port=0, metrics_port=0,
                       nats_url=f"nats://127.0.0.1:{free_port()}",
                       redis_url=f"redis://127.0.0.1:{free_port()}/0", log_level="WARNING")
    labels = {"policy": policy, "local_policy": local_policy, "gpus": workers, "backend": "sim",
              "schedulers": schedulers}
    with LocalMesh(opts) as mesh:
        live = run_bench(mesh.url, spec, rate, duration_s, None, labels)
    live["mode"] = "live"
    count = max(1, round(rate * duration_s))
    virtual = simulate(spec.requests(count), spec.times(rate, count),
                       ClusterConfig(gpus=workers, policy=policy, local_policy=local_policy,
                                     profile=profile,
                                     replicas=ReplicaConfig(schedulers=schedulers)),
                       spec.workload, rate)
    return {
        "live": live, "virtual": virtual,
        "latency_avg_ratio": virtual["latency_avg_s"] / live["latency_avg_s"],
        "latency_p50_ratio": virtual["latency_p50_s"] / live["latency_p50_s"],
        "ttft_avg_ratio": virtual["ttft_avg_s"] / live["ttft_avg_s"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixmesh fidelity",
                                description="Live mesh vs virtual-time simulator, same config.")
    add_workload_args(p)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--policy", default="e2", choices=POLICY_NAMES)
    p.add_argument("--local-policy", default="prefix_fair", choices=LOCAL_POLICIES)
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=available_profiles())
    p.add_argument("--schedulers", type=int, default=1,
                   help="scheduler replicas routing at once (live: up --schedulers N)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.workers < 1 or args.schedulers < 1:
        p.error("--workers and --schedulers must be at least 1")
    if not (args.rate > 0 and args.duration > 0):
        p.error("--rate and --duration must be positive")
    out = run_fidelity(WorkloadSpec.from_args(args), args.workers, args.rate, args.duration,
                       args.policy, args.local_policy, args.profile, args.schedulers)
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text)
    print(f"avg latency live {out['live']['latency_avg_s']:.3f}s virtual "
          f"{out['virtual']['latency_avg_s']:.3f}s ratio {out['latency_avg_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
