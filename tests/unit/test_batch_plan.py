"""The offline batch planner (docs/batch.md): prefix tree, MaximizeReuse, groups, placement."""

from __future__ import annotations

import random

import pytest

from prefixmesh.services.edge.batch_plan import (
    PrefixGroup,
    PrefixTree,
    computed_tokens,
    cost_function,
    enlarged_groups,
    naive_groups,
    order_groups,
    place_groups,
    plan_batch,
    saving_ratio,
    split_group,
)
from prefixmesh.shared.costmodel import CostModel
from tests.helpers import span as seq

# Figure 4 of BatchLLM, reconstructed (the paper draws the tree, not its token counts): six
# prompts under one short shared system prompt S (4 tokens); three ask about document D1
# (10 tokens), two about D2 (10 tokens), one is unrelated; questions are 2 tokens.
S, D1, D2, X = seq(1000, 4), seq(2000, 10), seq(3000, 10), seq(4000, 6)
FIG4 = [S + D1 + seq(100, 2), S + D1 + seq(110, 2), S + D1 + seq(120, 2),
        S + D2 + seq(130, 2), S + D2 + seq(140, 2), S + X]


def members(groups: list[PrefixGroup]) -> list[tuple[int, list[int]]]:
    return sorted((g.prefix_len, g.members) for g in groups)


def test_tree_counts_multi_level_tokens() -> None:
    tree = PrefixTree(FIG4)
    assert tree.total_tokens == 3 * 16 + 2 * 16 + 10 == 90
    # S + D1 + 3 questions + D2 + 2 questions + X: every node once.
    assert tree.node_tokens() == 4 + 10 + 6 + 10 + 4 + 6 == 40
    (first,) = tree.root.children.values()
    assert first.tokens == S and first.leaves == 6


def test_figure4_naive_first_level_shares_only_the_system_prompt() -> None:
    tree = PrefixTree(FIG4)
    groups = naive_groups(tree)
    assert members(groups) == [(4, [0, 1, 2, 3, 4, 5])]
    assert computed_tokens(groups, tree.lengths) == 4 + 3 * 12 + 2 * 12 + 6 == 70


def test_figure4_enlarged_first_level_forks_both_documents() -> None:
    tree = PrefixTree(FIG4)
    groups = enlarged_groups(tree)
    # D1: (3-1)*10 = 20 > 4 and D2: (2-1)*10 = 10 > 4 fork S; X (one leaf) stays, and
    # alone it shares nothing.
    assert members(groups) == [(0, [5]), (14, [0, 1, 2]), (14, [3, 4])]
    enlarged = computed_tokens(groups, tree.lengths)
    assert enlarged == (14 + 3 * 2) + (14 + 2 * 2) + 10 == 48
    naive = computed_tokens(naive_groups(tree), tree.lengths)
    total, multi = tree.total_tokens, tree.node_tokens()
    # The enlarged first level saves more than the naive one and approaches the full tree.
    assert saving_ratio(naive, total) == pytest.approx(20 / 90)
    assert saving_ratio(enlarged, total) == pytest.approx(42 / 90)
    assert saving_ratio(multi, total) == pytest.approx(50 / 90)
    assert saving_ratio(naive, total) < saving_ratio(enlarged, total) <= saving_ratio(multi, total)


def test_fork_only_pays_when_the_grandchild_outweighs_the_prefix() -> None:
    big_s = seq(1000, 30)  # (3-1)*10 = 20 < 30: recomputing S would cost more than it saves
    prompts = [big_s + D1 + seq(100 + 10 * k, 2) for k in range(3)] + [big_s + X]
    tree = PrefixTree(prompts)
    assert members(enlarged_groups(tree)) == [(30, [0, 1, 2, 3])]
    assert members(enlarged_groups(tree)) == members(naive_groups(tree))


def test_deep_nodes_are_lifted_bottom_up() -> None:
    # S -> D1 -> {E (8 tokens) -> 2 questions, 2 other questions}. Under S, E is weighed
    # against D1: (2-1)*8 = 8 < 10, so E stays below D1; at the root D1 is lifted over S
    # ((4-1)*10 = 30 > 4) with E inside its group.
    e = seq(5000, 8)
    prompts = [S + D1 + e + seq(100, 2), S + D1 + e + seq(110, 2),
               S + D1 + seq(120, 2), S + D1 + seq(130, 2), S + X]
    groups = enlarged_groups(PrefixTree(prompts))
    assert members(groups) == [(0, [4]), (14, [0, 1, 2, 3])]
    # A long E (20 tokens: 20 > 10) is first forked under S into D1+E, and at the root
    # both D1 and D1+E are lifted over S: three groups, the deepest sharing 34 tokens.
    e = seq(5000, 20)
    prompts[:2] = [S + D1 + e + seq(100, 2), S + D1 + e + seq(110, 2)]
    groups = enlarged_groups(PrefixTree(prompts))
    assert members(groups) == [(0, [4]), (14, [2, 3]), (34, [0, 1])]


def _instruction_documents_questions() -> list[list[int]]:
    """A 50-token instruction; six 2,000-token documents, three starting with one token and
    three with another; four 2-token questions on each (24 prompts of 2,052 tokens)."""
    instruction = seq(1, 50)
    docs = [[7 if d < 3 else 8] + seq(10_000 * (d + 1), 1999) for d in range(6)]
    return [instruction + doc + seq(100_000 + 10 * (4 * d + q), 2)
            for d, doc in enumerate(docs) for q in range(4)]


def test_a_short_shared_node_does_not_hide_the_documents_below_it() -> None:
    prompts = _instruction_documents_questions()
    tree = PrefixTree(prompts)
    total = tree.total_tokens
    assert total == 24 * 2052
    # Naive first level: only the instruction is shared (the first-token branches under
    # it are one token long, so a top-down pass stops there too).
    naive = computed_tokens(naive_groups(tree), tree.lengths)
    assert naive == 50 + 24 * 2002
    assert saving_ratio(naive, total) == pytest.approx(0.023, abs=5e-4)
    # Bottom-up: each document is lifted over its one-token branch (3 * 1999 > 1), then
    # over the instruction (3 * 2000 > 50): six groups of instruction + document.
    groups = enlarged_groups(tree)
    assert members(groups) == [(2050, [4 * d + q for q in range(4)]) for d in range(6)]
    enlarged = computed_tokens(groups, tree.lengths)
    assert enlarged == 6 * 2050 + 24 * 2
    multi = tree.node_tokens()
    assert multi == 50 + 2 + 6 * 1999 + 24 * 2
    assert saving_ratio(enlarged, total) == pytest.approx(0.749, abs=5e-4)
    assert saving_ratio(multi, total) == pytest.approx(0.754, abs=5e-4)
    assert saving_ratio(multi, total) - saving_ratio(enlarged, total) < 0.02


def test_deep_chains_do_not_recurse() -> None:
    # Every prompt a prefix of the next: a chain deeper than Python's recursion limit.
    prompts = [seq(1, n) for n in range(1, 1201)]
    tree = PrefixTree(prompts)
    groups = enlarged_groups(tree)
    assert sorted(i for g in groups for i in g.members) == list(range(1200))
    assert tree.node_tokens() <= computed_tokens(groups, tree.lengths) < tree.total_tokens


def test_prompts_that_are_prefixes_of_others_and_duplicates() -> None:
    prompts = [S + D1, S + D1, S + D1 + seq(100, 3), seq(9000, 5)]
    tree = PrefixTree(prompts)
    groups = enlarged_groups(tree)
    assert sorted(i for g in groups for i in g.members) == [0, 1, 2, 3]
    assert tree.node_tokens() == 14 + 3 + 5
    assert computed_tokens(groups, tree.lengths) >= tree.node_tokens()


def test_every_prompt_in_exactly_one_group_on_random_batches() -> None:
    rng = random.Random(7)
    docs = [seq(10_000 * (d + 1), rng.randint(5, 60)) for d in range(6)]
    prompts = [rng.choice([[], S]) + rng.choice(docs) + seq(rng.randint(0, 500), rng.randint(1, 9))
               for _ in range(200)]
    tree = PrefixTree(prompts)
    lengths = tree.lengths
    for groups in (naive_groups(tree), enlarged_groups(tree)):
        assert sorted(i for g in groups for i in g.members) == list(range(200))
        for g in groups:  # the prefix really is shared by every member
            if len(g.members) > 1:
                ref = prompts[g.members[0]][:g.prefix_len]
                assert all(prompts[i][:g.prefix_len] == ref for i in g.members)
    multi, enl, naive = (tree.node_tokens(), computed_tokens(enlarged_groups(tree), lengths),
                         computed_tokens(naive_groups(tree), lengths))
    assert multi <= enl <= naive <= tree.total_tokens


def test_group_order_smallest_total_first() -> None:
    lengths = [100, 100, 100, 50, 10]
    groups = [PrefixGroup(80, [0, 1, 2]), PrefixGroup(0, [3]), PrefixGroup(0, [4])]
    # totals: 80 + 3*20 = 140, 50, 10 -> largest 1/(L_prefix + sum L_distinct) first
    assert [g.members for g in order_groups(groups, lengths)] == [[4], [3], [0, 1, 2]]


def test_placement_balances_work_and_keeps_groups_whole() -> None:
    cost = CostModel.load("mistral-7b-a6000")
    rng = random.Random(3)
    prompts = [seq(10_000 * (d + 1), 2000) + seq(rng.randint(0, 10**5), 30)
               for d in range(12) for _ in range(rng.randint(4, 16))]
    outputs = [20] * len(prompts)
    plan = plan_batch(prompts, outputs, ["w0", "w1", "w2", "w3"], cost)
    assert plan.placement.imbalance < 1.25
    where = plan.placement.worker_of()
    assert sorted(where) == list(range(len(prompts)))
    for d in range(12):  # each document's group lives on one worker
        idx = [i for i, p in enumerate(prompts) if p[0] == 10_000 * (d + 1)]
        assert len({where[i] for i in idx}) == 1
    order = plan.run_order()
    assert sorted(i for _, i in order) == list(range(len(prompts)))
    assert {w for w, _ in order[:4]} == {"w0", "w1", "w2", "w3"}  # every worker starts at once
    s = plan.summary()
    assert s["saving_naive_first_level"] <= s["saving_enlarged_first_level"]
    assert s["saving_enlarged_first_level"] <= s["saving_multi_level"]


def test_a_group_larger_than_a_fair_share_is_split() -> None:
    cost = CostModel.load("mistral-7b-a6000")
    prompts = [seq(1, 3000) + [50_000 + i] * 8 for i in range(40)] + [seq(90_000, 100)]
    lengths = [len(p) for p in prompts]
    groups = enlarged_groups(PrefixTree(prompts))
    fn = cost_function(cost, lengths, [10] * len(prompts))
    placement = place_groups(groups, ["a", "b", "c", "d"], fn, lengths)
    big = [g for gs in placement.groups.values() for g in gs if g.prefix_len == 3000]
    assert len(big) > 1 and sum(len(g.members) for g in big) == 40
    assert len({w for w, gs in placement.groups.items() for g in gs if g.prefix_len}) > 1
    assert placement.imbalance < 1.5


def test_split_group_keeps_the_prefix() -> None:
    parts = split_group(PrefixGroup(10, list(range(7))), 3)
    assert [p.members for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [p.prefix_len for p in parts] == [10, 10, 0]


def test_no_workers_is_an_error() -> None:
    with pytest.raises(ValueError):
        place_groups([PrefixGroup(0, [0])], [], lambda g: 1.0, [1])
