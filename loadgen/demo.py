"""``prefixmesh demo``: the same burst of shared-prefix requests under each global policy.

For each policy the whole mesh is started as processes (own nats-server and redis-server
on free ports, simulated GPU workers), the burst is replayed through the HTTP API, the
mesh is stopped, and a table of latency and cache hit ratio is printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import uvloop

from prefixmesh.loadgen.arrivals import poisson
from prefixmesh.loadgen.client import run_open_loop
from prefixmesh.loadgen.results import summarize
from prefixmesh.loadgen.workloads import toolbench_text
from prefixmesh.services.up import LocalMesh, MeshOptions
from prefixmesh.shared.costmodel import DEFAULT_PROFILE
from prefixmesh.shared.models import sim_card
from prefixmesh.shared.runtime.servers import free_port
from prefixmesh.shared.text.gguf_vocab import GgufTokenizerError

PROFILE = DEFAULT_PROFILE
MODEL = sim_card(PROFILE).name  # what a simulated worker on PROFILE serves


def run_policy(policy: str, workers: int, requests: int, rate: float, seed: int) -> dict:
    """Start a fresh mesh with ``policy``, replay the burst, return the result row."""
    reqs = toolbench_text(requests, seed=seed)
    arrivals = poisson(rate, requests, seed=seed)
    opts = MeshOptions(workers=workers, policy=policy, profile=PROFILE, port=0, metrics_port=0,
                       nats_url=f"nats://127.0.0.1:{free_port()}",
                       redis_url=f"redis://127.0.0.1:{free_port()}/0", log_level="WARNING")
    with LocalMesh(opts) as mesh:
        results, duration = uvloop.run(run_open_loop(mesh.url, MODEL, reqs, arrivals))
    errors = {r.error for r in results if not r.ok}
    for e in list(errors)[:3]:
        print(f"  {policy}: failed request: {e}", file=sys.stderr)
    return summarize(results, duration, policy=policy, local_policy=opts.local_policy,
                     workload="toolbench", rate=rate, gpus=workers, backend="sim")


def format_table(rows: list[dict]) -> str:
    head = (f"{'policy':<12} {'done':>9} {'avg lat s':>10} {'p99 lat s':>10} "
            f"{'avg TTFT s':>11} {'cache hit':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['policy']:<12} {r['completed']:>4}/{r['requests']:<4} "
                     f"{r['latency_avg_s']:>10.3f} {r['latency_p99_s']:>10.3f} "
                     f"{r['ttft_avg_s']:>11.3f} {r['cache_hit_ratio']:>9.1%}")
    return "\n".join(lines)


def run_demo(workers: int, requests: int, rate: float, policies: list[str], seed: int,
             json_out: Path | None) -> int:
    print(f"prefixmesh demo: {workers} simulated {PROFILE} workers, {requests} ToolBench "
          f"requests (Zipf 1.1 tool popularity) at {rate:g} req/s, policies {policies}",
          flush=True)
    rows = []
    try:
        for policy in policies:
            print(f"  running {policy} ...", flush=True)
            rows.append(run_policy(policy, workers, requests, rate, seed))
    except (RuntimeError, TimeoutError, GgufTokenizerError) as exc:
        print(f"prefixmesh demo failed: {exc}", file=sys.stderr, flush=True)
        return 1
    print()
    print(format_table(rows))
    if json_out is not None:
        json_out.write_text(json.dumps({"runs": rows}, indent=2))
        print(f"\nresults written to {json_out}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
