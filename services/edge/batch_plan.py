"""Offline batch planning (BatchLLM; docs/batch.md "Planner"): pure logic, no I/O.

Given every prompt of a batch up front (token ids), the planner

1. builds a compact prefix tree (radix tree) over the whole batch (``PrefixTree``);
2. turns it into *first-level* prefix groups: every prompt belongs to exactly one group,
   whose shared prefix is computed once, and each member computes only its distinct rest.
   The naive first level takes the root's children (``naive_groups``). MaximizeReuse
   (``enlarged_groups``) first rewrites the tree bottom-up, subtrees before their root:
   at each node, a child ``c`` and one of its children ``g`` are forked and merged into a
   new child of ``tokens(c) + tokens(g)`` tokens when
   ``(leaves(g) - 1) * tokens(g) > tokens(c)`` (``g``'s tokens computed once instead of
   once per leaf, at the price of ``c``'s computed once more). Each node's rewrite uses
   its children's results (a dynamic programme over the tree), so a prefix shared deep
   down reaches the first level even under a short shared node;
3. orders groups by ``1 / (L_prefix + sum L_distinct)``, largest first (docs/design.md
   section 6);
4. places groups on workers so total estimated GPU work (E2's cost model, ``PT`` and the
   marginal decode cost ``DT``) is balanced, one group per worker unless a group alone is
   more than a worker's fair share, in which case it is split and each part recomputes
   the prefix (``place_groups``).

The multi-level tree (``PrefixTree.node_tokens``: every node computed once) is the
upper bound on sharing; ``saving_ratio`` compares plans against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixmesh.shared.costmodel import CostModel

# Output tokens assumed for a request whose max_tokens is unknown (tokens).
DEFAULT_OUTPUT_TOKENS = 16
# A group is split across workers only when its cost exceeds this multiple of a worker's
# fair share (total cost / workers): keeping a group whole saves prefix recomputation.
SPLIT_FACTOR = 1.0
# Batch size assumed for the marginal decode cost DT (sequences decoding together).
DECODE_BATCH = 32


@dataclass(slots=True)
class _Node:
    """A radix-tree node: the edge ``tokens`` leading to it, prompts ending here."""

    tokens: list[int]
    children: dict[int, _Node] = field(default_factory=dict)
    # Indices of prompts that end exactly at this node.
    ends: list[int] = field(default_factory=list)
    # Prompts in this subtree (ends here and below).
    leaves: int = 0


class PrefixTree:
    """A compact prefix tree over token-id prompts (edges split on partial matches)."""

    def __init__(self, prompts: Sequence[Sequence[int]]) -> None:
        self.root = _Node([])
        self.lengths = [len(p) for p in prompts]
        for i, p in enumerate(prompts):
            self._insert(i, p)

    def _insert(self, index: int, prompt: Sequence[int]) -> None:
        node = self.root
        node.leaves += 1
        pos = 0
        n = len(prompt)
        while pos < n:
            child = node.children.get(prompt[pos])
            if child is None:
                leaf = _Node(list(prompt[pos:]), ends=[index], leaves=1)
                node.children[prompt[pos]] = leaf
                return
            edge = child.tokens
            k = _common(edge, prompt, pos)
            if k < len(edge):  # partial match: split the edge at k
                lower = _Node(edge[k:], child.children, child.ends, child.leaves)
                child.tokens = edge[:k]
                child.children = {edge[k]: lower}
                child.ends = []
            child.leaves += 1
            node = child
            pos += k
        node.ends.append(index)

    @property
    def total_tokens(self) -> int:
        """Prompt tokens of the whole batch with no sharing at all."""
        return sum(self.lengths)

    def node_tokens(self) -> int:
        """Tokens computed with full multi-level sharing (every tree node once)."""
        total, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            total += len(node.tokens)
            stack.extend(node.children.values())
        return total


def _common(edge: list[int], prompt: Sequence[int], pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``prompt[pos:]``."""
    n = min(len(edge), len(prompt) - pos)
    if list(prompt[pos:pos + n]) == edge[:n]:
        return n
    k = 0
    while k < n and edge[k] == prompt[pos + k]:
        k += 1
    return k


@dataclass(slots=True)
class PrefixGroup:
    """Prompts (batch line indices) that share their first ``prefix_len`` tokens."""

    prefix_len: int
    members: list[int]

    def tokens(self, lengths: Sequence[int]) -> int:
        """L_prefix + sum L_distinct: prompt tokens the group computes."""
        return self.prefix_len + sum(lengths[i] - self.prefix_len for i in self.members)


def _group(prefix_len: int, members: list[int]) -> PrefixGroup:
    # A lone prompt shares nothing: its "prefix" is part of its distinct tokens.
    return PrefixGroup(prefix_len if len(members) > 1 else 0, sorted(members))


def naive_groups(tree: PrefixTree) -> list[PrefixGroup]:
    """First-level groups without MaximizeReuse: one per child of the root."""
    return _first_level(_copy(tree.root)[0])


def enlarged_groups(tree: PrefixTree) -> list[PrefixGroup]:
    """First-level groups after MaximizeReuse (docs/batch.md, planner step 2): the tree
    rewritten bottom-up by fork-and-merge (``_maximize_reuse``), then one group per
    child of the root."""
    nodes = _copy(tree.root)
    _maximize_reuse(nodes)
    return _first_level(nodes[0])


@dataclass(slots=True)
class _Reuse:
    """A node of the tree MaximizeReuse rewrites: ``tokens`` prefix tokens on its edge.
    Unlike ``_Node`` two children may start with the same token (a fork's copy and the
    node it was forked from), so children are a list."""

    tokens: int
    children: list[_Reuse]
    ends: list[int]
    leaves: int


def _copy(root: _Node) -> list[_Reuse]:
    """The tree under ``root`` as ``_Reuse`` nodes, parents before children (the first
    is the root). Iterative: a batch's tree can be deeper than the recursion limit
    (prompts that are prefixes of one another)."""
    top = _Reuse(0, [], list(root.ends), root.leaves)
    pairs = [(root, top)]
    for node, copy in pairs:  # the list grows while it is walked: breadth first
        for child in node.children.values():
            c = _Reuse(len(child.tokens), [], list(child.ends), child.leaves)
            copy.children.append(c)
            pairs.append((child, c))
    return [copy for _, copy in pairs]


def _maximize_reuse(nodes: list[_Reuse]) -> None:
    """MaximizeReuse in place over ``nodes`` (parents before children, as ``_copy``).

    Nodes are visited bottom-up, every subtree before its root (docs/design.md section 6).
    At a node ``n``, for each child ``c`` and each child ``g`` of ``c``: when
    ``(leaves(g) - 1) * tokens(g) > tokens(c)``, ``c`` is forked and its copy merged
    with ``g`` into a new child of ``n`` of ``tokens(c) + tokens(g)`` tokens holding
    ``g``'s children and prompts; ``g``'s tokens are then shared by its ``leaves(g)``
    prompts instead of computed by each, at the price of ``c``'s computed once more. A
    ``c`` left with no prompt below it is dropped; one left with a single continuation
    merges into it (a compact tree keeps no such node). At the root this decides the
    first-level prefixes; below it, it lifts deep shared prefixes a level at a time, so a
    short shared node (a one-token branch under a long instruction) cannot hide the long
    documents below it.
    """
    for n in reversed(nodes):
        kept: list[_Reuse] = []
        for c in n.children:
            stay: list[_Reuse] = []
            for g in c.children:
                if (g.leaves - 1) * g.tokens > c.tokens:  # fork c, merge the copy with g
                    kept.append(_Reuse(c.tokens + g.tokens, g.children, g.ends, g.leaves))
                    c.leaves -= g.leaves
                else:
                    stay.append(g)
            c.children = stay
            while not c.ends and len(c.children) == 1:
                (only,) = c.children
                c.tokens += only.tokens
                c.children, c.ends = only.children, only.ends
            if c.leaves:
                kept.append(c)
        n.children = kept


def _first_level(root: _Reuse) -> list[PrefixGroup]:
    """One group per child of ``root`` (its tokens shared by every prompt below it), and
    one for prompts ending at the root (empty ones)."""
    groups = []
    for child in root.children:
        members, stack = [], [child]
        while stack:
            node = stack.pop()
            members.extend(node.ends)
            stack.extend(node.children)
        groups.append(_group(child.tokens, members))
    if root.ends:
        groups.append(PrefixGroup(0, sorted(root.ends)))
    return groups


def computed_tokens(groups: Sequence[PrefixGroup], lengths: Sequence[int]) -> int:
    """Prompt tokens a plan computes: each group's prefix once plus every distinct part."""
    return sum(g.tokens(lengths) for g in groups)


def saving_ratio(computed: int, total: int) -> float:
    """Share of prompt tokens not computed thanks to sharing (BatchLLM's token saving)."""
    return 1.0 - computed / total if total else 0.0


def order_groups(groups: Sequence[PrefixGroup], lengths: Sequence[int]) -> list[PrefixGroup]:
    """Largest ``1 / (L_prefix + sum L_distinct)`` first, i.e. fewest group tokens first;
    ties keep the input order."""
    return sorted(groups, key=lambda g: g.tokens(lengths))


# --------------------------------------------------------------------------- placement

GroupCost = Callable[[PrefixGroup], float]


def cost_function(cost: CostModel, lengths: Sequence[int],
                  outputs: Sequence[int]) -> GroupCost:
    """E2's GPU-time estimate of a group (seconds): ``PT(prefix)`` once, then each member's
    ``PT(distinct | prefix cached)`` plus its outputs at the marginal decode cost ``DT``."""
    def group_cost(g: PrefixGroup) -> float:
        total = cost.prefill_time(g.prefix_len)
        for i in g.members:
            total += cost.prefill_time(lengths[i] - g.prefix_len, g.prefix_len)
            total += outputs[i] * cost.marginal_decode_time(lengths[i], DECODE_BATCH)
        return total
    return group_cost


@dataclass(slots=True)
class Placement:
    """Groups per worker, each worker's list in run order, with its estimated work."""

    groups: dict[str, list[PrefixGroup]]
    # Estimated GPU seconds per worker.
    work_s: dict[str, float]

    def worker_of(self) -> dict[int, str]:
        """Batch line index -> worker."""
        return {i: w for w, gs in self.groups.items() for g in gs for i in g.members}

    @property
    def imbalance(self) -> float:
        """Heaviest worker's work over the mean (1.0 = perfect balance)."""
        if not self.work_s:
            return 1.0
        mean = sum(self.work_s.values()) / len(self.work_s)
        return max(self.work_s.values()) / mean if mean else 1.0


def split_group(g: PrefixGroup, parts: int) -> list[PrefixGroup]:
    """``g`` cut into ``parts`` groups of near-equal size, each keeping the prefix."""
    parts = max(1, min(parts, len(g.members)))
    size = math.ceil(len(g.members) / parts)
    return [PrefixGroup(g.prefix_len if len(g.members[k:k + size]) > 1 else 0,
                        g.members[k:k + size]) for k in range(0, len(g.members), size)]


def place_groups(groups: Sequence[PrefixGroup], workers: Sequence[str],
                 group_cost: GroupCost, lengths: Sequence[int]) -> Placement:
    """Longest-processing-time-first placement of groups on the least-loaded worker; a
    group costing more than ``SPLIT_FACTOR`` fair shares is split first. Each worker's
    groups are then put in ``order_groups`` order."""
    if not workers:
        raise ValueError("no workers to place batch groups on")
    costs = [(group_cost(g), g) for g in groups]
    fair = sum(c for c, _ in costs) / len(workers)
    pieces: list[tuple[float, PrefixGroup]] = []
    for c, g in costs:
        if fair > 0 and c > SPLIT_FACTOR * fair and len(g.members) > 1:
            for part in split_group(g, math.ceil(c / fair)):
                pieces.append((group_cost(part), part))
        else:
            pieces.append((c, g))
    pieces.sort(key=lambda t: -t[0])
    work = dict.fromkeys(workers, 0.0)
    placed: dict[str, list[PrefixGroup]] = {w: [] for w in workers}
    for c, g in pieces:
        w = min(workers, key=lambda x: (work[x], x))
        work[w] += c
        placed[w].append(g)
    return Placement({w: order_groups(gs, lengths) for w, gs in placed.items()}, work)


# --------------------------------------------------------------------------- whole plan


@dataclass(slots=True)
class BatchPlan:
    """What the planner decided for one batch."""

    placement: Placement
    total_tokens: int
    # Prompt tokens computed under each sharing scheme.
    naive_tokens: int
    enlarged_tokens: int
    multilevel_tokens: int

    def summary(self) -> dict[str, float]:
        """Token-saving ratios and balance, for logs, metrics and results."""
        t = self.total_tokens
        return {
            "prompt_tokens": t,
            "saving_naive_first_level": saving_ratio(self.naive_tokens, t),
            "saving_enlarged_first_level": saving_ratio(self.enlarged_tokens, t),
            "saving_multi_level": saving_ratio(self.multilevel_tokens, t),
            "imbalance": self.placement.imbalance,
        }

    def run_order(self) -> list[tuple[str, int]]:
        """(worker, line index) in submission order: group by group on each worker,
        workers interleaved group-wise so every worker starts at once."""
        per_worker = [[(w, i) for g in gs for i in g.members]
                      for w, gs in self.placement.groups.items()]
        out: list[tuple[str, int]] = []
        longest = max((len(x) for x in per_worker), default=0)
        for k in range(longest):
            out.extend(x[k] for x in per_worker if k < len(x))
        return out


def plan_batch(prompts: Sequence[Sequence[int]], outputs: Sequence[int],
               workers: Sequence[str], cost: CostModel) -> BatchPlan:
    """Prefix tree -> enlarged first-level groups -> balanced placement on ``workers``."""
    tree = PrefixTree(prompts)
    lengths = tree.lengths
    naive = naive_groups(tree)
    enlarged = enlarged_groups(tree)
    placement = place_groups(enlarged, workers, cost_function(cost, lengths, outputs), lengths)
    return BatchPlan(placement=placement, total_tokens=tree.total_tokens,
                     naive_tokens=computed_tokens(naive, lengths),
                     enlarged_tokens=computed_tokens(enlarged, lengths),
                     multilevel_tokens=tree.node_tokens())
