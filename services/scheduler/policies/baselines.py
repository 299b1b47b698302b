"""Baseline global policies for side-by-side comparison (docs/design.md section 5).

Load-only and affinity-only rules live here; the cache-aware peers (SGLang's
``cache_aware``, Dynamo's ``kv_cost``, llm-d's ``weighted``) in ``baselines_cache``.
"""

from __future__ import annotations

import bisect
import hashlib

from prefixmesh.services.scheduler.policies.base import (
    Decision,
    PolicyConfig,
    RouteInput,
)
from prefixmesh.services.scheduler.policies.baselines_cache import (
    CacheAwarePolicy,
    KvCostPolicy,
    WeightedPolicy,
)
from prefixmesh.services.scheduler.policies.tracking import BaselinePolicy
from prefixmesh.shared.costmodel import CostModel

__all__ = [
    "CacheAwarePolicy",
    "KvCostPolicy",
    "LeastLoadPolicy",
    "PrefixHashPolicy",
    "RoundRobinPolicy",
    "WeightedPolicy",
]

_MASK64 = (1 << 64) - 1
# Fibonacci hashing multiplier: spreads block hashes (already 64-bit) evenly on the ring.
_GOLDEN64 = 0x9E3779B97F4A7C15


class RoundRobinPolicy(BaselinePolicy):
    """Next worker in turn."""

    name = "round_robin"

    def route(self, req: RouteInput, now: float) -> Decision:
        """The next eligible worker after the last one chosen."""
        self.clock(now)
        ws = self.eligible(req)
        w = ws[self.counter % len(ws)]
        self.counter += 1
        self.assigned(req, w, now)
        return Decision(w, self.name, 0)


class LeastLoadPolicy(BaselinePolicy):
    """Fewest outstanding requests (routed minus completed); ties by outstanding tokens."""

    name = "least_load"

    def route(self, req: RouteInput, now: float) -> Decision:
        """The worker with the fewest outstanding requests, then tokens, then join order."""
        self.clock(now)
        ws = self.eligible(req)
        count, tokens = self.out.count, self.out.tokens
        w = min(ws, key=lambda w: (count.get(w, 0), tokens.get(w, 0)))
        self.assigned(req, w, now)
        return Decision(w, self.name, 0)


class PrefixHashPolicy(BaselinePolicy):
    """Consistent hash of the first K tokens: affinity without load.

    The block hash at depth ``K / block`` names the whole head of the prompt (chained
    hashes), so it is the ring key. Workers sit on the ring at ``prefix_hash_vnodes``
    positions each; a request takes the first eligible worker clockwise.
    """

    name = "prefix_hash"

    def __init__(self, config: PolicyConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._ring: list[int] = []
        self._owners: list[str] = []

    def add_worker(self, worker_id: str, capacity_tokens: int, now: float) -> None:
        """Register a worker and place its virtual nodes on the ring (restoring the state
        re-adds each worker through here, so a restored ring is rebuilt too)."""
        super().add_worker(worker_id, capacity_tokens, now)
        self._build_ring()

    def remove_worker(self, worker_id: str, now: float) -> None:
        """Drop a worker and its ring positions (only its keys move)."""
        super().remove_worker(worker_id, now)
        self._build_ring()

    def _build_ring(self) -> None:
        points = sorted(
            (_stable_hash(f"{w}#{i}"), w)
            for w in self._capacity
            for i in range(self.cfg.prefix_hash_vnodes)
        )
        self._ring = [p for p, _ in points]
        self._owners = [w for _, w in points]

    def key(self, req: RouteInput) -> int:
        """Ring position of the request: its prompt head's block hash, mixed to 64 bits."""
        hashes = req.block_hashes
        if not hashes:  # no full block: nothing to be affine to
            return _stable_hash(req.request_id)
        k = max(self.cfg.prefix_hash_tokens // self.block, 1)
        h = hashes[min(k, len(hashes)) - 1]
        return (h * _GOLDEN64) & _MASK64

    def route(self, req: RouteInput, now: float) -> Decision:
        """The owner of the first eligible ring position at or after the key."""
        self.clock(now)
        allowed = set(self.eligible(req))
        ring, owners = self._ring, self._owners
        i = bisect.bisect_left(ring, self.key(req))
        n = len(ring)
        for j in range(n):
            w = owners[(i + j) % n]
            if w in allowed:
                self.assigned(req, w, now)
                return Decision(w, self.name, 0)
        raise AssertionError("ring out of sync with workers")  # eligible() raised otherwise


def _stable_hash(text: str) -> int:
    """64-bit hash stable across processes (``hash(str)`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
