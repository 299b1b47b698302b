"""``fcfs``: first come, first served (the baseline local policy, docs/design.md section 6)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.services.worker.engine.types import EngineRequest
from prefixmesh.services.worker.local.base import (
    CacheProbe,
    QueuedPolicy,
    take_in_order,
)


@dataclass(frozen=True, slots=True)
class FcfsConfig:
    """``fcfs`` has no knobs; the type exists so every policy is built the same way."""


class FcfsPolicy(QueuedPolicy):
    """Admit in arrival order; requeued (preempted, not admitted) requests first."""

    name = "fcfs"

    def __init__(self, config: FcfsConfig | None = None) -> None:
        self.config = config or FcfsConfig()
        super().__init__()

    def select(
        self, now: float, max_requests: int, token_budget: int, cache: CacheProbe
    ) -> list[EngineRequest]:
        """Oldest first until ``max_requests`` or the token budget is reached."""
        return take_in_order(self._q.pop_oldest, max_requests, token_budget, cache)
