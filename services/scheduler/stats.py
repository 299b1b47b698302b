"""The scheduler's periodic summary for the metrics service (pure: no I/O).

Hot prefixes come from the prefix tree's window counts (``Node.counts``: requests routed
through a node in the policy window, per worker). A request increments every node on its
path, so a parent's count is at least the sum over its children: the walk only descends
into nodes that saw traffic, and it reports a node where traffic stops flowing into one
child (no child carries all of it), so a shared system prompt followed by many distinct
user turns is reported once, at the end of the shared part.

The walk is best-first: the busiest node not visited yet comes next, so nodes come in
order of falling traffic, and once ``k`` nodes are reported, a node with less traffic than
all of them (and its subtree: no child has more) ends the walk. On a big busy tree it
visits the hot part only (the whole tree, once a second, was a fifth of a busy
scheduler's CPU).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

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
    valid (slightly stale) reading, which is all a periodic summary needs.

    Of a node's children only its ``k`` busiest go on the frontier: each child's traffic
    reaches a reported node with all of it (where it first splits, or a leaf), so a child
    with less than ``k`` of its siblings can never rank in the top ``k``. A shared system
    prompt followed by 100,000 distinct user turns costs a scan of its children, not a heap
    of all of them."""

    def __init__(self, tree: PrefixTree, k: int = HOT_PREFIXES_SHOWN,
                 max_visit: int = MAX_NODES_VISITED) -> None:
        self.tree, self.k, self.max_visit = tree, k, max_visit
        # Min-heap of (requests, tokens, tiebreak, node), at most k entries.
        self._found: list[tuple[int, int, int, Node]] = []
        # Max-heap of the nodes to visit: (-requests, tiebreak, node).
        self._frontier: list[tuple[int, int, Node]] = []
        # The node whose children are being looked at (a node with thousands of them takes
        # several slices): the node, its requests (-1: the root, never reported), its
        # children left to look at, and the busiest of those looked at so far, as a
        # min-heap of at most k (requests, tiebreak, child).
        self._expanding: tuple[Node, int, Iterator[Node], list[tuple[int, int, Node]]] | None
        self._expanding = (tree.root, -1, iter(list(tree.root.children.values())), [])
        self._pushed = 0
        self._visited = 0

    def step(self, nodes: int) -> bool:
        """Look at up to about ``nodes`` more nodes; True once the walk is over."""
        found, frontier, k = self._found, self._frontier, self.k
        work = 0
        while work < nodes:
            if self._expanding is not None:
                node, total, children, top = self._expanding
                for c in children:
                    work += 1
                    if c.counts:
                        t = _total(c)
                        if len(top) < k:
                            self._pushed += 1
                            heapq.heappush(top, (t, self._pushed, c))
                        elif t > top[0][0]:
                            self._pushed += 1
                            heapq.heapreplace(top, (t, self._pushed, c))
                    if work >= nodes:
                        return False
                self._expanding = None
                for t, tie, c in top:
                    heapq.heappush(frontier, (-t, tie, c))
                # All of this node's traffic going on into one child: report deeper.
                busiest = max(top)[0] if top else -1
                if busiest < total:
                    item = (total, node.end, self._visited, node)
                    if len(found) < k:
                        heapq.heappush(found, item)
                    elif item[:2] > found[0][:2]:
                        heapq.heapreplace(found, item)
                continue
            if not frontier or self._visited >= self.max_visit:
                return True
            total = -frontier[0][0]
            if len(found) == k and total < found[0][0]:
                frontier.clear()  # below all k found, as is everything under it
                return True
            node = heapq.heappop(frontier)[2]
            self._visited += 1
            work += 1
            self._expanding = (node, total, iter(list(node.children.values())), [])
        return False

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
    while not walk.step(max_visit):
        pass
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
