"""Per-request results and the run summary in the result schema of docs/design.md section 11."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request (times in seconds from its send)."""

    ok: bool
    latency_s: float = 0.0
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    send_lag_s: float = 0.0  # sent this much after its arrival time (wall seconds)


# Distinct error messages a row lists for its failed requests (the most frequent first), and
# the characters kept of each.
ERRORS_LISTED = 5
ERROR_CHARS = 160


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def summarize(results: Sequence[RequestResult], duration_s: float, **labels: Any
              ) -> dict[str, Any]:
    """One run's row: ``labels`` (policy, local_policy, workload, rate, gpus, backend) plus
    the latency, TTFT, TPOT, throughput and cache-hit figures; with failures, ``errors``
    counts their messages (the ``ERRORS_LISTED`` most frequent)."""
    ok = [r for r in results if r.ok]
    lat = sorted(r.latency_s for r in ok)
    ttft = sorted(r.ttft_s for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    row = {
        **labels,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "latency_avg_s": sum(lat) / len(lat) if lat else 0.0,
        "latency_p50_s": percentile(lat, 50),
        "latency_p90_s": percentile(lat, 90),
        "latency_p99_s": percentile(lat, 99),
        "ttft_avg_s": sum(ttft) / len(ttft) if ttft else 0.0,
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_avg_s": sum(tpots) / len(tpots) if tpots else 0.0,
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else 0.0,
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
    }
    if len(ok) < len(results):
        seen = Counter((r.error or "unknown")[:ERROR_CHARS] for r in results if not r.ok)
        row["errors"] = dict(seen.most_common(ERRORS_LISTED))
    return row


def send_lag(results: Sequence[RequestResult]) -> dict[str, float]:
    """Whether a live client kept up with its arrival times (wall seconds, all requests)."""
    return {"send_lag_p99_wall_s": percentile(sorted(r.send_lag_s for r in results), 99),
            "send_lag_max_wall_s": max((r.send_lag_s for r in results), default=0.0)}


# Row fields in seconds (divided by the time scale) and per second (multiplied by it).
_SECONDS = ("latency_avg_s", "latency_p50_s", "latency_p90_s", "latency_p99_s",
            "ttft_avg_s", "ttft_p99_s", "tpot_avg_s")
_PER_SECOND = ("throughput_rps",)


def to_model_time(row: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """A row measured against sim workers slowed ``time_scale`` times, in model time:
    seconds / K, rates x K (``*_wall_s`` fields stay wall). Marks the row with
    ``time_scale`` and ``times: "model"``. Overheads outside the simulated GPUs (client,
    HTTP, router, bus) are divided by K as well."""
    out = dict(row)
    for k in _SECONDS:
        if k in out:
            out[k] = out[k] / time_scale
    for k in _PER_SECOND:
        if k in out:
            out[k] = out[k] * time_scale
    out["time_scale"] = time_scale
    out["times"] = "model" if time_scale != 1.0 else "wall"
    return out
