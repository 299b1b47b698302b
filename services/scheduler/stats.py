"""The scheduler's periodic summary for the metrics service (pure: no I/O).

Hot prefixes come from the prefix tree's window counts (``Node.counts``: requests routed
through a node in the policy window, per worker). A request increments every node on its
path, so a parent's count is at least the sum over its children: the walk only descends
into nodes that saw traffic, and it reports a node where traffic stops flowing into one
child (no child carries all of it), so a shared system prompt followed by many distinct
user turns is reported once, at the end of the shared part.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from prefixmesh.services.scheduler.policies.base import GlobalPolicy
from prefixmesh.services.scheduler.prefix_tree import Node, PrefixTree
from prefixmesh.shared.wire import HotPrefix, SchedulerStatsEvent

# Hot prefixes in one summary.
HOT_PREFIXES_SHOWN = 10
# Nodes visited per summary at most (bounds the walk on a huge busy tree).
MAX_NODES_VISITED = 50_000


def _total(node: Node) -> int:
    return sum(node.counts.values())


class HotPrefixWalk:
    """The walk behind ``hot_prefixes``, done a slice at a time (``step``): the service
    yields to routing between slices, so a big busy tree never stalls its event loop for
    the whole walk. The tree may change between slices; a node pruned meanwhile is still a
    valid (slightly stale) reading, which is all a periodic summary needs."""

    def __init__(self, tree: PrefixTree, k: int = HOT_PREFIXES_SHOWN,
                 max_visit: int = MAX_NODES_VISITED) -> None:
        self.tree, self.k, self.max_visit = tree, k, max_visit
        # Min-heap of (requests, tokens, tiebreak, node), at most k entries.
        self._found: list[tuple[int, int, int, Node]] = []
        self._stack = [c for c in tree.root.children.values() if c.counts]
        self._visited = 0

    def step(self, nodes: int) -> bool:
        """Visit up to ``nodes`` more nodes; True once the walk is over."""
        found, stack, k = self._found, self._stack, self.k
        stop = min(self._visited + nodes, self.max_visit)
        visited = self._visited
        while stack and visited < stop:
            node = stack.pop()
            visited += 1
            total = _total(node)
            busy = [c for c in node.children.values() if c.counts]
            stack.extend(busy)
            if any(_total(c) >= total for c in busy):
                continue  # all of this node's traffic goes on into one child: report deeper
            item = (total, node.end, visited, node)
            if len(found) < k:
                heapq.heappush(found, item)
            elif item[:2] > found[0][:2]:
                heapq.heapreplace(found, item)
        self._visited = visited
        return not stack or visited >= self.max_visit

    def result(self) -> list[HotPrefix]:
        """The hot prefixes found so far, most requested first."""
        ranked = sorted(self._found, key=lambda t: (t[0], t[1]), reverse=True)
        block = self.tree.block_size
        return [HotPrefix(prefix_id=f"{node.hashes[-1] & 0xFFFFFFFFFFFFFFFF:016x}",
                          tokens=node.end * block, requests=total,
                          workers=sorted(node.workers), requests_by_worker=dict(node.counts))
                for total, _end, _id, node in ranked]


def hot_prefixes(tree: PrefixTree, k: int = HOT_PREFIXES_SHOWN,
                 max_visit: int = MAX_NODES_VISITED) -> list[HotPrefix]:
    """The ``k`` most requested prefixes of the policy window, most requested first."""
    walk = HotPrefixWalk(tree, k, max_visit)
    walk.step(max_visit)
    return walk.result()


def build_stats(scheduler_id: str, policy: GlobalPolicy, decisions: Mapping[str, int],
                ts: float, kv_lag_s: float, kv_gaps: int,
                hot: list[HotPrefix] | None = None) -> SchedulerStatsEvent:
    """A ``SchedulerStatsEvent`` for any policy (tree fields only when it has a tree);
    ``hot``: the hot prefixes when already walked (``HotPrefixWalk``)."""
    summary = policy.summary()
    tree = summary.tree
    return SchedulerStatsEvent(
        scheduler_id=scheduler_id, ts=ts, policy=policy.name, decisions=dict(decisions),
        tree_nodes=len(tree) if tree is not None else 0,
        tree_tokens=tree.tokens if tree is not None else 0,
        workers=len(policy.workers),
        hot_prefixes=hot if hot is not None else hot_prefixes(tree) if tree is not None else [],
        kv_lag_s=kv_lag_s, kv_gaps=kv_gaps, replicas_added=summary.replicas_added,
        replicas_dropped=summary.replicas_dropped)
