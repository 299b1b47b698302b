"""PrefillOnly on the hf engine (SmolLM2-135M-Instruct on the CPU), as the paper measures it:
the peak memory of one prefill-only request against an ordinary prefill as the prompt
grows, the longest prompt a memory budget holds, and score throughput of
``srjf_calibrated`` against ``fcfs`` on ``postrec``. A benchmark, not a test: run it on
purpose; each verb writes JSON.

    python -m prefixmesh.loadgen.bench_prefillonly memory --json results/po_memory.json
    python -m prefixmesh.loadgen.bench_prefillonly budget --json results/po_budget.json
    python -m prefixmesh.loadgen.bench_prefillonly throughput --json results/po_throughput.json

**Memory** (``memory``, ``budget``): every point runs in a fresh process (``point``) that
loads the model into an ``HfEngine`` whose KV pool holds the whole prompt, writes the pool
once (so its pages are resident before, and the pool's fixed size is not counted as the
request's), runs a 64-token warm-up request, drops the cache, returns freed heap to the
system (``malloc_trim``), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``)
and runs one cold request of the given length and ``max_tokens: 1``. The figure is the
process's peak RSS (``VmHWM``) minus its RSS before the request: everything the request
made resident, whichever allocator made it (torch's CPU allocator sits on malloc). Modes:

- ``prefill_only``: the engine's prefill-only pass (hybrid prefilling with 512-token chunks,
  one layer's KV at a time: ``engine/hf_prefill_only.py``);
- ``chunked``: the ordinary path (``--hybrid-chunk-tokens 0``): 512-token chunks through the
  whole model, every layer's KV kept in a DynamicCache;
- ``unchunked``: the ordinary path with one chunk (a forward over the whole prompt, as
  ``model(input_ids)`` or an engine without chunked prefill runs it).

**Throughput** (``throughput``): ``prefixmesh up --backend hf --workers 1`` per policy and
seed, in turn, with a KV pool of ``--kv-blocks``; all ``--requests`` ``postrec`` requests
are sent to ``/v1/score`` at once (candidates " Yes" / " No"), and requests/s = requests /
(last answer - first send). postrec's profiles (~N(14000, 3000) tokens) do not fit
SmolLM2's 8,192 positions: each user's profile is cut to ``--scale`` of its length (the
same cut for all of that user's requests, so sharing is kept); posts and questions stay.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("prefill_only", "chunked", "unchunked")
# Tokens per chunk of the chunked and prefill-only modes (the engine's defaults).
CHUNK_TOKENS = 512
WARMUP_TOKENS = 64
MIB = 1024 * 1024
# SmolLM2's positions: the longest prompt the budget search tries.
MAX_TOKENS = 8192
# Steps of the budget search (tokens).
BUDGET_STEP = 256
# Seconds a score request of a throughput burst may take (client and edge).
BURST_TIMEOUT_S = 3600
MODEL = "smollm2-135m-instruct"
CANDIDATES = (" Yes", " No")


# --------------------------------------------------------------------------- one memory point


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settle() -> None:
    """Free what is garbage and hand freed heap back to the system (glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


async def _run_one(engine: Any, rid: str, ids: list[int]) -> None:
    from prefixmesh.services.worker.engine.types import EngineRequest
    from prefixmesh.shared.wire import SamplingParams

    done = asyncio.Event()

    async def emit(out: Any, text: str = "", logprobs: Any = None) -> None:
        if out.finished:
            done.set()

    async def publish(events: list) -> None:
        return None

    task = asyncio.create_task(engine.run(emit, publish))
    try:
        engine.add(EngineRequest(request_id=rid, prompt_token_ids=ids, max_tokens=1),
                   time.monotonic(), SamplingParams(max_tokens=1, temperature=0.0))
        await done.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def measure_point(mode: str, tokens: int) -> dict[str, Any]:
    """Peak RSS increase (MiB) of one cold ``tokens``-token request in ``mode``; run it in a
    fresh process (``point``)."""
    from prefixmesh.loadgen.workloads.sources import loogle_token_stream
    from prefixmesh.services.worker.engine.hf_engine import HfEngine, HfEngineConfig
    from prefixmesh.services.worker.local import make_local_policy
    from prefixmesh.shared.text.tokenizer import TextTokenizer

    cfg = HfEngineConfig(num_blocks=tokens // 16 + 8,
                         hybrid_chunk_tokens=CHUNK_TOKENS if mode == "prefill_only" else 0,
                         prefill_chunk=tokens if mode == "unchunked" else CHUNK_TOKENS)
    engine = HfEngine(cfg, make_local_policy("fcfs"), TextTokenizer.load())
    engine.load()
    assert engine.pool is not None
    engine.pool.k.zero_()  # resident from here on: the pool is the cache, not the request
    engine.pool.v.zero_()
    stream = loogle_token_stream()
    asyncio.run(_run_one(engine, "warmup", stream[-WARMUP_TOKENS:]))
    engine.reset_cache()
    _settle()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_mib("VmRSS")
    t0 = time.perf_counter()
    asyncio.run(_run_one(engine, "measured", stream[:tokens]))
    seconds = time.perf_counter() - t0
    peak = _status_mib("VmHWM")
    engine.close()
    return {"mode": mode, "tokens": tokens, "peak_mib": round(peak - before, 1),
            "rss_before_mib": round(before, 1), "seconds": round(seconds, 2)}


def run_point(mode: str, tokens: int) -> dict[str, Any]:
    """``measure_point`` in a fresh interpreter (nothing of an earlier point stays)."""
    out = subprocess.run([sys.executable, "-m", "prefixmesh.loadgen.bench_prefillonly", "point",
                          "--mode", mode, "--tokens", str(tokens)],
                         capture_output=True, text=True, check=True)
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def memory(lengths: list[int], modes: list[str], repeats: int) -> dict[str, Any]:
    """Every (length, mode) ``repeats`` times, modes interleaved."""
    rows = [run_point(m, n) for _ in range(repeats) for n in lengths for m in modes]
    return {"kind": "prefillonly_memory", "chunk_tokens": CHUNK_TOKENS, "rows": rows}


def budget(budget_mib: float, modes: list[str]) -> dict[str, Any]:
    """Per mode, the longest prompt (a multiple of ``BUDGET_STEP``, at most ``MAX_TOKENS``)
    whose request's peak stays within ``budget_mib``: a binary search over fresh points."""
    out = []
    for mode in modes:
        lo, hi, probes = 0, MAX_TOKENS // BUDGET_STEP + 1, []  # fits at lo steps, not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            row = run_point(mode, mid * BUDGET_STEP)
            probes.append(row)
            lo, hi = (mid, hi) if row["peak_mib"] <= budget_mib else (lo, mid)
        out.append({"mode": mode, "longest_tokens": lo * BUDGET_STEP,
                    "capped_at_context": lo * BUDGET_STEP == MAX_TOKENS, "probes": probes})
    return {"kind": "prefillonly_budget", "budget_mib": budget_mib, "step_tokens": BUDGET_STEP,
            "max_tokens": MAX_TOKENS, "rows": out}


# --------------------------------------------------------------------------- throughput


def scaled_postrec(count: int, seed: int, users: int, scale: float
                   ) -> list[tuple[str, list[int], int]]:
    """``postrec`` requests with each user's profile cut to ``scale`` of its length: (user,
    prompt token ids, tokens of the prompt shared with the user's other requests)."""
    from prefixmesh.loadgen.workloads import build_workload
    from prefixmesh.loadgen.workloads.base import encode
    from prefixmesh.loadgen.workloads.prefillonly import POSTREC_INSTRUCTION, POSTREC_POST

    head, post_open = len(encode(POSTREC_INSTRUCTION)), len(encode(POSTREC_POST))
    out = []
    for r in build_workload("postrec", count, seed, prefixes=users):
        assert isinstance(r.prompt, list)  # a token workload
        shared = r.prompt[:r.shared_tokens]
        profile = shared[head:len(shared) - post_open]
        keep = max(1, round(len(profile) * scale))
        prompt = shared[:head] + profile[:keep] + shared[len(shared) - post_open:]
        out.append((r.prefix_id, prompt + r.prompt[r.shared_tokens:], len(prompt)))
    return out


async def _score_burst(url: str, reqs: list[tuple[str, list[int], int]], candidates: list[int]
                       ) -> dict[str, Any]:
    import aiohttp

    async def one(session: aiohttp.ClientSession, ids: list[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        body = {"model": MODEL, "prompt": ids, "candidate_token_ids": candidates}
        async with session.post(url + "/v1/score", json=body) as r:
            data = await r.json()
        ok = r.status == 200
        usage = data.get("usage", {}) if ok else {}
        return {"ok": ok, "latency_s": time.perf_counter() - t0, "end": time.perf_counter(),
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0), "error": "" if ok else str(data)[:200]}

    timeout = aiohttp.ClientTimeout(total=BURST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(session, ids) for _, ids, _ in reqs))
    ok = [r for r in results if r["ok"]]
    lat = sorted(r["latency_s"] for r in ok)
    makespan = max(r["end"] for r in results) - start
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {"requests": len(results), "completed": len(ok), "makespan_s": round(makespan, 2),
            "throughput_rps": round(len(ok) / makespan, 4),
            "latency_avg_s": round(sum(lat) / len(lat), 2) if lat else 0.0,
            "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2)
            if lat else 0.0,
            "cache_hit_ratio": round(sum(r["cached_tokens"] for r in ok) / prompt, 4)
            if prompt else 0.0,
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:3]}


def throughput(policies: list[str], seeds: list[int], users: int, requests: int,
               scale: float, kv_blocks: int) -> dict[str, Any]:
    """One hf worker per (seed, policy), policies interleaved within each seed."""
    from prefixmesh.services.up import LocalMesh, MeshOptions
    from prefixmesh.shared.runtime.servers import free_port
    from prefixmesh.shared.text.tokenizer import TextTokenizer

    tok = TextTokenizer.load()
    candidates = [tok.encode(c, add_special_tokens=False)[0] for c in CANDIDATES]
    rows = []
    for seed in seeds:
        reqs = scaled_postrec(requests, seed, users, scale)
        for policy in policies:
            opts = MeshOptions(workers=1, backend="hf", local_policy=policy, port=0,
                               metrics_port=0, nats_url=f"nats://127.0.0.1:{free_port()}",
                               redis_url=f"redis://127.0.0.1:{free_port()}/0",
                               log_dir=Path(tempfile.mkdtemp(prefix="po-bench-")),
                               log_level="WARNING", extra_env={
                                   "PM_KV_BLOCKS": str(kv_blocks),
                                   # A burst on the CPU outlasts the edge's default 600 s.
                                   "PM_REQUEST_TIMEOUT_S": str(BURST_TIMEOUT_S)})
            with LocalMesh(opts) as mesh:
                row = asyncio.run(_score_burst(mesh.url, reqs, candidates))
            row = {"policy": policy, "seed": seed, "load_avg_1m": round(os.getloadavg()[0], 2),
                   **row}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    lengths = [n for _, _, n in reqs]
    return {"kind": "prefillonly_throughput", "workload": "postrec", "users": users,
            "requests": requests, "profile_scale": scale, "kv_blocks": kv_blocks,
            "shared_tokens_mean": round(sum(lengths) / len(lengths), 1),
            "prompt_tokens_mean": round(sum(len(ids) for _, ids, _ in reqs) / len(reqs), 1),
            "rows": rows}


# --------------------------------------------------------------------------- command line


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("point", help="one memory point in this process (prints JSON)")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--tokens", type=int, required=True)
    m = sub.add_parser("memory", help="peak memory of one request by prompt length and mode")
    m.add_argument("--tokens", type=_ints, default=[1024, 2048, 4096, 8192],
                   help="prompt lengths (comma-separated tokens)")
    m.add_argument("--repeats", type=int, default=2, help="runs of every point")
    b = sub.add_parser("budget", help="longest prompt within a memory budget, by mode")
    b.add_argument("--budget-mib", type=float, default=64.0,
                   help="peak memory a request may add (MiB)")
    t = sub.add_parser("throughput", help="score requests/s of srjf_calibrated vs fcfs")
    t.add_argument("--policies", default="fcfs,srjf_calibrated")
    t.add_argument("--seeds", type=_ints, default=[0, 1])
    t.add_argument("--users", type=int, default=20, help="postrec users (profiles)")
    t.add_argument("--requests", type=int, default=60, help="score requests per run")
    t.add_argument("--scale", type=float, default=0.1,
                   help="fraction of each postrec profile kept (fits SmolLM2's 8k context)")
    t.add_argument("--kv-blocks", type=int, default=256,
                   help="the worker's KV pool (16-token blocks)")
    for q in (m, b, t):
        q.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    if args.verb == "point":
        print(json.dumps(measure_point(args.mode, args.tokens)))
        return
    if args.verb == "memory":
        result = memory(args.tokens, list(MODES), args.repeats)
    elif args.verb == "budget":
        result = budget(args.budget_mib, list(MODES))
    else:
        result = throughput(args.policies.split(","), args.seeds, args.users, args.requests,
                            args.scale, args.kv_blocks)
    result["command"] = "python -m prefixmesh.loadgen.bench_prefillonly " + " ".join(
        sys.argv[1:] if argv is None else argv)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
