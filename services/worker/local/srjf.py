"""``srjf_calibrated``: PrefillOnly's shortest remaining job first, calibrated by the
prefix cache and by waiting time (docs/design.md section 6; PrefillOnly, section 5).

For prefill-only requests (one output token) the job is the prefill, and its length is
what is *not* cached now. Before every step each waiting request gets

    score = (n_input - n_cached_now) - lambda * t_queue

with ``n_cached_now`` probed against the engine's cache as it is at this step (whole
blocks, never the last token: ``tokens_to_prefill``), ``t_queue = now - arrival`` in
seconds and ``lambda`` = 500 tokens per second waited. The lowest score runs next, one
request per step: running one request changes what is cached, and so every other score,
which is the point (a request sharing a prefix with the one that just ran jumps ahead).
The aging term bounds starvation: a request waiting ``gap / lambda`` seconds beats any
fresh request ``gap`` tokens shorter.

Requeued requests (the engine could not place them) are offered first, as the interface
requires. Cost: every ``select`` probes each waiting request once (a binary search over
its block hashes), so O(n log b) per step for n waiting requests of b blocks; to bound it
under extreme overload only the ``scan_limit`` oldest are scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from prefixmesh.services.worker.engine.types import EngineRequest
from prefixmesh.services.worker.local.base import (
    CacheProbe,
    QueuedPolicy,
    tokens_to_prefill,
)


@dataclass(frozen=True, slots=True)
class SrjfConfig:
    """Knobs of ``srjf_calibrated``."""

    # PrefillOnly's lambda: tokens of prefill a request is credited per second it waits
    # (subtracted from its score).
    lambda_tokens_per_s: float = 500.0
    # Oldest waiting requests scored per select (requests); only bites in deep overload.
    scan_limit: int = 4096

    def __post_init__(self) -> None:
        if self.lambda_tokens_per_s < 0 or self.scan_limit < 1:
            raise ValueError(f"invalid srjf_calibrated config: {self}")


class SrjfPolicy(QueuedPolicy):
    """Lowest (uncached prefill - lambda * wait) first, one request per step."""

    name = "srjf_calibrated"

    def __init__(self, config: SrjfConfig | None = None) -> None:
        self.config = config or SrjfConfig()
        super().__init__()

    def score(self, req: EngineRequest, now: float, cache: CacheProbe) -> float:
        """PrefillOnly's calibrated score of ``req`` now (tokens; lower runs first)."""
        cached = cache.cached_prefix_tokens(req.block_hashes)
        uncached = tokens_to_prefill(req, cached, cache.block_size)
        return uncached - self.config.lambda_tokens_per_s * (now - req.arrival)

    def select(
        self, now: float, max_requests: int, token_budget: int, cache: CacheProbe
    ) -> list[EngineRequest]:
        """At most one request: a requeued one, else the lowest score (ties: oldest)."""
        q = self._q
        if max_requests < 1 or token_budget <= 0 or not q:
            return []
        if q.front:
            return [q.front.popleft()]
        # score = uncached - lambda * (now - arrival): compare uncached + lambda * arrival,
        # the same order without the subtraction of ``now``.
        lam, bs = self.config.lambda_tokens_per_s, cache.block_size
        probe = cache.cached_prefix_tokens
        best: EngineRequest | None = None
        best_key = 0.0
        for req in islice(q.queue.values(), self.config.scan_limit):
            key = tokens_to_prefill(req, probe(req.block_hashes), bs) + lam * req.arrival
            if best is None or key < best_key:  # strict: the oldest wins ties
                best, best_key = req, key
        assert best is not None
        del q.queue[best.request_id]
        return [best]
