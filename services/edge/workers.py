"""Which workers are alive, from their load reports.

The batch planner places on the live ones; the request path (``pipeline``) fails over a
request whose worker has fallen silent.
"""

from __future__ import annotations

import time

from prefixmesh.shared.wire import LoadReportEvent

# A worker silent for this long is not planned on (seconds; load reports come every 0.25 s
# by default, and the scheduler drops a worker after 3 missed reports).
LIVE_WINDOW_S = 1.0


class WorkerDirectory:
    """Last load report time (monotonic seconds) of every worker seen on ``load.*``."""

    def __init__(self, live_window_s: float = LIVE_WINDOW_S) -> None:
        self.live_window_s = live_window_s
        self._seen: dict[str, float] = {}

    async def on_event(self, event: object) -> None:
        """Bus handler for ``load.*``."""
        if isinstance(event, LoadReportEvent):
            self._seen[event.worker_id] = time.monotonic()

    def last_seen(self, worker_id: str) -> float | None:
        """Monotonic time of the worker's last load report (None: never seen)."""
        return self._seen.get(worker_id)

    def live(self) -> list[str]:
        """Workers that reported recently, sorted."""
        cutoff = time.monotonic() - self.live_window_s
        return sorted(w for w, t in self._seen.items() if t >= cutoff)
