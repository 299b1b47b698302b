"""``fcfs``: first come, first served (the baseline local policy, docs/design.md section 6)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.services.worker.engine.types import EngineRequest
from prefixmesh.services.worker.local.base import (
    CacheProbe,
    QueuedPolicy,
    prefill_estimate,
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
        out: list[EngineRequest] = []
        budget = token_budget
        while len(out) < max_requests and budget > 0:
            req = self._q.pop_oldest()
            if req is None:
                break
            out.append(req)
            budget -= prefill_estimate(req, cache)
        return out
