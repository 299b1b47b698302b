"""TRAIL on a real model: ``sprpt_limited`` (predictor + in-worker refinement) against
``fcfs`` on ``hf`` workers (SmolLM2-135M on the CPU), ShareGPT prompts, Poisson arrivals.

For each seed, every variant runs on a fresh mesh of its own (``LocalMesh``: its own NATS
and Redis, ``--workers`` hf workers with ``--max-num-seqs`` slots each), all at the same
time on the same requests and arrival times, so the load of a shared machine falls on
every variant alike. The requests are the ``sharegpt`` workload's prompts
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
import contextlib
import dataclasses
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from prefixmesh.loadgen.client import run_open_loop
from prefixmesh.loadgen.options import WorkloadSpec, parse_names
from prefixmesh.loadgen.results import RequestResult, summarize
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


def mesh_options(variant: str, artifact: str, workers: int, max_num_seqs: int) -> MeshOptions:
    """A fresh mesh of hf workers running ``variant`` (own NATS, Redis and ports)."""
    local, predict, refine = VARIANTS[variant]
    return MeshOptions(workers=workers, backend="hf", local_policy=local, port=0,
                       metrics_port=0, nats_url=f"nats://127.0.0.1:{free_port()}",
                       redis_url=f"redis://127.0.0.1:{free_port()}/0", log_level="WARNING",
                       predictor_model=artifact if predict else "",
                       probe_model=artifact if refine else "",
                       extra_env={"PM_MAX_NUM_SEQS": str(max_num_seqs)})


def preemptions(mesh: LocalMesh) -> int:
    """Running requests the mesh's workers preempted so far."""
    return int(sum(metric_sum(scrape(u), "prefixmesh_worker_preemptions_total") or 0.0
                   for name, u in mesh.scrape_urls().items() if name.startswith("worker")))


def run_side_by_side(variants: list[str], artifact: str, workers: int, max_num_seqs: int,
                     requests: list[WorkloadRequest], arrivals: list[float]) -> list[dict]:
    """Every variant on its own fresh mesh, all at once; one result row per variant."""
    with contextlib.ExitStack() as stack:
        meshes = [stack.enter_context(LocalMesh(mesh_options(v, artifact, workers,
                                                             max_num_seqs)))
                  for v in variants]

        async def run_all() -> list[tuple[list[RequestResult], float]]:
            await asyncio.gather(*(wait_ready(m.url) for m in meshes))
            return await asyncio.gather(*(run_open_loop(
                m.url, MODEL, requests, arrivals, timeout_s=REQUEST_TIMEOUT_S,
                ignore_eos=False) for m in meshes))

        outcomes = asyncio.run(run_all())
        preempted = [preemptions(m) for m in meshes]
    rows = []
    for variant, (results, wall), n in zip(variants, outcomes, preempted, strict=True):
        row = summarize(results, wall, policy=variant, local_policy=VARIANTS[variant][0],
                        workload="sharegpt", gpus=workers, backend="hf")
        row.update(preemptions=n, wall_s=round(wall, 1), max_num_seqs=max_num_seqs,
                   output_tokens=sum(r.output_tokens for r in results if r.ok))
        rows.append(row)
    return rows


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
    p.add_argument("--workers", type=int, default=1, help="hf workers per variant")
    p.add_argument("--max-num-seqs", type=int, default=1,
                   help="requests each worker runs at once (the hf engine runs one forward "
                   "pass at a time, so more slots interleave them without batching)")
    p.add_argument("--json", type=Path, required=True, help="write {\"runs\": [...]} here")
    args = p.parse_args(argv)
    variants = parse_names(args.variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants: {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    if min(args.rate, args.duration, args.max_tokens, args.workers, args.max_num_seqs) <= 0:
        raise SystemExit("--rate, --duration, --max-tokens, --workers and --max-num-seqs "
                         "must be positive")
    if not (Path(args.artifact) / "config.json").is_file():
        raise SystemExit(f"{args.artifact}: not a predictor artifact (no config.json)")
    try:
        seeds = [int(s) for s in parse_names(args.seeds)]
    except ValueError:
        raise SystemExit(f"--seeds: expected comma-separated integers, got {args.seeds!r}"
                         ) from None
    # A TERM (not only Ctrl-C) stops the meshes too: SystemExit unwinds their context.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    count = max(1, round(args.rate * args.duration))
    for seed in seeds:
        spec = WorkloadSpec("sharegpt", seed=seed)
        reqs = requests_for(spec, count, args.max_tokens)
        arrivals = spec.times(args.rate, count)
        print(f"seed {seed}: {count} requests at {args.rate:g} req/s to each of "
              f"{', '.join(variants)} ...", file=sys.stderr, flush=True)
        for row in run_side_by_side(variants, args.artifact, args.workers, args.max_num_seqs,
                                    reqs, arrivals):
            row.update(seed=seed, rate=args.rate, max_tokens=args.max_tokens)
            rows.append(row)
            print(f"  {row['policy']}: avg {row['latency_avg_s']:.2f} s, TTFT "
                  f"{row['ttft_avg_s']:.2f} s, {row['completed']}/{row['requests']} done, "
                  f"{row['preemptions']} preemptions, {row['output_tokens']} tokens, "
                  f"{row['wall_s']} s wall", file=sys.stderr, flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
