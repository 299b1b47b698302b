"""Per-request results and the run summary in the result schema of DESIGN.md section 11."""

from __future__ import annotations

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


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def summarize(results: Sequence[RequestResult], duration_s: float, **labels: Any
              ) -> dict[str, Any]:
    """One run's row: ``labels`` (policy, local_policy, workload, rate, gpus, backend) plus
    the latency, TTFT, TPOT, throughput and cache-hit figures."""
    ok = [r for r in results if r.ok]
    lat = sorted(r.latency_s for r in ok)
    ttft = sorted(r.ttft_s for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
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
