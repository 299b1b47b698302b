"""Latency of TRAIL's predictors as served (a benchmark, run on purpose; writes JSON).

- ``service``: the predictor's model path in process, on batches of ``--batch`` ShareGPT
  prompts given as SmolLM2 chat token ids, exactly what one micro-batch of the service
  runs (decode the user turn, MiniLM, head): wall time, and the process's CPU time (what
  the batch costs whatever else shares the cores); also the decode step alone.
- ``nats``: the same through NATS: a ``python -m prefixmesh.services.predictor --model-dir`` process
  and a nats-server of its own; each round sends ``--batch`` concurrent
  ``PredictLengthRequest`` and times the round (first send to last reply) and each request.
- ``refine``: the hf worker's in-process refinement (services/worker/refiner.py): decode
  forward passes of SmolLM2 with the probe's layer captured, and the time the refiner
  spends per decode step (probe every ``tokens_per_update`` tokens, Smoother, policy
  update); then the same requests without refinement, for the capture's own cost.

``python -m prefixmesh.loadgen.predictor.bench service --model DIR --json OUT`` (see --help).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# Prompts drawn from ShareGPT with this seed (not the training seed's order).
PROMPT_SEED = 1000
DEFAULT_BATCH = 32
DEFAULT_BATCHES = 20
WARMUP_BATCHES = 2


def _ms(values: list[float]) -> dict:
    """p50 / p99 / mean / max of durations in seconds, as milliseconds."""
    a = np.asarray(values) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3), "max_ms": round(float(a.max()), 3),
            "n": len(values)}


def chat_prompts(n: int, tok) -> list[list[int]]:
    """``n`` ShareGPT first human messages as SmolLM2 chat prompts (token ids)."""
    from prefixmesh.loadgen.workloads.sources import sharegpt_conversations
    from prefixmesh.shared.wire import ChatMessage

    texts = [c[0][1] for c in sharegpt_conversations()
             if c and c[0][0] == "human" and c[0][1].strip()]
    random.Random(PROMPT_SEED).shuffle(texts)
    return [tok.encode_chat([ChatMessage(role="user", content=t)]) for t in texts[:n]]


def _batches(prompts: list[list[int]], batch: int, count: int) -> list[list[list[int]]]:
    return [[prompts[(b * batch + i) % len(prompts)] for i in range(batch)]
            for b in range(count)]


def bench_service(args: argparse.Namespace) -> dict:
    """The service's model path in process (one micro-batch per call)."""
    from prefixmesh.services.predictor.serving import ModelPredictor

    model = ModelPredictor(args.model, threads=args.threads)
    prompts = chat_prompts(args.batch * args.batches, model.tok)
    batches = _batches(prompts, args.batch, args.batches + WARMUP_BATCHES)
    for b in batches[:WARMUP_BATCHES]:
        model.predict(b)
    total, decode, cpu = [], [], []
    for b in batches[WARMUP_BATCHES:]:
        t0 = time.perf_counter()
        model.texts(b)
        t1 = time.perf_counter()
        c1 = time.process_time()
        model.predict(b)
        t2 = time.perf_counter()
        cpu.append(time.process_time() - c1)
        decode.append(t1 - t0)
        total.append(t2 - t1)
    return {"bench": "predictor-service", "encoder": model.mode, "model": str(args.model),
            "batch": args.batch, "threads": args.threads,
            "prompt_tokens_mean": round(float(np.mean([len(p) for p in prompts])), 1),
            "predict": _ms(total), "predict_cpu": _ms(cpu), "decode_only": _ms(decode),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


async def _nats_rounds(url: str, prefix: str, prompts: list[list[int]], batch: int,
                       rounds: int, timeout: float) -> tuple[list[float], list[float], int]:
    from prefixmesh.shared.bus import Bus, BusUnavailable
    from prefixmesh.shared.subjects import Subjects
    from prefixmesh.shared.wire import PREDICT_REPLY, PredictLengthRequest

    bus = await Bus.connect(url, Subjects(prefix), "predictor-bench")
    try:
        subj = bus.subjects.predict_length
        deadline = time.monotonic() + 120  # the service loads MiniLM first
        while True:
            try:
                await bus.request(subj, PredictLengthRequest(request_id="ping", prompt_tokens=1,
                                                             token_ids=prompts[0]),
                                  PREDICT_REPLY, timeout)
                break
            except BusUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

        async def one(rid: str, ids: list[int], lat: list[float]) -> bool:
            t0 = time.perf_counter()
            r = await bus.request(subj, PredictLengthRequest(
                request_id=rid, prompt_tokens=len(ids), token_ids=ids), PREDICT_REPLY, timeout)
            lat.append(time.perf_counter() - t0)
            return r.error is None

        round_s, request_s, errors = [], [], 0
        for r, b in enumerate(_batches(prompts, batch, rounds + WARMUP_BATCHES)):
            lat: list[float] = []
            t0 = time.perf_counter()
            ok = await asyncio.gather(*(one(f"r{r}-{i}", ids, lat) for i, ids in enumerate(b)))
            if r >= WARMUP_BATCHES:
                round_s.append(time.perf_counter() - t0)
                request_s.extend(lat)
                errors += ok.count(False)
        return round_s, request_s, errors
    finally:
        await bus.close()


def _batch_sizes(port: int) -> dict:
    """Batches the predictor answered and their mean size (its /metrics, warm-up included)."""
    from urllib.request import urlopen

    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    vals = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("prefixmesh_predictor_batch_size_count", "prefixmesh_predictor_batch_size_sum"):
            vals[name.rsplit("_", 1)[1]] = float(value)
    count = vals.get("count", 0.0)
    return {"batches": int(count), "mean_size": round(vals.get("sum", 0.0) / max(count, 1), 2)}


def bench_nats(args: argparse.Namespace) -> dict:
    """Rounds of ``batch`` concurrent requests to a predictor process over NATS."""
    from prefixmesh.shared.runtime.servers import (
        ManagedProcess,
        child_env,
        free_port,
        start_nats,
    )
    from prefixmesh.shared.text.tokenizer import TextTokenizer

    prompts = chat_prompts(args.batch * args.batches, TextTokenizer.load())
    with tempfile.TemporaryDirectory() as tmp:
        nats, url = start_nats(log_path=Path(tmp) / "nats.log")
        prefix = f"bench{os.getpid()}"
        metrics_port = free_port()
        svc = ManagedProcess("predictor", [sys.executable, "-m", "prefixmesh.services.predictor"],
                             env=child_env(PM_NATS_URL=url, PM_SUBJECT_PREFIX=prefix,
                                           PM_MODEL_DIR=str(args.model),
                                           PM_THREADS=str(args.threads),
                                           PM_MAX_BATCH=str(args.batch),
                                           PM_BATCH_WAIT_MS=str(args.batch_wait_ms),
                                           PM_METRICS_PORT=str(metrics_port)),
                             log_path=Path(args.log) if args.log else None).start()
        try:
            rounds, requests, errors = asyncio.run(_nats_rounds(
                url, prefix, prompts, args.batch, args.batches, args.timeout))
            batches = _batch_sizes(metrics_port)
        finally:
            svc.stop()
            nats.stop()
    return {"bench": "predictor-nats", "model": str(args.model), "batch": args.batch,
            "threads": args.threads, "batch_wait_ms": args.batch_wait_ms,
            "round": _ms(rounds), "request": _ms(requests), "errors": errors,
            "service_batches": batches,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def _run_requests(engine, tok, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Run ``prompts`` to ``max_tokens`` each (ignore_eos) on a running-loop-less engine;
    returns the seconds of every decode forward pass (one token each)."""
    from prefixmesh.services.worker.engine.types import EngineRequest
    from prefixmesh.shared.wire import SamplingParams

    decode_s: list[float] = []
    forward = engine._forward

    def timed(seq, n):  # the engine's own per-pass timing (torch only, no Python around it)
        out = forward(seq, n)
        if seq.req.num_computed_tokens >= seq.req.num_prompt_tokens:
            decode_s.append(out[2])
        return out

    engine._forward = timed
    finished: set[str] = set()

    async def emit(out, text: str, logprobs=None) -> None:
        if out.finished:
            finished.add(out.request_id)

    async def publish(events: list) -> None:
        return None

    async def go() -> None:
        task = asyncio.create_task(engine.run(emit, publish))
        try:
            for i, ids in enumerate(prompts):
                engine.add(EngineRequest(request_id=f"q{i}", prompt_token_ids=ids,
                                         max_tokens=max_tokens, predicted_output=128.0),
                           time.monotonic(), SamplingParams(max_tokens=max_tokens,
                                                            temperature=0.0, ignore_eos=True))
            while len(finished) < len(prompts):
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    engine._forward = forward
    return decode_s


def bench_refine(args: argparse.Namespace) -> dict:
    """Refinement cost per decode step against the hf engine's decode step."""
    from prefixmesh.services.worker.engine.hf_engine import HfEngine, HfEngineConfig
    from prefixmesh.services.worker.local import make_local_policy
    from prefixmesh.services.worker.refiner import attach_refiner
    from prefixmesh.shared.text.tokenizer import TextTokenizer

    tok = TextTokenizer.load()
    prompts = [p[:args.prompt_tokens] for p in chat_prompts(args.requests, tok)]
    cfg = HfEngineConfig(num_blocks=256, threads=args.threads)
    base = HfEngine(cfg, make_local_policy("sprpt_limited"), tok)
    base.load()
    runs: dict[str, dict[str, Any]] = {}
    for mode in args.order.split(","):
        engine = HfEngine(cfg, make_local_policy("sprpt_limited"), tok)
        refiner = attach_refiner(engine, args.model) if mode == "refine" else None
        engine.model, engine.pool = base.model, base.pool
        decode = _run_requests(engine, tok, prompts, args.max_tokens)
        engine.close()
        row: dict[str, Any] = {"decode_step": _ms(decode)}
        if refiner is not None:
            per_step = refiner.seconds / max(refiner.calls, 1)
            row.update({
                "layer": refiner.layer, "tokens_per_update": refiner.every,
                "hidden_callbacks": refiner.calls, "probe_readings": refiner.readings,
                "refine_us_per_decode_step": round(per_step * 1e6, 2),
                "refine_us_per_reading": round(refiner.seconds / max(refiner.readings, 1)
                                               * 1e6, 2),
                "refine_overhead_pct": round(100 * per_step / float(np.mean(decode)), 4)})
        runs[mode] = row
    out = {"bench": "predictor-refine", "model": str(args.model), "requests": args.requests,
           "max_tokens": args.max_tokens, "prompt_tokens_max": args.prompt_tokens,
           "threads": args.threads, "runs": runs,
           "load_avg_1m": round(os.getloadavg()[0], 2)}
    if "refine" in runs and "plain" in runs:
        a = runs["refine"]["decode_step"]["mean_ms"]
        b = runs["plain"]["decode_step"]["mean_ms"]
        out["capture_delta_pct"] = round(100 * (a - b) / b, 2)  # noisy on a shared box
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.predictor.bench",
                                 description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    for name, help_ in (("service", "model path in process"), ("nats", "through NATS"),
                        ("refine", "worker refinement overhead per decode step")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", required=True, help="predictor artifact folder")
        p.add_argument("--json", type=Path, required=True, help="write the result here")
        p.add_argument("--threads", type=int, default=1, help="torch threads")
        if name in ("service", "nats"):
            p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="prompts per batch")
            p.add_argument("--batches", type=int, default=DEFAULT_BATCHES,
                           help="timed batches (after 2 warm-up ones)")
        if name == "nats":
            p.add_argument("--batch-wait-ms", type=float, default=2.0,
                           help="the service's batch_wait_ms")
            p.add_argument("--timeout", type=float, default=30.0, help="per request (s)")
            p.add_argument("--log", default="", help="predictor process log file")
        if name == "refine":
            p.add_argument("--requests", type=int, default=4, help="requests run at once")
            p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
            p.add_argument("--prompt-tokens", type=int, default=256,
                           help="prompt tokens kept per request")
            p.add_argument("--order", default="refine,plain",
                           help="runs in this order: refine (probe on), plain (off)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = {"service": bench_service, "nats": bench_nats, "refine": bench_refine}[args.verb]
    result = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
