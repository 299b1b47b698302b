"""``fcfs``: first come, first served (the baseline local policy, DESIGN.md s.6)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from services.worker.engine.types import EngineRequest
from services.worker.local.base import CacheProbe, LocalPolicy, WaitingQueue, prefill_estimate


@dataclass(frozen=True, slots=True)
class FcfsConfig:
    """``fcfs`` has no knobs; the type exists so every policy is built the same way."""


class FcfsPolicy(LocalPolicy):
    """Admit in arrival order; requeued (preempted, not admitted) requests first."""

    name = "fcfs"

    def __init__(self, config: FcfsConfig | None = None) -> None:
        self.config = config or FcfsConfig()
        self._q = WaitingQueue()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(self._q)

    def push(self, req: EngineRequest, now: float) -> None:
        """Queue at the back."""
        self._q.push(req)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a waiting request out."""
        return self._q.remove(request_id)

    def requeue_front(self, reqs: Sequence[EngineRequest]) -> None:
        """Put requests back ahead of everyone, in order."""
        self._q.requeue_front(reqs)

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
