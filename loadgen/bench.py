"""``prefixmesh bench``: open-loop load against any OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import uvloop

from prefixmesh.loadgen.client import run_open_loop
from prefixmesh.loadgen.options import WorkloadSpec, add_workload_args
from prefixmesh.loadgen.results import RequestResult, send_lag, summarize, to_model_time
from prefixmesh.loadgen.text_prompts import as_text

PROGRESS_EVERY_S = 0.5


class Progress:
    """A one-line progress bar on stderr (completed / failed / total)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.ok, self.failed = total, 0, 0
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, r: RequestResult) -> None:
        if r.ok:
            self.ok += 1
        else:
            self.failed += 1
        now = time.monotonic()
        if self.enabled and (now - self._last > PROGRESS_EVERY_S or self.done == self.total):
            self._last = now
            width = 30
            filled = width * self.done // max(self.total, 1)
            print(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                  f"failed {self.failed}", end="", file=sys.stderr, flush=True)

    @property
    def done(self) -> int:
        return self.ok + self.failed


async def first_model(url: str) -> str:
    """The first model the endpoint lists (what the bench sends when --model is not given)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(f"{url}/v1/models") as r:
            r.raise_for_status()
            data = (await r.json())["data"]
    if not data:
        raise SystemExit(f"{url} serves no models")
    return data[0]["id"]


def run_bench(url: str, spec: WorkloadSpec, rate: float, duration_s: float, model: str | None,
              labels: dict, progress: bool = True, text_prompts: bool = False,
              time_scale: float = 1.0) -> dict:
    """Replay ``rate x duration`` requests of ``spec`` against ``url``; one result row.

    With ``time_scale`` K (sim workers run K times slower, ``--time-scale`` on the workers)
    ``rate`` and ``duration_s`` are in model time: the same requests and arrival times are
    sent K times slower, and the row is converted back to model time (``to_model_time``).
    """
    count = max(1, round(rate * duration_s))
    requests = spec.requests(count)
    if text_prompts:
        requests = as_text(requests)
    arrivals = [t * time_scale for t in spec.times(rate, count)]
    model = model or uvloop.run(first_model(url))
    bar = Progress(count, progress)
    # uvloop, as the services run: the client must not be what limits the rate.
    results, wall = uvloop.run(run_open_loop(url, model, requests, arrivals, on_done=bar))
    if progress:
        print(file=sys.stderr)
    row = summarize(results, wall, workload=spec.workload, rate=rate, **labels)
    row.update(send_lag(results))
    return to_model_time(row, time_scale)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixmesh bench",
        description="Open-loop load (streaming, measuring TTFT) against an OpenAI-compatible "
        "/v1/completions endpoint; results in the schema of docs/design.md section 11.")
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    add_workload_args(p)
    p.add_argument("--rate", type=float, required=True, help="mean request rate (req/s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="K: the sim workers run K times slower (their --time-scale K); "
                   "--rate and --duration are model time, sent K times slower, and the "
                   "result is converted back to model time (latency / K, throughput x K)")
    p.add_argument("--model", default=None, help="model name (default: the first listed)")
    p.add_argument("--label", default="prefixmesh", help="'policy' field of the result row")
    p.add_argument("--local-policy", default="", help="'local_policy' field of the result")
    p.add_argument("--gpus", type=int, default=0, help="'gpus' field of the result row")
    p.add_argument("--backend", default="sim", help="'backend' field of the result row")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--text-prompts", action="store_true",
                   help="send prompts as text (SmolLM2-decoded), for routers that route on "
                   "text only, e.g. sglang-router (it rejects token-id prompts)")
    p.add_argument("--json", type=Path, required=True, help="write {\"runs\": [...]} here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rate <= 0 or args.duration <= 0 or args.time_scale <= 0:
        raise SystemExit("--rate, --duration and --time-scale must be positive")
    labels = {"policy": args.label, "local_policy": args.local_policy, "gpus": args.gpus,
              "backend": args.backend}
    try:
        row = run_bench(args.url.rstrip("/"), WorkloadSpec.from_args(args), args.rate,
                        args.duration, args.model, labels, progress=not args.no_progress,
                        text_prompts=args.text_prompts, time_scale=args.time_scale)
    except aiohttp.ClientError as exc:
        raise SystemExit(f"cannot reach {args.url}: {exc}") from None
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": [row]}, indent=1))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
