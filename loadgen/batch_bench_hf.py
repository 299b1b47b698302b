"""One planned batch job versus the same requests as ordinary traffic, on a real model.

The mesh runs as local processes (``LocalMesh``: nats-server, redis-server, every service)
with one ``hf`` worker (SmolLM2-135M on the CPU, ``[ml]`` extra). The requests are the
``batch`` workload (real LooGLE document sections shared by groups of questions) as token
ids, each with ``max_tokens`` output tokens (``ignore_eos``, greedy), so every mode does the
same work. Modes, all requests submitted at once:

- ``planned``: one Batch API job (``POST /v1/files`` + ``/v1/batches``, polled to its end):
  the edge plans it (docs/batch.md) and the worker runs ``batch_groups``;
- ``ordinary_fcfs``: the same requests as ordinary ``/v1/completions`` calls on the same
  mesh (``batch_groups`` serves requests without a batch id first come, first served);
- ``ordinary_prefix_fair``: the same, on a mesh whose worker runs ``prefix_fair`` (the
  default local policy).

Each run puts a run-specific token in front of every prompt, so no run finds another's
prefixes in the worker's cache; within a mesh, modes alternate run by run. Throughput is
(prompt + completion tokens) / wall seconds from the first submission to the last result
(for ``planned``: file upload to the batch's ``completed``, polled every 0.2 s; the
edge saves progress every 0.5 s). On a machine shared with other work, wall time mostly
measures the others' load; the worker process's CPU seconds over the run (user + system,
all its threads, from /proc) do not, so ``tokens_per_cpu_s`` is reported beside it.

    python -m prefixmesh.loadgen.batch_bench_hf --json results/batch/hf_bench.json

A benchmark, not a test: run it on purpose; on a shared machine compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from prefixmesh.loadgen.client import run_open_loop
from prefixmesh.loadgen.workloads import WorkloadRequest, build_workload
from prefixmesh.services.up import LocalMesh, MeshOptions
from prefixmesh.shared.runtime.servers import free_port

MODEL = "smollm2-135m-instruct"
# Mode -> the worker's local policy it runs under.
MODES = {"planned": "batch_groups", "ordinary_fcfs": "batch_groups",
         "ordinary_prefix_fair": "prefix_fair"}
# First token id of the run tags (one per run, in front of every prompt of that run).
TAG_BASE = 1000
POLL_S = 0.2
# Seconds to wait for the hf worker to answer its first request (model conversion).
WARMUP_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 1800.0


def workload(docs: int, questions: int, doc_tokens: int, max_tokens: int, seed: int
             ) -> list[WorkloadRequest]:
    """``docs`` document sections with ``questions`` questions each, shuffled."""
    reqs = build_workload("batch", docs * questions, seed, doc_tokens=doc_tokens,
                          prefixes=docs)
    return [replace(r, max_tokens=max_tokens, output_len=max_tokens, batch_id="")
            for r in reqs]


def tagged(reqs: Sequence[WorkloadRequest], run: int) -> list[WorkloadRequest]:
    """``reqs`` with the run's tag token in front of every prompt."""
    return [replace(r, prompt=[TAG_BASE + run, *r.prompt]) for r in reqs]


def batch_file(reqs: Sequence[WorkloadRequest]) -> bytes:
    """The Batch API input lines of ``reqs`` (the bodies ordinary traffic sends, unstreamed)."""
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": r.prompt, "max_tokens": r.max_tokens,
                                  "ignore_eos": True, "temperature": 0.0}})
             for i, r in enumerate(reqs)]
    return ("\n".join(lines) + "\n").encode()


async def run_planned(url: str, reqs: Sequence[WorkloadRequest]) -> dict[str, Any]:
    """Upload, create, poll to the end; totals from the output file's usage."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=JOB_TIMEOUT_S)) as s:
        start = time.perf_counter()
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", batch_file(reqs), filename="bench.jsonl",
                       content_type="application/jsonl")
        async with s.post(f"{url}/v1/files", data=form) as r:
            r.raise_for_status()
            file_id = (await r.json())["id"]
        async with s.post(f"{url}/v1/batches", json={
                "input_file_id": file_id, "endpoint": "/v1/completions",
                "completion_window": "24h"}) as r:
            r.raise_for_status()
            batch = await r.json()
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(POLL_S)
            async with s.get(f"{url}/v1/batches/{batch['id']}") as r:
                batch = await r.json()
        wall = time.perf_counter() - start
        usages = []
        if batch.get("output_file_id"):
            async with s.get(f"{url}/v1/files/{batch['output_file_id']}/content") as r:
                for line in (await r.text()).splitlines():
                    usages.append(json.loads(line)["response"]["body"]["usage"])
    row = _totals(wall, len(reqs), usages)
    row["status"] = batch["status"]
    row["plan"] = batch.get("prefixmesh_plan")
    return row


async def run_ordinary(url: str, reqs: Sequence[WorkloadRequest]) -> dict[str, Any]:
    """Every request at once as an ordinary streamed completion."""
    results, wall = await run_open_loop(url, MODEL, reqs, [0.0] * len(reqs),
                                        timeout_s=JOB_TIMEOUT_S)
    usages = [{"prompt_tokens": r.prompt_tokens, "completion_tokens": r.output_tokens,
               "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}
              for r in results if r.ok]
    return _totals(wall, len(reqs), usages)


def _totals(wall: float, requests: int, usages: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                 for u in usages)
    return {"requests": requests, "completed": len(usages), "wall_s": round(wall, 2),
            "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
            "cache_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
            "tokens_per_s": round((prompt + completion) / wall, 1),
            "completion_tokens_per_s": round(completion / wall, 2)}


async def warm_up(url: str) -> None:
    """Wait until the worker answers (the hf model loads after the mesh reports ready)."""
    probe = WorkloadRequest(prompt=[TAG_BASE - 1] * 20, max_tokens=1, prefix_id="warmup")
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    while True:
        results, _ = await run_open_loop(url, MODEL, [probe], [0.0])
        if results[0].ok:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the hf worker did not answer: {results[0].error}")
        await asyncio.sleep(2.0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_mesh(policy: str, modes: Sequence[str], reqs: Sequence[WorkloadRequest],
             repeats: int, first_run: int) -> list[dict[str, Any]]:
    """Start a mesh whose worker runs ``policy``; run ``modes`` alternately ``repeats``
    times each, every run with its own tag."""
    opts = MeshOptions(workers=1, backend="hf", local_policy=policy, port=0, metrics_port=0,
                       nats_url=f"nats://127.0.0.1:{free_port()}",
                       redis_url=f"redis://127.0.0.1:{free_port()}/0", log_level="WARNING")
    rows = []
    run = first_run
    with LocalMesh(opts) as mesh:
        asyncio.run(warm_up(mesh.url))
        for k in range(repeats):
            order = list(modes) if k % 2 == 0 else list(reversed(modes))
            for mode in order:
                runner = run_planned if mode == "planned" else run_ordinary
                worker = mesh.pids()["worker-0"]
                cpu = cpu_seconds(worker)
                row = asyncio.run(runner(mesh.url, tagged(reqs, run)))
                row["worker_cpu_s"] = round(cpu_seconds(worker) - cpu, 2)
                row["tokens_per_cpu_s"] = round(
                    (row["prompt_tokens"] + row["completion_tokens"]) / row["worker_cpu_s"], 1)
                row.update(mode=mode, local_policy=policy, repeat=k, run=run)
                print(json.dumps(row), flush=True)
                rows.append(row)
                run += 1
    return rows


def speedups(rows: Sequence[dict[str, Any]], key: str) -> dict[str, float]:
    """Mean ``key`` (a throughput) of ``planned`` over each other mode's."""
    mean = {m: sum(r[key] for r in rows if r["mode"] == m)
            / max(1, sum(1 for r in rows if r["mode"] == m)) for m in {r["mode"] for r in rows}}
    if "planned" not in mean:
        return {}
    return {m: round(mean["planned"] / v, 3) for m, v in mean.items() if m != "planned" and v}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.batch_bench_hf",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=6, help="shared document sections")
    ap.add_argument("--questions", type=int, default=6, help="questions per document")
    ap.add_argument("--doc-tokens", type=int, default=1024, help="tokens of each document")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {list(MODES)}")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s) {unknown}")
    reqs = workload(a.docs, a.questions, a.doc_tokens, a.max_tokens, a.seed)
    rows: list[dict[str, Any]] = []
    for policy in dict.fromkeys(MODES[m] for m in modes):  # one mesh per local policy
        mine = [m for m in modes if MODES[m] == policy]
        rows += run_mesh(policy, mine, reqs, a.repeats, len(rows))
    result = {"backend": "hf", "model": MODEL, "workers": 1,
              "workload": {"name": "batch", "docs": a.docs, "questions": a.questions,
                           "doc_tokens": a.doc_tokens, "max_tokens": a.max_tokens,
                           "seed": a.seed, "requests": len(reqs)},
              "runs": rows, "planned_speedup": speedups(rows, "tokens_per_s"),
              "planned_speedup_per_cpu_s": speedups(rows, "tokens_per_cpu_s")}
    print(json.dumps({k: result[k] for k in ("planned_speedup", "planned_speedup_per_cpu_s")}))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
