"""E2's hot-prefix replication (Preble's "autoscale a prefix", docs/design.md section 5).

A prefix is hot on a worker when one tree node carries a large share of that worker's
window requests. When such a worker is still overloaded after route-time rebalancing
(its queueing time doubled over the window, or its ``L`` stays well above the cluster
mean), ``tick`` adds another worker to the prefix: the next request under the prefix is
sent there (kind ``replicate``), which makes that worker cache it, and from then on the
prefix's requests split by load cost between its workers (exploit picks the lowest
``L + M + P`` among the workers caching the deepest matched node). When the prefix's
traffic falls, the newest replica is dropped from the prefix in the cache model, so
exploit stops sending it there and the worker's LRU reclaims the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.scheduler.policies.e2_load import WorkerState
from prefixmesh.services.scheduler.prefix_tree import Node, PrefixTree


class Replica:
    """Replication state of one hot prefix (a tree node)."""

    __slots__ = ("pending", "added", "changed", "peak")

    def __init__(self, now: float, demand: int) -> None:
        # Workers chosen to receive the prefix that do not cache it yet.
        self.pending: list[str] = []
        # Workers added by replication, oldest first (shrinking removes the newest).
        self.added: list[str] = []
        self.changed = now
        # Peak window requests under the prefix since the last change.
        self.peak = demand


class Replicator:
    """Registry of replicated prefixes; decisions in ``tick``, lookups on the route path."""

    def __init__(self, cfg: PolicyConfig, tree: PrefixTree) -> None:
        self.cfg = cfg
        self.tree = tree
        self.entries: dict[Node, Replica] = {}
        # Replicas added / removed since start (for metrics and tests).
        self.grown = 0
        self.shrunk = 0

    def lookup(self, node: Node) -> Replica | None:
        """The replication entry of ``node`` or its nearest ancestor, if any."""
        entries = self.entries
        root = self.tree.root
        while node is not root:
            r = entries.get(node)
            if r is not None:
                return r
            node = node.parent  # type: ignore[assignment]
        return None

    def take_pending(self, rep: Replica, eligible: Mapping[str, WorkerState]) -> WorkerState | None:
        """The least loaded pending replica still eligible (it receives the next request)."""
        best = None
        for w in rep.pending:
            ws = eligible.get(w)
            if ws is not None and (best is None or ws.L < best.L):
                best = ws
        return best

    def seeded(self, rep: Replica, worker: str) -> None:
        """``worker`` received a request under the prefix: it now caches it."""
        if worker in rep.pending:
            rep.pending.remove(worker)

    def forget_worker(self, worker: str) -> None:
        """A worker left: drop it from every replica set."""
        for rep in self.entries.values():
            if worker in rep.pending:
                rep.pending.remove(worker)
            if worker in rep.added:
                rep.added.remove(worker)

    # ------------------------------------------------------------------ background decisions

    def hot_prefix(self, ws: WorkerState) -> Node | None:
        """The deepest node ``ws`` caches that carries at least ``replicate_share`` of its
        window requests (and ``replicate_min_requests``): its hot prefix, if any.

        Scans the worker's cached nodes; only called for overloaded workers, off the
        routing path.
        """
        cfg = self.cfg
        need = max(cfg.replicate_min_requests, cfg.replicate_share * ws.n)
        w = ws.id
        best = None
        for n in self.tree.worker_lru(w):
            if n.counts.get(w, 0) >= need and (best is None or n.start > best.start):
                best = n
        return best

    def tick(
        self,
        now: float,
        workers: Mapping[str, WorkerState],
        overloaded: Callable[[WorkerState], bool],
    ) -> None:
        """Grow replica sets of hot prefixes on overloaded workers; shrink cooled ones."""
        cfg = self.cfg
        for node in [n for n in self.entries if not n.alive]:
            del self.entries[node]
        for ws in workers.values():
            if ws.n <= 0 or not overloaded(ws):
                continue
            hot = self.hot_prefix(ws)
            if hot is not None:
                self._grow(hot, now, workers)
        for node, rep in list(self.entries.items()):
            demand = sum(node.counts.values())
            rep.peak = max(rep.peak, demand)
            if now - rep.changed < cfg.replicate_cooldown_s:
                continue
            serving = [workers[w] for w in node.workers if w in workers]
            if any(overloaded(ws) for ws in serving):
                continue
            if demand < cfg.shrink_ratio * rep.peak:
                self._shrink(node, rep, now, demand)

    def _grow(self, node: Node, now: float, workers: Mapping[str, WorkerState]) -> None:
        cfg = self.cfg
        rep = self.entries.get(node)
        if rep is not None and (rep.pending or now - rep.changed < cfg.replicate_cooldown_s):
            return  # the last replica has not taken traffic yet, or too soon
        serving = len(node.workers)
        if cfg.replicate_max_workers and serving >= cfg.replicate_max_workers:
            return
        target = None
        for ws in workers.values():
            if ws.id not in node.workers and (target is None or ws.L < target.L):
                target = ws
        if target is None:
            return
        demand = sum(node.counts.values())
        if rep is None:
            rep = self.entries[node] = Replica(now, demand)
        rep.pending.append(target.id)
        rep.added.append(target.id)
        rep.changed = now
        rep.peak = demand
        self.grown += 1

    def _shrink(self, node: Node, rep: Replica, now: float, demand: int) -> None:
        if not rep.added:
            del self.entries[node]
            return
        w = rep.added.pop()
        if w in rep.pending:
            rep.pending.remove(w)
        elif w in node.workers and len(node.workers) > 1:
            self.tree.drop_subtree(node, w)
        rep.changed = now
        rep.peak = demand
        self.shrunk += 1
        if not rep.added and node in self.entries:
            del self.entries[node]
