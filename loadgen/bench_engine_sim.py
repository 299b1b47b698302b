"""Micro-benchmark: simulated engine steps per second of wall time, decode-heavy.

Not a test (docs/design.md section 11): run on purpose,
``python -m prefixmesh.loadgen.bench_engine_sim [--json OUT]``. Keeps ``--running`` requests
in decode (long outputs, refilled as they finish) and times plan_step + finish_step.
By default ``finish_step`` runs as the cluster simulator calls it (outputs of finished
requests only); ``--all-outputs`` times the live worker's mode (an output per running
request per step, for streaming).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import EngineRequest
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel

DEFAULT_RUNNING = 64
DEFAULT_STEPS = 20_000
# Timed runs; the best one is the headline (other processes only ever slow a run down).
DEFAULT_REPEAT = 5
DEFAULT_PROMPT_TOKENS = 512
# Shared leading tokens of every prompt, so admissions exercise the prefix cache.
SHARED_PREFIX_TOKENS = 256
# Output length of each request (tokens): long enough that most steps are pure decode,
# short enough that requests finish, free blocks and are replaced during the run.
OUTPUT_TOKENS = 2_048


def _request(i: int, prompt_tokens: int) -> EngineRequest:
    prompt = list(range(SHARED_PREFIX_TOKENS)) + [
        100_000 + i * prompt_tokens + j for j in range(prompt_tokens - SHARED_PREFIX_TOKENS)
    ]
    return EngineRequest(f"bench-{i}", prompt, max_tokens=OUTPUT_TOKENS, output_len=OUTPUT_TOKENS)


def run(profile: str, running: int, steps: int, prompt_tokens: int,
        finished_only: bool = True) -> dict:
    """Time ``steps`` steps with ``running`` requests kept in the batch; the result record."""
    engine = SimEngine(CostModel.load(profile))
    now = 0.0
    issued = 0
    for _ in range(running):
        engine.add(_request(issued, prompt_tokens), now)
        issued += 1
    # Warm up: get everyone through prefill to their first token.
    started = 0
    while started < running:
        plan = engine.plan_step(now)
        assert plan is not None
        now += plan.duration
        started += sum(out.first_token for out in engine.finish_step(plan, now))
    done = decode_tokens = all_tokens = 0
    start = time.perf_counter()
    for _ in range(steps):
        plan = engine.plan_step(now)
        assert plan is not None
        now += plan.duration
        decode_tokens += plan.decode_tokens
        all_tokens += plan.total_tokens
        for out in engine.finish_step(plan, now, finished_only):
            if out.finished:
                done += 1
                engine.add(_request(issued, prompt_tokens), now)
                issued += 1
        engine.take_kv_events()
    elapsed = time.perf_counter() - start
    return {
        "benchmark": "sim_engine_steps",
        "running": running,
        "steps": steps,
        "steps_per_s": steps / elapsed,
        "decode_share": decode_tokens / all_tokens,
        "finished_requests": done,
        "simulated_s": now,
        "wall_s": elapsed,
        "profile": profile,
        "outputs": "finished" if finished_only else "all",
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: run the benchmark, print its JSON, optionally write it to ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="cost-model profile")
    parser.add_argument("--running", type=int, default=DEFAULT_RUNNING, help="batch size")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed steps")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="timed runs")
    parser.add_argument("--all-outputs", action="store_true",
                        help="build every step output, as the live worker does")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    runs = [
        run(args.profile, args.running, args.steps, args.prompt_tokens, not args.all_outputs)
        for _ in range(max(args.repeat, 1))
    ]
    rates = sorted(r["steps_per_s"] for r in runs)
    result = max(runs, key=lambda r: r["steps_per_s"])
    result["steps_per_s_median"] = rates[len(rates) // 2]
    result["repeat"] = len(runs)
    result["python"] = platform.python_version()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
