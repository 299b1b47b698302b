"""``prefix_fair``: Preble's prefix-aware fair local scheduling (docs/design.md section 6).

Waiting requests fall into ``P`` groups (default 10) by the fraction of their tokens
cached right now: ``group = floor(P * cached / tokens)``, capped at ``P - 1`` (63 of 100
tokens cached -> group 6). Group ``g`` has rank ``g + 1``, so with all groups waiting the
best-cached group gets 10 admissions per 55, the next 9 per 55, down to 1 per 55 for the
coldest. Inside a group, first come first served.

Quotas are kept across steps with smooth weighted round robin (nginx's): every pick adds
each non-empty group's rank to its credit, takes the group with the most credit and
charges it the total rank of the non-empty groups. Over any run of picks with the same
groups waiting the shares are exact; a group's credit restarts at 0 when it empties.
Starvation bound: a non-empty group passed over ``max_group_wait`` picks in a row (default
one full round, ``P(P+1)/2`` = 55) is served next, so the ``k``-th request of any group is
admitted within ``k * (max_group_wait + 1)`` picks.

Cached fractions change as the cache changes, so groups are recomputed against the engine's
cache at every ``select``; to bound per-step work only the oldest ``scan_limit`` waiting
requests are binned (younger ones enter that window as older ones leave).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

from prefixmesh.services.worker.engine.types import EngineRequest
from prefixmesh.services.worker.local.base import (
    CacheProbe,
    QueuedPolicy,
    tokens_to_prefill,
)

DEFAULT_NUM_GROUPS = 10  # Preble's P
# Oldest waiting requests re-binned per select: caps per-step probing at this many prefix
# matches, which keeps a long overload queue from slowing every step.
DEFAULT_SCAN_LIMIT = 256


@dataclass(frozen=True, slots=True)
class PrefixFairConfig:
    """Knobs of ``prefix_fair``."""

    num_groups: int = DEFAULT_NUM_GROUPS
    scan_limit: int = DEFAULT_SCAN_LIMIT
    # Picks a non-empty group may be passed over in a row before it is served regardless
    # of credit; 0 = one full proportional round, P(P+1)/2 picks.
    max_group_wait: int = 0

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.scan_limit < 1 or self.max_group_wait < 0:
            raise ValueError(f"invalid prefix_fair config: {self}")

    @property
    def group_wait_bound(self) -> int:
        """Effective ``max_group_wait`` in picks."""
        return self.max_group_wait or self.num_groups * (self.num_groups + 1) // 2


class PrefixFairPolicy(QueuedPolicy):
    """Preble's cached-fraction groups with rank-proportional admission."""

    name = "prefix_fair"

    def __init__(self, config: PrefixFairConfig | None = None) -> None:
        self.config = config or PrefixFairConfig()
        super().__init__()
        groups = self.config.num_groups
        self._wait_bound = self.config.group_wait_bound
        # Smooth-WRR credit per group (in rank units).
        self._credit = [0] * groups
        # Consecutive picks each non-empty group has been passed over.
        self._passed = [0] * groups

    def group_of(self, req: EngineRequest, cache: CacheProbe) -> int:
        """Group index (0 = coldest) of ``req`` against the cache as it is now."""
        cached = min(cache.cached_prefix_tokens(req.block_hashes), req.num_tokens)
        return min(cached * self.config.num_groups // req.num_tokens, self.config.num_groups - 1)

    def select(
        self, now: float, max_requests: int, token_budget: int, cache: CacheProbe
    ) -> list[EngineRequest]:
        """Requeued requests first, then picks across groups in proportion to rank."""
        out: list[EngineRequest] = []
        budget = token_budget
        q = self._q
        bs = cache.block_size
        while q.front and len(out) < max_requests and budget > 0:
            req = q.front.popleft()
            out.append(req)
            budget -= tokens_to_prefill(req, cache.cached_prefix_tokens(req.block_hashes), bs)
        if len(out) >= max_requests or budget <= 0 or not q.queue:
            return out
        groups = self._bin(cache)
        while len(out) < max_requests and budget > 0:
            g = self._next_group(groups)
            if g < 0:
                break
            req, new_tokens = groups[g].popleft()
            del q.queue[req.request_id]
            out.append(req)
            budget -= new_tokens
        return out

    def _bin(self, cache: CacheProbe) -> list[deque[tuple[EngineRequest, int]]]:
        """The oldest ``scan_limit`` waiting requests by group, FCFS inside each, with the
        tokens each would prefill now."""
        p = self.config.num_groups
        bs = cache.block_size
        groups: list[deque[tuple[EngineRequest, int]]] = [deque() for _ in range(p)]
        for req in islice(self._q.queue.values(), self.config.scan_limit):
            n = req.num_tokens
            cached = min(cache.cached_prefix_tokens(req.block_hashes), n)
            groups[min(cached * p // n, p - 1)].append((req, tokens_to_prefill(req, cached, bs)))
        return groups

    def _next_group(self, groups: list[deque[tuple[EngineRequest, int]]]) -> int:
        """One smooth-WRR pick over non-empty groups (with the starvation guard); -1 if all
        are empty."""
        credit, passed = self._credit, self._passed
        active: list[int] = []
        for g, members in enumerate(groups):
            if members:
                active.append(g)
            else:
                credit[g] = passed[g] = 0
        if not active:
            return -1
        starved = max(active, key=passed.__getitem__)
        if passed[starved] >= self._wait_bound:
            chosen = starved
        else:
            total = 0
            for g in active:
                credit[g] += g + 1  # rank
                total += g + 1
            # Ties go to the better-cached group.
            chosen = max(active, key=lambda g: (credit[g], g))
            credit[chosen] -= total
        for g in active:
            passed[g] = 0 if g == chosen else passed[g] + 1
        return chosen
