"""The global prefix tree: match, split, insert, caching sets, KV events, pruning, budget,
snapshots."""

from __future__ import annotations

import random
from array import array

import msgspec
import pytest

from prefixmesh.services.scheduler import block_index
from prefixmesh.services.scheduler.block_index import GEN_ENTRIES, BlockIndex
from prefixmesh.services.scheduler.prefix_tree import (
    INDEX_QUEUE_HASHES,
    NodeRecord,
    PrefixTree,
)
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes, pack_hashes, unpack_hashes
from tests.helpers import index_table, toks


def chain(*parts: list[int]) -> list[int]:
    """Block hashes of the concatenated token lists."""
    out: list[int] = []
    for p in parts:
        out += p
    return block_hashes(out)


def test_match_empty_tree_and_full_match():
    tree = PrefixTree()
    a = chain(toks(1, 10))
    assert tree.match(a) == (tree.root, 0)
    leaf = tree.insert(a, now=1.0)
    assert len(leaf.hashes) == 10 and leaf.start == 0
    assert tree.match(a) == (leaf, 10)
    assert tree.match(a[:4]) == (leaf, 4)  # ends inside the node
    assert tree.match([]) == (tree.root, 0)


def test_partial_match_at_every_offset():
    tree = PrefixTree()
    shared = toks(1, 12)
    leaf = tree.insert(chain(shared, toks(2, 5)), 0.0)
    for k in range(0, 12):
        other = chain(shared[: k * BLOCK_SIZE], toks(100 + k, 3))
        node, m = tree.match(other)
        assert m == k
        assert node is (tree.root if k == 0 else leaf)


def test_insert_splits_and_keeps_lower_identity():
    tree = PrefixTree()
    shared = toks(1, 4)
    a = chain(shared, toks(2, 6))
    b = chain(shared, toks(3, 2))
    la = tree.insert(a, 1.0)
    tree.touch(la, "w0", 1.0)
    lb = tree.insert(b, 2.0)
    upper = la.parent
    # The old node keeps the deeper part; a new node above it holds the shared blocks.
    assert upper is lb.parent and upper is not tree.root
    assert (upper.start, len(upper.hashes)) == (0, 4)
    assert (la.start, len(la.hashes)) == (4, 6)
    assert (lb.start, len(lb.hashes)) == (4, 2)
    # The split copies caching sets and window counts to the new upper part.
    assert set(upper.workers) == {"w0"} and upper.counts == {"w0": 1}
    assert len(tree) == 3 and tree.n_blocks == 12
    assert tree.match(a) == (la, 10) and tree.match(b) == (lb, 6)
    # A prompt ending at the split point gets that node back, without a new node.
    assert tree.insert(a[:4], 3.0) is upper and len(tree) == 3


def test_insert_ending_inside_a_node_splits_there():
    tree = PrefixTree()
    a = chain(toks(1, 8))
    leaf = tree.insert(a, 0.0)
    head = tree.insert(a[:3], 0.0)
    assert head is leaf.parent and len(head.hashes) == 3 and len(leaf.hashes) == 5


def test_touch_records_worker_counts_and_release_prunes():
    tree = PrefixTree()
    a = chain(toks(1, 4), toks(2, 4))
    b = chain(toks(1, 4), toks(3, 4))
    la = tree.insert(a, 0.0)
    assert tree.touch(la, "w0", 0.0) == 8
    lb = tree.insert(b, 1.0)
    assert tree.touch(lb, "w1", 1.0) == 8
    top = la.parent
    assert set(top.workers) == {"w0", "w1"} and top.counts == {"w0": 1, "w1": 1}
    assert tree.cached_depths(*tree.match(b)) == {"w1": 8, "w0": 4}
    assert tree.cached_tokens("w0") == 8 * BLOCK_SIZE
    # Window expiry alone does not prune: the workers still cache the blocks.
    tree.release(lb, "w1")
    tree.flush()
    assert lb.alive and lb.counts == {} and top.counts == {"w0": 1}
    # Once nobody caches it and no window request used it, it goes.
    tree.drop_subtree(lb, "w1")
    tree.flush()
    assert not lb.alive and tree.match(b) == (top, 4)
    assert tree.node_of(b[-1]) is None and tree.node_of(a[-1]) is la


def test_unused_nodes_are_pruned_with_their_ancestors():
    tree = PrefixTree()
    a = chain(toks(1, 5))
    leaf = tree.insert(a, 0.0)
    tree.touch(leaf, "w0", 0.0)
    tree.release(leaf, "w0")
    tree.flush()
    assert leaf.alive  # still cached
    tree.clear_worker("w0")
    tree.flush()
    assert not leaf.alive and len(tree) == 0 and tree.n_blocks == 0


def test_block_stored_confirms_inserts_and_rejects_orphans():
    tree = PrefixTree()
    a = chain(toks(1, 6))
    # A chain from the root, as a worker reports it without any routing decision.
    assert tree.store("w0", None, a[:4], 0.0)
    node, m = tree.match(a)
    assert m == 4 and set(node.workers) == {"w0"}
    # Its continuation, placed through the parent hash.
    assert tree.store("w0", a[3], a[4:], 1.0)
    node, m = tree.match(a)
    assert m == 6 and set(node.workers) == {"w0"}
    # Another worker stores only the first 2 blocks: the node splits where its copy ends.
    assert tree.store("w1", None, a[:2], 2.0)
    assert tree.cached_depths(*tree.match(a)) == {"w0": 6, "w1": 2}
    # Unknown parent: cannot be placed.
    assert not tree.store("w0", 12345, [777, 778], 3.0)
    assert tree.orphan_stores == 1


def test_block_removed_drops_the_suffix_and_descendants():
    tree = PrefixTree()
    base = toks(1, 6)
    a = chain(base, toks(2, 3))
    b = chain(base, toks(3, 3))
    for h in (a, b):
        tree.touch(tree.insert(h, 0.0), "w0", 0.0)
        tree.touch(tree.insert(h, 0.0), "w1", 0.0)
    # w0 loses block 4 of the shared part: blocks 4.. and both branches are unusable.
    tree.remove_blocks("w0", [a[4]])
    assert tree.cached_depths(*tree.match(a)) == {"w0": 4, "w1": 9}
    assert tree.cached_depths(*tree.match(b)) == {"w0": 4, "w1": 9}
    assert tree.cached_tokens("w0") == 4 * BLOCK_SIZE
    # Removing an unknown or uncached hash is harmless.
    tree.remove_blocks("w0", [a[8], 999])
    assert tree.cached_tokens("w0") == 4 * BLOCK_SIZE


@pytest.mark.parametrize("packed", [False, True], ids=["ints", "packed"])
def test_block_removed_runs_shuffles_and_spans_drop_what_one_at_a_time_would(
        packed: bool) -> None:
    """An event's hashes in a node's order (runs), shuffled, spanning nodes, unknown ones
    mixed in: the worker keeps what removing them one event each would leave; with runs
    held as ints, or as int64 arrays (prompts routed off the wire, hashes packed)."""
    rng = random.Random(5)
    base = toks(1, 6)
    prompts = [chain(base, toks(10 + i, 4), toks(20 + i % 3, 3)) for i in range(6)]
    routed = [unpack_hashes(pack_hashes(h)) for h in prompts] if packed else prompts
    for trial in range(40):
        tree = PrefixTree()
        for i, h in enumerate(routed):
            tree.touch(tree.insert(h, float(i)), "w0", float(i))
            tree.touch(tree.insert(h, float(i)), "w1", float(i))
        assert all(isinstance(n.hashes, array) == packed for n in tree.nodes())
        ref = PrefixTree()
        ref.restore(tree.snapshot())
        p = rng.choice(prompts)
        a = rng.randrange(len(p))
        named = p[a : a + rng.randrange(1, len(p) - a + 1)]  # a run, maybe across nodes
        if trial % 2:
            named = rng.sample(named, len(named)) + [999]  # shuffled, one unknown
        tree.remove_blocks("w0", named)
        for h in named:
            ref.remove_blocks("w0", [h])
        assert [tree.cached_depths(*tree.match(q)) for q in prompts] == [
            ref.cached_depths(*ref.match(q)) for q in prompts]
        held = (len(base) // BLOCK_SIZE + 7 * len(prompts)) * BLOCK_SIZE  # 48 blocks each
        assert tree.cached_tokens("w0") == ref.cached_tokens("w0") < held
        assert tree.cached_tokens("w1") == held


def test_packed_runs_are_written_as_bytes_and_load_back() -> None:
    """Runs that came packed (int64 arrays) are recorded as their bytes, fewer than the
    ints' msgpack, and load back as the same arrays beside runs held as ints; a record
    whose bytes are not whole int64s is dropped with its subtree, the rest kept."""
    tree = PrefixTree()
    base = toks(1, 6)
    a = chain(base, toks(2, 5))
    b = chain(base, toks(3, 5))
    tree.touch(tree.insert(unpack_hashes(pack_hashes(a)), 1.0), "w0", 1.0)
    tree.touch(tree.insert(b, 2.0), "w1", 2.0)  # the shared part splits: an array
    kinds = sorted((n.start, type(n.hashes).__name__) for n in tree.nodes())
    assert kinds == [(0, "array"), (6, "array"), (6, "tuple")]
    records = [tree.node_record(n, 0.0) for n in tree.nodes()]
    decoded = [msgspec.msgpack.decode(r, type=NodeRecord) for r in records]
    for n, rec in zip(tree.nodes(), decoded):
        if isinstance(n.hashes, array):
            assert rec.hashes == pack_hashes(n.hashes)
            plain = msgspec.msgpack.encode(msgspec.structs.replace(rec, hashes=tuple(n.hashes)))
            assert len(tree.node_record(n, 0.0)) < len(plain)
        else:
            assert rec.hashes == n.hashes
    copy = PrefixTree()
    copy.load_records(records, 0.0)
    assert sorted((n.start, type(n.hashes).__name__, list(n.hashes)) for n in copy.nodes()) == \
        sorted((n.start, type(n.hashes).__name__, list(n.hashes)) for n in tree.nodes())
    assert copy.cached_depths(*copy.match(a)) == {"w0": 11, "w1": 6}
    assert copy.cached_depths(*copy.match(b)) == {"w0": 6, "w1": 11}
    # The branch of ``a`` with three bytes cut off its packed run: dropped, the rest kept.
    broken = [msgspec.msgpack.encode(msgspec.structs.replace(r, hashes=r.hashes[:-3]))
              if isinstance(r.hashes, bytes) and r.start == 6 else
              msgspec.msgpack.encode(r) for r in decoded]
    part = PrefixTree()
    part.load_records(broken, 0.0)
    assert part.cached_depths(*part.match(a)) == {"w0": 6, "w1": 6}
    assert part.cached_depths(*part.match(b)) == {"w0": 6, "w1": 11}


def test_worker_lru_evicts_descendants_first_and_respects_protect():
    tree = PrefixTree()
    base = toks(1, 4)
    old = tree.insert(chain(base, toks(2, 2)), 0.0)
    tree.touch(old, "w0", 0.0)
    new = tree.insert(chain(base, toks(3, 2)), 1.0)
    tree.touch(new, "w0", 1.0)
    order = list(tree.worker_lru("w0"))
    assert order == [old, new, new.parent]  # the shared parent is most recent
    assert tree.evict_lru("w0", 1) == 2  # the least recent leaf goes whole
    assert "w0" not in old.workers and "w0" in new.workers
    assert tree.evict_lru("w0", 100, protect=new) == 0  # the protected path stays
    assert tree.cached_tokens("w0") == 6 * BLOCK_SIZE


def test_budget_bounds_memory_under_unique_prompts():
    tree = PrefixTree(max_nodes=64, max_tokens=64 * 4 * BLOCK_SIZE)
    hard = 64 + 64 // 8
    for i in range(2_000):
        leaf = tree.insert(chain(toks(i, 4)), float(i))
        tree.touch(leaf, "w0", float(i))
        assert len(tree) <= hard
        if i % 10 == 0:
            tree.maintain()
            assert len(tree) <= 64 and tree.n_blocks <= 64 * 4
    # The most recent prompts survive, the oldest are gone.
    assert tree.match(chain(toks(1_999, 4)))[1] == 4
    assert tree.match(chain(toks(0, 4)))[1] == 0
    assert tree.budget_evictions > 0
    assert tree.cached_tokens("w0") == tree.n_blocks * BLOCK_SIZE


def test_snapshot_restore_round_trip():
    tree = PrefixTree()
    base = toks(1, 5)
    prompts = [chain(base, toks(i, 3)) for i in range(2, 6)]
    for i, h in enumerate(prompts):
        tree.touch(tree.insert(h, float(i)), f"w{i % 2}", float(i))
    tree.remove_blocks("w1", [prompts[1][6]])
    data = tree.snapshot()
    assert isinstance(data, bytes)
    copy = PrefixTree()
    copy.restore(data)
    assert len(copy) == len(tree) and copy.n_blocks == tree.n_blocks
    for h in prompts:
        (n1, m1), (n2, m2) = tree.match(h), copy.match(h)
        assert m1 == m2 and set(n1.workers) == set(n2.workers) and n1.counts == n2.counts
        assert n1.last_access == n2.last_access
        assert tree.cached_depths(n1, m1) == copy.cached_depths(n2, m2)
    for w in ("w0", "w1"):
        assert copy.cached_tokens(w) == tree.cached_tokens(w)
        order = [(n.start, n.hashes) for n in tree.worker_lru(w)]
        assert [(n.start, n.hashes) for n in copy.worker_lru(w)] == order
    # The hash index works after a restore (KV events).
    assert copy.node_of(prompts[0][-1]) is copy.match(prompts[0])[0]


def test_index_updates_are_applied_a_few_at_a_time_not_all_at_the_next_tick() -> None:
    """Routing inserts nodes without anyone calling maintain(): the queue of index updates
    never grows past its limit, and every inserted block is found."""
    tree = PrefixTree()
    inserted = []
    for seed in range(5 * INDEX_QUEUE_HASHES // 48):
        hashes = toks(1000 + seed, 3)  # 48 ids, taken as 48 hashes
        tree.insert(hashes, now=0.0)
        inserted.append(hashes[-1])
        assert sum(len(n.hashes) for n in tree._index_q) < INDEX_QUEUE_HASHES
    assert all(tree.node_of(h) is not None for h in inserted)


class _Held:
    def __init__(self, hashes: list[int]) -> None:
        self.hashes = tuple(hashes)
        self.alive = True


@pytest.mark.parametrize("kind", ["c", "dict"])
def test_block_index_finds_the_newest_live_holder_and_trims_old_generations(kind: str) -> None:
    index: BlockIndex[_Held] = BlockIndex(index_table(kind))
    hashes = [0, 1, -1, -(2**63), 2**63 - 1, 12345678901234]
    a = _Held(hashes)
    index.put(a.hashes, a)
    assert all(index.get(h) is a for h in hashes) and len(index) == len(hashes)
    b = _Held(hashes[:2])  # split off: b now holds the first two, a the rest
    a.hashes = tuple(hashes[2:])
    index.put(b.hashes, b)
    assert index.get(0) is b and index.get(-1) is a and index.get(999) is None
    b.alive = False  # dropped: its entries stay, a lookup no longer finds it
    assert index.get(0) is None and index.get(1) is None and index.get(-1) is a
    # Fill past several generations with nodes that die; trimming to what is held keeps
    # the live ones (re-put from the oldest generation) and at most twice them plus one
    # generation of entries.
    dead = []
    for i in range(3 * GEN_ENTRIES // 8):
        n = _Held(list(range(10**9 + 8 * i, 10**9 + 8 * i + 8)))
        index.put(n.hashes, n)
        dead.append(n)
    assert len(index.gens) >= 3
    for n in dead[1:]:
        n.alive = False
    step = 8192
    for _ in range(4 * GEN_ENTRIES // step):  # one step a call
        index.trim(held=len(a.hashes) + 8, step=step)
    assert len(index.gens) <= 2 and len(index) <= 2 * (len(a.hashes) + 8) + GEN_ENTRIES
    assert index.get(-1) is a and index.get(10**9) is dead[0] and index.get(10**9 + 8) is None


def test_index_follows_the_tree_under_churn() -> None:
    """Under the budget's steady eviction (routing adds prompts, the oldest go), the index
    finds every block the tree holds, in the node holding it, and none it dropped."""
    tree = PrefixTree(max_nodes=40, max_tokens=40 * 6 * BLOCK_SIZE)
    shared = toks(7, 4)
    prompts = []
    for i in range(600):
        h = chain(shared, toks(i, 2 + i % 3))
        prompts.append(h)
        tree.touch(tree.insert(h, float(i)), f"w{i % 3}", float(i))
        if i % 25 == 0:
            tree.maintain()
    tree.maintain()
    held = {h: n for n in tree.nodes() for h in n.hashes}
    assert 0 < len(held) < sum(map(len, prompts))  # some were evicted
    assert len(tree._index) >= len(held)
    assert all(tree.node_of(h) is n for h, n in held.items())
    gone = {h for p in prompts for h in p} - held.keys()
    assert gone and all(tree.node_of(h) is None for h in gone)


def test_routing_alone_keeps_the_index_within_its_bound_a_little_at_a_time() -> None:
    """Routing's own index flushes (no ``maintain``) retire old generations as fast as
    new entries fill them, each flush doing a small step: the index stays within twice
    what the tree holds plus two generations, and every held block is found."""
    tree = PrefixTree(max_nodes=1_000, max_tokens=1_000 * 24 * BLOCK_SIZE)
    shared = chain(toks(7, 4))
    biggest = 0
    for i in range(6 * GEN_ENTRIES // 24):  # six generations of unique 24-block tails
        hashes = [*shared, *range(10**12 + 24 * i, 10**12 + 24 * (i + 1))]
        node, m = tree.match(hashes)
        tree.record(node, m, hashes, f"w{i % 4}", float(i))
        biggest = max(biggest, len(tree._index) - 2 * tree.n_blocks)
    assert len(tree._index.gens) > 1  # trimming ran
    assert biggest <= 2 * GEN_ENTRIES
    held = {h: n for n in tree.nodes() for h in n.hashes}
    assert all(tree.node_of(h) is n for h, n in held.items())


def test_only_nodes_handed_to_a_writer_are_reported_gone() -> None:
    """A pruned node's id goes to ``take_changes``'s gone list (to be deleted from the
    store) only if an earlier hand-over may have had it written; one made and pruned
    between two hand-overs was never written, and deleting it would be wasted work."""
    tree = PrefixTree()
    tree.track_changes()
    old = tree.insert(toks(1, 2), 0.0)
    tree.touch(old, "w0", 0.0, count=False)
    nodes, _ = tree.take_changes()
    assert old in nodes
    new = tree.insert(toks(2, 2), 1.0)
    tree.touch(new, "w0", 1.0, count=False)
    tree.clear_worker("w0")  # both lose their only cacher: pruned at the flush
    nodes, gone = tree.take_changes()
    assert not old.alive and not new.alive
    assert gone == [old.nid] and new not in nodes


def _lru_state(tree: PrefixTree) -> list:
    """Every node (run, caching stamps, counts, last access, id) and every worker's LRU
    order and block count: what a recorded decision changes."""
    nodes = [(n.nid, n.start, n.hashes, dict(n.workers), dict(n.counts), n.last_access)
             for n in tree.nodes()]
    lru = {w: [n.nid for n in tree.worker_lru(w)] for w in sorted(tree.worker_blocks)}
    return [sorted(nodes), lru, dict(tree.worker_blocks), tree.n_nodes, tree.n_blocks]


def test_record_path_records_what_record_of_the_matched_slice_records():
    """``record_path`` (a peer's decision on the matched path) = ``record`` of
    ``hashes[:m]``, whether the match ends at a node's end or inside it (a split)."""
    shared, doc = toks(1, 6), toks(2, 8)
    for cut in (8, 5):  # at the end of the document's node, then inside it
        prompt = chain(shared, doc[: cut * BLOCK_SIZE], toks(3, 2))
        trees = []
        for fast in (False, True):
            tree = PrefixTree()
            tree.touch(tree.insert(chain(shared, doc), 0.5), "a", 0.5)
            tree.touch(tree.insert(chain(shared, toks(4, 3)), 0.6), "b", 0.6)
            node, m = tree.match(prompt)
            assert m == 6 + cut and m < len(prompt)
            if fast:
                leaf = tree.record_path(node, m, "b", 1.0)
            else:
                leaf = tree.record(node, m, prompt[:m], "b", 1.0)
            assert leaf.end == m
            trees.append(_lru_state(tree))
        assert trees[0] == trees[1]


class _SortingTree(PrefixTree):
    """Least recently used leaves found by sorting every leaf by last access before each
    drop (a drop can make its parent the least recent leaf): the order the lazy heap of
    ``PrefixTree`` must reproduce."""

    def _evict_lru_leaves(self, keep) -> int:
        dropped = 0
        while self.n_nodes > self.max_nodes or self.n_blocks > self.max_blocks:
            leaves = sorted((n for n in self.nodes() if not n.children and n is not keep
                             and n is not self.root), key=lambda n: n.last_access)
            if not leaves:
                break
            parent = leaves[0].parent
            self._detach(leaves[0])
            self._prune_up(parent)
            dropped += 1
        self.budget_evictions += dropped
        return dropped


def _paths(tree: PrefixTree) -> set[tuple[int, ...]]:
    return {(n.start, *n.hashes) for n in tree.nodes() if n is not tree.root}


def test_budget_evicts_the_leaves_a_full_sort_would():
    """Shared prefixes, repeats (touched again, so later in line), splits, a restore and a
    smaller budget: the tree that keeps its leaves' order lazily never exceeds its budget
    and holds exactly the nodes of one that sorts every leaf by last access."""
    import random

    rng = random.Random(7)
    heap_tree = PrefixTree(max_nodes=48, max_tokens=48 * 6 * BLOCK_SIZE)
    sort_tree = _SortingTree(max_nodes=48, max_tokens=48 * 6 * BLOCK_SIZE)
    heads = [toks(1000 + i, rng.randint(1, 3)) for i in range(12)]
    for i in range(3_000):
        now = float(i)
        head = heads[rng.randrange(len(heads))]
        tail = toks(rng.randrange(400), rng.randint(1, 3))  # repeats come back
        hashes = chain(head, tail)
        for tree in (heap_tree, sort_tree):
            node, m = tree.match(hashes)
            leaf = tree.record(node, m, hashes, f"w{i % 3}", now)
            assert leaf.last_access == now
        assert len(heap_tree) <= 48
        if i % 7 == 0:
            assert _paths(heap_tree) == _paths(sort_tree), i
        if i == 1_500:  # a restored tree, cut to a smaller budget, goes on in the same order
            before = heap_tree.budget_evictions  # a restore counts from 0
            heap_tree.restore(heap_tree.snapshot())
            for tree in (heap_tree, sort_tree):
                tree.set_budget(40, 40 * 6 * BLOCK_SIZE)
                tree.maintain()
                tree.set_budget(48, 48 * 6 * BLOCK_SIZE)
            assert len(heap_tree) <= 40
    assert before + heap_tree.budget_evictions == sort_tree.budget_evictions > 1_000
    assert len(heap_tree._lru) <= 2 * len(heap_tree) + 4096


def test_index_churn_benchmark_runs_and_refuses_bad_sizes(capsys) -> None:
    from prefixmesh.loadgen import index_churn

    assert index_churn.slowest_insert(4, held=2_000, batch=10, rounds=50, seed=1) > 0
    assert index_churn.main(["--shards", "1,4", "--held", "500", "--batch", "5",
                             "--rounds", "20"]) == 0
    assert index_churn.slowest_insert_generations(held=2_000, batch=10, rounds=50,
                                                  seed=1) > 0
    lines = capsys.readouterr().out.splitlines()
    tables = ["generations"] * (1 if block_index.HashTable is block_index.DictTable else 2)
    assert [ln.split()[0] for ln in lines] == ["1", "4", *tables]
    assert all("ms" in ln for ln in lines)
    for bad in (["--shards", "0"], ["--shards", "a,b"], ["--batch", "0"]):
        with pytest.raises(SystemExit) as exc:
            index_churn.main(bad)
        assert exc.value.code == 2
