"""The cluster view (pure): latest load report per worker, the scheduler's summary, windowed
completion stats and a short history of them for the dashboard's charts.

Times: ``now`` arguments are ``time.monotonic()`` seconds (staleness, windows); ``wall``
arguments are Unix seconds, only stamped on history points for the browser's time axis.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prefixmesh.shared.wire import (
    BatchProgressEvent,
    LoadReportEvent,
    RequestDoneEvent,
    SchedulerStatsEvent,
)

# Completions kept for the latency/hit-ratio window.
DONE_WINDOW = 2048
# A worker silent for this long (seconds) is shown as stale...
STALE_AFTER_S = 1.0
# ...and one silent for this long is dropped from the view (it left or died).
FORGET_AFTER_S = 30.0
# The scheduler summary is shown as stale after this long without a new one (seconds).
SCHEDULER_STALE_AFTER_S = 5.0
# Offline batches shown (the most recently updated).
BATCHES_SHOWN = 50
# History: one point per sample (the service samples every second), this many kept.
HISTORY_POINTS = 300
# Completions of the trailing window each history point summarizes (seconds).
HISTORY_WINDOW_S = 10.0


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(p * len(sorted_values)))]


@dataclass
class WorkerTotals:
    """Completion counters of one worker since the view started."""

    completed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class ClusterView:
    """What the cluster is doing now, from load reports, completions and scheduler stats."""

    workers: dict[str, LoadReportEvent] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)
    totals: dict[str, WorkerTotals] = field(default_factory=dict)
    # (arrival time, record), oldest first.
    done: deque[tuple[float, RequestDoneEvent]] = field(
        default_factory=lambda: deque(maxlen=DONE_WINDOW))
    completed_total: int = 0
    scheduler: SchedulerStatsEvent | None = None
    scheduler_seen_at: float = 0.0
    history: deque[dict[str, float]] = field(
        default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    # Latest progress of each offline batch, by batch id (insertion = update order).
    batches: dict[str, BatchProgressEvent] = field(default_factory=dict)

    # ------------------------------------------------------------------ input

    def on_batch(self, ev: BatchProgressEvent) -> None:
        self.batches.pop(ev.batch_id, None)
        self.batches[ev.batch_id] = ev
        while len(self.batches) > BATCHES_SHOWN:
            del self.batches[next(iter(self.batches))]

    def on_load(self, report: LoadReportEvent, now: float) -> None:
        self.workers[report.worker_id] = report
        self.seen_at[report.worker_id] = now

    def on_done(self, done: RequestDoneEvent, now: float = 0.0) -> None:
        self.done.append((now, done))
        self.completed_total += 1
        t = self.totals.setdefault(done.worker_id, WorkerTotals())
        t.completed += 1
        t.prompt_tokens += done.prompt_tokens
        t.cached_tokens += done.cached_tokens

    def on_scheduler(self, stats: SchedulerStatsEvent, now: float) -> None:
        self.scheduler = stats
        self.scheduler_seen_at = now

    def forget_silent(self, now: float) -> list[str]:
        """Drop workers silent for ``FORGET_AFTER_S``; returns their ids."""
        gone = [w for w, t in self.seen_at.items() if now - t > FORGET_AFTER_S]
        for w in gone:
            del self.workers[w], self.seen_at[w]
            self.totals.pop(w, None)
        return gone

    def sample(self, now: float, wall: float) -> dict[str, float]:
        """Append (and return) one history point: the trailing window's rates and latencies."""
        recent = [d for t, d in self.done if now - t <= HISTORY_WINDOW_S]
        lat = sorted(d.latency_s for d in recent)
        ttft = sorted(d.ttft_s for d in recent)
        prompt = sum(d.prompt_tokens for d in recent)
        cached = sum(d.cached_tokens for d in recent)
        live = [r for w, r in self.workers.items() if now - self.seen_at[w] <= STALE_AFTER_S]
        point = {
            "t": wall,
            "throughput_rps": len(recent) / HISTORY_WINDOW_S,
            "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "cache_hit_ratio": cached / prompt if prompt else 0.0,
            "running": float(sum(r.running for r in live)),
            "waiting": float(sum(r.waiting for r in live)),
        }
        self.history.append(point)
        return point

    # ------------------------------------------------------------------ output

    def _worker(self, w: str, r: LoadReportEvent, now: float) -> dict[str, Any]:
        t = self.totals.get(w, WorkerTotals())
        return {
            "worker_id": w, "backend": r.backend, "model": r.model,
            "running": r.running, "waiting": r.waiting,
            "free_blocks": r.free_blocks, "total_blocks": r.total_blocks,
            "kv_usage": (r.total_blocks - r.free_blocks) / r.total_blocks
            if r.total_blocks else 0.0,
            "decode_share": r.decode_share, "hit_ratio": r.hit_ratio,
            "outstanding_tokens": r.outstanding_tokens, "avg_queue_s": r.avg_queue_s,
            "avg_step_s": r.avg_step_s, "steps": r.steps,
            "completed": t.completed,
            "hit_ratio_total": t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0,
            "stale": now - self.seen_at[w] > STALE_AFTER_S,
        }

    def _scheduler(self, now: float) -> dict[str, Any] | None:
        s = self.scheduler
        if s is None:
            return None
        total = sum(s.decisions.values())
        return {
            "id": s.scheduler_id, "policy": s.policy, "workers": s.workers,
            "decisions": dict(sorted(s.decisions.items())),
            "decision_share": {k: v / total for k, v in sorted(s.decisions.items())}
            if total else {},
            "tree_nodes": s.tree_nodes, "tree_tokens": s.tree_tokens,
            "kv_lag_s": s.kv_lag_s, "kv_gaps": s.kv_gaps,
            "replicas_added": s.replicas_added, "replicas_dropped": s.replicas_dropped,
            "hot_prefixes": [{"prefix_id": h.prefix_id, "tokens": h.tokens,
                              "requests": h.requests, "workers": h.workers,
                              "requests_by_worker": h.requests_by_worker}
                             for h in s.hot_prefixes],
            "stale": now - self.scheduler_seen_at > SCHEDULER_STALE_AFTER_S,
        }

    def snapshot(self, now: float) -> dict[str, Any]:
        """JSON-ready view: workers, scheduler summary, recent percentiles and history."""
        lat = sorted(d.latency_s for _t, d in self.done)
        ttft = sorted(d.ttft_s for _t, d in self.done)
        prompt = sum(d.prompt_tokens for _t, d in self.done)
        cached = sum(d.cached_tokens for _t, d in self.done)
        return {
            "workers": [self._worker(w, r, now) for w, r in sorted(self.workers.items())],
            "completed_total": self.completed_total,
            "recent": {"requests": len(lat), "latency_p50_s": percentile(lat, 0.5),
                       "latency_p90_s": percentile(lat, 0.9),
                       "latency_p99_s": percentile(lat, 0.99),
                       "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
                       "cache_hit_ratio": cached / prompt if prompt else 0.0},
            "scheduler": self._scheduler(now),
            "history": list(self.history),
            "batches": [{"id": b.batch_id, "status": b.status, "total": b.total,
                         "completed": b.completed, "failed": b.failed}
                        for b in reversed(self.batches.values())],
        }
