"""The cluster view (pure): latest load report per worker plus windowed completion stats."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shared.messages import BatchProgressEvent, LoadReportEvent, RequestDoneEvent

# Completions kept for the latency/hit-ratio window.
DONE_WINDOW = 2048
# A worker silent for this long (seconds) is shown as stale.
STALE_AFTER_S = 1.0
# Offline batches shown (the most recently updated).
BATCHES_SHOWN = 50


@dataclass
class ClusterView:
    """What the cluster is doing now, from load reports and completion records."""

    workers: dict[str, LoadReportEvent] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)
    done: deque[RequestDoneEvent] = field(default_factory=lambda: deque(maxlen=DONE_WINDOW))
    completed_total: int = 0
    # Latest progress of each offline batch, by batch id (insertion = update order).
    batches: dict[str, BatchProgressEvent] = field(default_factory=dict)

    def on_batch(self, ev: BatchProgressEvent) -> None:
        self.batches.pop(ev.batch_id, None)
        self.batches[ev.batch_id] = ev
        while len(self.batches) > BATCHES_SHOWN:
            del self.batches[next(iter(self.batches))]

    def on_load(self, report: LoadReportEvent, now: float) -> None:
        self.workers[report.worker_id] = report
        self.seen_at[report.worker_id] = now

    def on_done(self, done: RequestDoneEvent) -> None:
        self.done.append(done)
        self.completed_total += 1

    def snapshot(self, now: float) -> dict[str, Any]:
        """JSON-ready view: workers with their load, and recent latency percentiles."""
        lat = sorted(d.latency_s for d in self.done)
        prompt = sum(d.prompt_tokens for d in self.done)
        cached = sum(d.cached_tokens for d in self.done)

        def pct(p: float) -> float:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else 0.0

        return {
            "workers": [
                {"worker_id": w, "running": r.running, "waiting": r.waiting,
                 "free_blocks": r.free_blocks, "total_blocks": r.total_blocks,
                 "decode_share": r.decode_share, "hit_ratio": r.hit_ratio,
                 "stale": now - self.seen_at[w] > STALE_AFTER_S}
                for w, r in sorted(self.workers.items())
            ],
            "completed_total": self.completed_total,
            "recent": {"requests": len(lat), "latency_p50_s": pct(0.5),
                       "latency_p99_s": pct(0.99),
                       "cache_hit_ratio": cached / prompt if prompt else 0.0},
            "batches": [{"id": b.batch_id, "status": b.status, "total": b.total,
                         "completed": b.completed, "failed": b.failed}
                        for b in reversed(self.batches.values())],
        }
