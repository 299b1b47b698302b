"""guidellm as a second, independent load client for ``prefixmesh compare --clients``.

A neutral cross-check of ``prefixmesh bench``: the same seeded requests (text prompts and
output lengths) are written to a JSON-lines file and replayed by guidellm (a third-party
benchmark, installed on its own, e.g. ``pip install guidellm`` in a separate virtualenv,
and named by ``--guidellm PATH``) with its own Poisson arrivals at the same rate, against
the same contender. Its token counting uses the SmolLM2 tokenizer folder that prefixmesh
caches locally, so nothing is fetched from a model hub.

The result row is built from guidellm's own statistics (latency mean, median, p90, p99;
TTFT mean and p99; inter-token latency mean) plus throughput and cache hit ratio from its
per-request records, then converted to model time like a ``prefixmesh bench`` row. Written against
guidellm 0.8.1's command line (``guidellm run --backend kind=openai_http,...``) and report.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixmesh.loadgen.options import WorkloadSpec
from prefixmesh.loadgen.results import to_model_time
from prefixmesh.loadgen.text_prompts import as_text
from prefixmesh.shared.text.gguf_vocab import ensure_default_tokenizer

# Seconds guidellm may run beyond the arrivals (drain, start-up).
GUIDELLM_SLACK_S = 300.0


def export_requests(spec: WorkloadSpec, count: int, path: Path) -> None:
    """The first ``count`` seeded requests of ``spec`` (as ``prefixmesh bench`` sends them:
    text prompts, exactly ``max_tokens`` output tokens) as guidellm's JSON-lines data."""
    with open(path, "w") as f:
        for r in as_text(spec.requests(count)):
            f.write(json.dumps({"prompt": r.prompt, "output_tokens_count": r.max_tokens}) + "\n")


def guidellm_argv(exe: str, url: str, model: str, data: Path, rate: float, count: int,
                  out: Path) -> list[str]:
    """The guidellm command: Poisson arrivals at ``rate`` (wall req/s), ``count`` requests,
    completions API, local tokenizer, JSON report at ``out``."""
    tokenizer_dir = ensure_default_tokenizer().parent
    return [exe, "run",
            "--backend", f"kind=openai_http,target={url},model={model},"
                         "request_format=/v1/completions",
            "--profile", f"kind=poisson,rate={rate:g}",
            "--constraint", f"kind=max_requests,count={count}",
            "--data", f"kind=json_file,path={data}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


def run_guidellm(exe: str, url: str, model: str, spec: WorkloadSpec, rate: float,
                 duration_s: float, time_scale: float, labels: dict[str, Any], work: Path,
                 log_path: Path) -> dict[str, Any]:
    """Replay ``rate x duration`` requests (model time) with guidellm; one result row."""
    count = max(1, round(rate * duration_s))
    data, out = work.with_suffix(".jsonl"), work.with_suffix(".guidellm.json")
    export_requests(spec, count, data)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log_path, "ab") as log:
        subprocess.run(guidellm_argv(exe, url, model, data, rate / time_scale, count, out),
                       stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       env=env, check=True,
                       timeout=duration_s * time_scale * 3 + GUIDELLM_SLACK_S)
    report = json.loads(out.read_text())
    row = row_from_report(report["benchmarks"][0], labels)
    return to_model_time({**row, "workload": spec.workload, "rate": rate}, time_scale)


def _stat(metric: dict[str, Any], key: str, scale: float = 1.0) -> float:
    s = metric.get("successful") or {}
    if key in ("mean", "median"):
        return (s.get(key) or 0.0) * scale
    return ((s.get("percentiles") or {}).get(key) or 0.0) * scale


def row_from_report(bench: dict[str, Any], labels: dict[str, Any]) -> dict[str, Any]:
    """A docs/design.md section 11 row (wall seconds) from one benchmark of a guidellm JSON
    report."""
    m = bench["metrics"]
    totals = m["request_totals"]
    ok: Sequence[dict[str, Any]] = bench["requests"].get("successful") or []
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    starts = sorted(r["request_start_time"] for r in ok)
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    lat, ttft = m["request_latency"], m["time_to_first_token_ms"]
    return {
        **labels,
        "requests": totals["total"], "completed": totals["successful"],
        "failed": totals["total"] - totals["successful"],
        "latency_avg_s": _stat(lat, "mean"), "latency_p50_s": _stat(lat, "median"),
        "latency_p90_s": _stat(lat, "p90"), "latency_p99_s": _stat(lat, "p99"),
        "ttft_avg_s": _stat(ttft, "mean", 1e-3), "ttft_p99_s": _stat(ttft, "p99", 1e-3),
        # guidellm's inter-token latency is (latency - TTFT) / (output tokens - 1): the
        # TPOT of docs/design.md section 11 (its own "TPOT" divides the whole latency).
        "tpot_avg_s": _stat(m["inter_token_latency_ms"], "mean", 1e-3),
        "throughput_rps": totals["successful"] / bench["duration"] if bench["duration"] else 0.0,
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
        # The rate guidellm really sent at (wall): requests over the span of their starts.
        "sent_rps_wall": (len(starts) - 1) / span if span > 0 else 0.0,
    }
