"""Sliding-window sums for the engine's load statistics (pure logic)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from prefixmesh.services.worker.engine.types import EngineRequest, EngineStats


class SlidingSums:
    """Sums of three-value samples over the last ``span`` seconds (amortised O(1) each)."""

    __slots__ = ("_items", "a", "b", "c", "span")

    def __init__(self, span: float) -> None:
        self.span = span
        self.a = self.b = self.c = 0.0
        self._items: deque[tuple[float, float, float, float]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, t: float, a: float, b: float, c: float) -> None:
        """Record a sample at time ``t``, dropping samples older than the span."""
        self._items.append((t, a, b, c))
        self.a += a
        self.b += b
        self.c += c
        if self._items[0][0] < t - self.span:
            self.trim(t)

    def trim(self, now: float) -> None:
        """Drop samples older than ``now - span``."""
        items, horizon = self._items, now - self.span
        while items and items[0][0] < horizon:
            _, a, b, c = items.popleft()
            self.a -= a
            self.b -= b
            self.c -= c
        if not items:  # no float drift once the window empties
            self.a = self.b = self.c = 0.0



def engine_stats(steps: SlidingSums, admits: SlidingSums, now: float,
                 requests: Iterable[EngineRequest], *, running: int, waiting: int,
                 free_blocks: int, total_blocks: int, block_size: int,
                 preemptions: int = 0) -> EngineStats:
    """The load snapshot every backend reports, from its two windows (one definition of
    each figure, whatever the backend); O(len(requests)) for the outstanding tokens.

    ``steps`` holds per finished step (seconds, decode tokens, all tokens); ``admits`` per
    first admission (prompt tokens, cached tokens, seconds queued).
    """
    steps.trim(now)
    admits.trim(now)
    outstanding = 0  # prompt tokens left to compute + output tokens left to generate
    for r in requests:
        left = r.num_prompt_tokens - r.num_computed_tokens
        if left > 0:
            outstanding += left
        left = r.target_output_tokens - r.num_output_tokens
        if left > 0:
            outstanding += left
    n_steps, n_admits = len(steps), len(admits)
    return EngineStats(
        running=running,
        waiting=waiting,
        free_blocks=free_blocks,
        total_blocks=total_blocks,
        block_size=block_size,
        decode_share=steps.b / steps.c if steps.c > 0 else 0.0,
        hit_ratio=admits.b / admits.a if admits.a > 0 else 0.0,
        outstanding_tokens=outstanding,
        avg_queue_s=admits.c / n_admits if n_admits else 0.0,
        steps=n_steps,
        avg_step_s=steps.a / n_steps if n_steps else 0.0,
        window_s=steps.span,
        preemptions=preemptions,
    )
