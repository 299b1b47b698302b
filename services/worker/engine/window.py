"""Sliding-window sums for the engine's load statistics (pure logic)."""

from __future__ import annotations

from collections import deque


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
