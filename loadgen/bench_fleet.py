"""``python -m prefixmesh.loadgen.bench_fleet``: a live fleet of sim workers on one machine.

Starts the whole mesh (``prefixmesh up``) with ``--workers N`` sim workers, ``K`` engines per
process (``--workers-per-process``), on a nats-server and redis-server of its own; records
how long it took until every worker reported and the scheduler knew them all, the resident
memory of each process (workers: per process and per engine), replays an open-loop load
through the edge (``prefixmesh bench``'s client) and reads the scheduler's decision-time
histogram (its policy's ``route`` calls, ``prefixmesh_scheduler_decision_latency_seconds``)
and each worker's completed requests from the metrics service. One JSON object out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.loadgen.bench import run_bench
from prefixmesh.loadgen.options import WorkloadSpec, add_workload_args
from prefixmesh.services.up import LocalMesh, MeshOptions
from prefixmesh.shared.runtime.servers import free_port

DECISION_METRIC = "prefixmesh_scheduler_decision_latency_seconds"


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` (MB; 0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """A Prometheus histogram from exposition text: cumulative (le, count) buckets, the
    sum and the count."""
    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith(name + "_sum "):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count "):
            count = float(line.rsplit(" ", 1)[1])
    return sorted(buckets), total, count


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """Upper bound of the first bucket holding quantile ``q`` (inf past the last bound)."""
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    need = q * buckets[-1][1]
    return next(le for le, c in buckets if c >= need)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def decision_times(mesh: LocalMesh) -> dict:
    """The scheduler's decision-time histogram, summarised (seconds)."""
    buckets, total, count = histogram(_get(mesh.scrape_urls()["scheduler"]), DECISION_METRIC)
    under_1ms = next((c for le, c in buckets if le == 0.001), 0.0)
    return {"decisions": int(count), "mean_s": total / count if count else 0.0,
            "p50_bucket_s": bucket_quantile(buckets, 0.5),
            "p99_bucket_s": bucket_quantile(buckets, 0.99),
            "share_under_1ms": under_1ms / count if count else 0.0}


def memory(mesh: LocalMesh, per_process: int) -> dict:
    """RSS (MB) of every process, and the workers' per process and per engine."""
    rss = {name: round(rss_mb(pid), 1) for name, pid in mesh.pids().items()}
    workers = [v for k, v in rss.items() if k.startswith("worker")]
    return {"rss_mb": rss, "worker_processes": len(workers),
            "worker_rss_mb_mean": round(sum(workers) / len(workers), 1) if workers else 0.0,
            "worker_rss_mb_total": round(sum(workers), 1),
            "rss_mb_per_engine": round(sum(workers) / mesh.opts.workers, 1)
            if workers else 0.0,
            "engines_per_process": per_process}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.bench_fleet",
                                description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--workers-per-process", type=int, default=8)
    p.add_argument("--policy", default="e2")
    add_workload_args(p)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    opts = MeshOptions(workers=args.workers, workers_per_process=args.workers_per_process,
                       policy=args.policy, port=0, metrics_port=0,
                       nats_url=f"nats://127.0.0.1:{free_port()}",
                       redis_url=f"redis://127.0.0.1:{free_port()}/0",
                       subject_prefix="fleet", log_level="WARNING")
    t0 = time.monotonic()
    with LocalMesh(opts) as mesh:
        ready_s = time.monotonic() - t0
        idle = memory(mesh, args.workers_per_process)
        row = run_bench(mesh.url, WorkloadSpec.from_args(args), args.rate, args.duration,
                        None, {"policy": args.policy, "gpus": args.workers, "backend": "sim"},
                        progress=False)
        loaded = memory(mesh, args.workers_per_process)
        decisions = decision_times(mesh)
        view = json.loads(_get(mesh.metrics_url + "/cluster"))
    done = [w["completed"] for w in view["workers"]]
    out = {"workers": args.workers, "workers_per_process": args.workers_per_process,
           "ready_s": round(ready_s, 1), "memory_idle": idle, "memory_loaded": loaded,
           "scheduler_decisions": decisions, "bench": row,
           "workers_reporting": len(done), "workers_serving": sum(1 for c in done if c),
           "completed_min_max": [min(done, default=0), max(done, default=0)]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "bench"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
