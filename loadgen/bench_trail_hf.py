"""TRAIL on a real model: ``sprpt_limited`` (predictor + in-worker refinement) against
``fcfs`` on ``hf`` workers (SmolLM2-135M on the CPU), ShareGPT prompts, Poisson arrivals.

For each seed, each variant runs on a fresh mesh (``LocalMesh``: its own NATS and Redis,
``--workers`` hf workers), in an order that rotates with the seed so the drift of a shared
machine falls on every variant alike. The requests are the ``sharegpt`` workload's prompts
with the token budget ``--max-tokens``, greedy, ending at the model's end token: the reply
lengths are SmolLM2's own (what a predictor trained with ``--replies model`` predicts), and
every variant serves the same replies. Latency and TTFT are the client's; each row also
carries the workers' preemptions (``prefixmesh_worker_preemptions_total``).

Variants (``--variants``):
- ``fcfs``: arrival order, no predictor (vLLM's default);
- ``sprpt_head``: ``sprpt_limited`` on the predictor's initial prediction only;
- ``sprpt_limited``: the same plus the probe's per-token refinement in the worker (TRAIL).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from prefixmesh.loadgen.client import run_open_loop
from prefixmesh.loadgen.options import WorkloadSpec, parse_names
from prefixmesh.loadgen.results import summarize
from prefixmesh.loadgen.soak import metric_sum, scrape
from prefixmesh.loadgen.workloads import WorkloadRequest
from prefixmesh.services.up import LocalMesh, MeshOptions
from prefixmesh.shared.runtime.servers import free_port

# Variant -> (local policy, serve the predictor's initial predictions, refine in the worker).
VARIANTS: dict[str, tuple[str, bool, bool]] = {
    "fcfs": ("fcfs", False, False),
    "sprpt_head": ("sprpt_limited", True, False),
    "sprpt_limited": ("sprpt_limited", True, True),
}
# Seconds to wait for a fresh mesh's workers to answer a first request (model load).
READY_TIMEOUT_S = 180.0
# Seconds a request may take before the client gives up on it.
REQUEST_TIMEOUT_S = 1800.0
MODEL = "smollm2-135m-instruct"


def requests_for(spec: WorkloadSpec, count: int, max_tokens: int) -> list[WorkloadRequest]:
    """``count`` prompts of ``spec`` (its seeded order) under the token budget."""
    return [dataclasses.replace(r, max_tokens=max_tokens, output_len=0)
            for r in spec.requests(count)]


async def wait_ready(url: str) -> None:
    """Send a one-token request until the workers answer it (their model is loaded)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        while True:
            try:
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers at {url} not ready in {READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(1.0)


def run_variant(variant: str, artifact: str, workers: int, requests: list[WorkloadRequest],
                arrivals: list[float]) -> dict:
    """One variant on a fresh mesh; its result row."""
    local, predict, refine = VARIANTS[variant]
    opts = MeshOptions(workers=workers, backend="hf", local_policy=local, port=0,
                       metrics_port=0, nats_url=f"nats://127.0.0.1:{free_port()}",
                       redis_url=f"redis://127.0.0.1:{free_port()}/0", log_level="WARNING",
                       predictor_model=artifact if predict else "",
                       probe_model=artifact if refine else "")
    with LocalMesh(opts) as mesh:
        asyncio.run(wait_ready(mesh.url))
        results, wall = asyncio.run(run_open_loop(
            mesh.url, MODEL, requests, arrivals, timeout_s=REQUEST_TIMEOUT_S,
            ignore_eos=False))
        preempted = sum(metric_sum(scrape(u), "prefixmesh_worker_preemptions_total") or 0.0
                        for name, u in mesh.scrape_urls().items() if name.startswith("worker"))
    row = summarize(results, wall, policy=variant, local_policy=local, workload="sharegpt",
                    gpus=workers, backend="hf")
    row.update(preemptions=int(preempted), wall_s=round(wall, 1),
               output_tokens=sum(r.output_tokens for r in results if r.ok))
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m prefixmesh.loadgen.bench_trail_hf",
        description="sprpt_limited (TRAIL) vs fcfs on hf workers with ShareGPT prompts: "
        "mean latency and TTFT per seed (module doc).")
    p.add_argument("--artifact", required=True,
                   help="predictor artifact folder (prefixmesh predictor train): the "
                   "predictor serves its head, the workers run its probe")
    p.add_argument("--variants", default="fcfs,sprpt_limited",
                   help=f"comma list of: {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0,1,2", help="workload and arrival seeds (comma list)")
    p.add_argument("--rate", type=float, required=True, help="Poisson arrival rate (req/s)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="token budget of every reply (the predictor's --reply-tokens)")
    p.add_argument("--workers", type=int, default=1, help="hf workers")
    p.add_argument("--json", type=Path, required=True, help="write {\"runs\": [...]} here")
    args = p.parse_args(argv)
    variants = parse_names(args.variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants: {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    if args.rate <= 0 or args.duration <= 0 or args.max_tokens < 1 or args.workers < 1:
        raise SystemExit("--rate, --duration, --max-tokens and --workers must be positive")
    if not (Path(args.artifact) / "config.json").is_file():
        raise SystemExit(f"{args.artifact}: not a predictor artifact (no config.json)")
    try:
        seeds = [int(s) for s in parse_names(args.seeds)]
    except ValueError:
        raise SystemExit(f"--seeds: expected comma-separated integers, got {args.seeds!r}"
                         ) from None
    rows = []
    count = max(1, round(args.rate * args.duration))
    for seed in seeds:
        spec = WorkloadSpec("sharegpt", seed=seed)
        reqs = requests_for(spec, count, args.max_tokens)
        arrivals = spec.times(args.rate, count)
        k = seed % len(variants)
        for variant in variants[k:] + variants[:k]:  # rotate who goes first
            print(f"seed {seed} {variant}: {count} requests at {args.rate:g} req/s ...",
                  file=sys.stderr, flush=True)
            row = run_variant(variant, args.artifact, args.workers, reqs, arrivals)
            row.update(seed=seed, rate=args.rate, max_tokens=args.max_tokens)
            rows.append(row)
            print(f"  avg {row['latency_avg_s']:.2f} s, TTFT {row['ttft_avg_s']:.2f} s, "
                  f"{row['completed']}/{row['requests']} done, {row['preemptions']} "
                  f"preemptions, {row['output_tokens']} tokens, {row['wall_s']} s wall",
                  file=sys.stderr, flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
