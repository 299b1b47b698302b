"""Cache-aware baseline policies, as their projects ship them (docs/design.md section 5).

- ``cache_aware`` (SGLang router): load guard first, then the longest cached match.
- ``kv_cost`` (NVIDIA Dynamo KV router): prefill blocks not cached + active blocks, argmin.
- ``weighted`` (llm-d inference scheduler): weighted prefix / queue / KV-free scorers, argmax.

Each keeps its own approximate view of the workers' caches in a ``PrefixTree``: SGLang and
llm-d record their routing decisions (LRU-trimmed per worker); Dynamo consumes the
workers' KV events.
"""

from __future__ import annotations

import math
import random

from prefixmesh.services.scheduler.policies.base import (
    Decision,
    PolicyConfig,
    RouteInput,
)
from prefixmesh.services.scheduler.policies.tracking import BaselinePolicy
from prefixmesh.services.scheduler.prefix_tree import Node
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.wire import KvEvent

# Scores closer than this are ties (broken at random, as the peers do).
_TIE_EPS = 1e-9


class _TreeBaseline(BaselinePolicy):
    """A baseline with an approximate prefix tree and seeded random tie-breaks."""

    uses_tree = True

    def __init__(self, config: PolicyConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self.rng = random.Random(config.seed)

    def depths(self, req: RouteInput) -> tuple[Node, int, dict[str, int]]:
        """Matched node, matched blocks, and blocks of the prompt each worker holds."""
        node, m = self.tree.match(req.block_hashes)
        return node, m, (self.tree.cached_depths(node, m) if m else {})

    def remember(
        self, req: RouteInput, worker: str, node: Node, m: int, now: float, limit: int
    ) -> None:
        """Record the routed prompt on ``worker``'s approximate tree, LRU-trimmed to
        ``limit`` tokens."""
        tree = self.tree
        leaf = tree.extend(node, m, req.block_hashes, now)
        tree.touch(leaf, worker, now, count=False)
        over = tree.worker_blocks[worker] - limit // self.block
        if over > 0:
            tree.evict_lru(worker, over, protect=leaf)

    def remember_limit(self, worker: str) -> int | None:
        """Tokens of ``worker``'s cache view kept from decisions (None: the view comes from
        KV events, decisions add nothing to it)."""
        return self._capacity[worker]

    def remember_remote(self, req: RouteInput, worker: str, now: float) -> None:
        """Another replica's decision enters the cache view as this replica's own would."""
        limit = self.remember_limit(worker)
        if limit is not None:
            node, m = self.tree.match(req.block_hashes)
            self.remember(req, worker, node, m, now, limit)

    def pick(self, scored: list[tuple[float, str]], lowest: bool) -> str:
        """Best score (lowest or highest); ties at random with the seeded generator."""
        best = min(s for s, _ in scored) if lowest else max(s for s, _ in scored)
        ties = [w for s, w in scored if abs(s - best) <= _TIE_EPS]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)


class CacheAwarePolicy(_TreeBaseline):
    """SGLang router: if ``max_load - min_load > abs`` and ``max_load > rel * min_load``, the
    least loaded worker; elif the best match ratio > threshold, the worker with the longest
    match; else the least loaded. Load = its own outstanding requests."""

    name = "cache_aware"

    def remember_limit(self, worker: str) -> int:
        """SGLang trims each worker's approximate tree to one size, whatever its cache."""
        return self.cfg.ca_max_tree_tokens

    def route(self, req: RouteInput, now: float) -> Decision:
        """SGLang's cache_aware rule."""
        self.clock(now)
        cfg = self.cfg
        ws = self.eligible(req)
        count = self.out.count
        loads = {w: count.get(w, 0) for w in ws}
        hi, lo = max(loads.values()), min(loads.values())
        node, m, depths = self.depths(req)
        least = min(ws, key=loads.__getitem__)
        w = least
        if not (hi - lo > cfg.ca_balance_abs and hi > cfg.ca_balance_rel * lo):
            best = max((depths.get(x, 0) for x in ws), default=0)
            if best and best * self.block / max(req.prompt_tokens, 1) > cfg.ca_cache_threshold:
                # Several workers may hold the longest match: the least loaded of them.
                w = min((x for x in ws if depths.get(x, 0) == best), key=loads.__getitem__)
        self.remember(req, w, node, m, now, self.remember_limit(w))
        self.assigned(req, w, now)
        return Decision(w, self.name, min(depths.get(w, 0) * self.block, req.prompt_tokens))


class KvCostPolicy(_TreeBaseline):
    """Dynamo KV router: ``cost = overlap_weight * (prefill blocks not cached) + active
    decode blocks``; argmin, ties at random. Its cache index comes from KV events."""

    name = "kv_cost"

    def remember_limit(self, worker: str) -> int | None:
        """Dynamo's index comes from KV events; decisions stand in only without them."""
        return None if self.cfg.kv_use_events else self._capacity[worker]

    def on_kv_events(self, worker_id: str, events: list[KvEvent], now: float) -> None:
        """Dynamo's indexer: stored blocks add, removed blocks drop, cleared resets."""
        self.clock(now)
        if not self.cfg.kv_use_events or worker_id not in self._capacity:
            return
        self.tree.apply_events(worker_id, events, now)

    def route(self, req: RouteInput, now: float) -> Decision:
        """Argmin of the Dynamo cost over eligible workers."""
        self.clock(now)
        ws = self.eligible(req)
        node, m, depths = self.depths(req)
        req_blocks = max(math.ceil(req.prompt_tokens / self.block), len(req.block_hashes))
        active = self.out.blocks
        weight = self.cfg.kv_overlap_weight
        scored = [
            (weight * (req_blocks - depths.get(w, 0)) + active.get(w, 0), w) for w in ws
        ]
        w = self.pick(scored, lowest=True)
        limit = self.remember_limit(w)
        if limit is not None:  # approximate mode: routing decisions stand in
            self.remember(req, w, node, m, now, limit)
        self.assigned(req, w, now)
        return Decision(w, self.name, min(depths.get(w, 0) * self.block, req.prompt_tokens))


class WeightedPolicy(_TreeBaseline):
    """llm-d scorers: ``3 * prefix_match_fraction + 2 * queue_score + 2 * kv_free_fraction``,
    each in [0, 1]; argmax, ties at random.

    Prefix: blocks of the prompt on the worker's approximate cache (routing decisions,
    LRU-trimmed to its KV capacity) / prompt blocks. Queue: min-max normalised waiting
    requests from the latest load report (own outstanding count before any report), 1 for
    the shortest. KV free: free / total blocks from the latest report.
    """

    name = "weighted"

    def route(self, req: RouteInput, now: float) -> Decision:
        """Argmax of the weighted score over eligible workers."""
        self.clock(now)
        cfg = self.cfg
        ws = self.eligible(req)
        node, m, depths = self.depths(req)
        n_blocks = len(req.block_hashes)
        reports = self.reports
        count = self.out.count
        queue: dict[str, int] = {}
        free: dict[str, float] = {}
        for w in ws:
            r = reports.get(w)
            if r is None:
                queue[w] = count.get(w, 0)
                free[w] = 1.0
            else:
                queue[w] = r.waiting
                free[w] = r.free_blocks / r.total_blocks if r.total_blocks > 0 else 1.0
        q_hi, q_lo = max(queue.values()), min(queue.values())
        span = q_hi - q_lo
        scored = []
        for w in ws:
            prefix = depths.get(w, 0) / n_blocks if n_blocks else 0.0
            q_score = (q_hi - queue[w]) / span if span else 1.0
            score = cfg.weighted_prefix * prefix + cfg.weighted_queue * q_score
            scored.append((score + cfg.weighted_kv * min(max(free[w], 0.0), 1.0), w))
        w = self.pick(scored, lowest=False)
        self.remember(req, w, node, m, now, self._capacity[w])
        self.assigned(req, w, now)
        return Decision(w, self.name, min(depths.get(w, 0) * self.block, req.prompt_tokens))
