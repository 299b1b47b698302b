"""Property-based tests (hypothesis): random operation sequences against simple reference
models, for the scheduler's prefix tree, the worker's block cache, the translation of
vLLM's KV events into prefixmesh's and the batch planner's prefix groups.

Each machine keeps its own model of what must be true (which worker caches which blocks,
which physical blocks running requests hold, which vLLM blocks are alive) and checks the
code under test against it after every step.
"""

from __future__ import annotations

import hashlib
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from prefixmesh.services.edge.batch_plan import PrefixTree as BatchTree
from prefixmesh.services.edge.batch_plan import (
    computed_tokens,
    enlarged_groups,
    naive_groups,
)
from prefixmesh.services.scheduler.prefix_tree import PrefixTree
from prefixmesh.services.worker.engine.block_cache import BlockCache
from prefixmesh.services.worker.engine.vllm_events import (
    BlockTranslator,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
)
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes
from prefixmesh.shared.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from tests.helpers import replay_kv_events, span, toks

# Fast: small universes, modest example counts, no example database on disk.
MACHINE = settings(max_examples=100, stateful_step_count=30, deadline=None, database=None)
PROPERTY = settings(max_examples=100, deadline=None, database=None)


def _leading(hashes: list[int], cached: set[int] | dict[int, object]) -> int:
    """How many leading ``hashes`` are in ``cached``."""
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- prefix tree

# Prompts sharing prefixes of different lengths (and one that shares nothing).
_BASE = toks(1, 6)
TREE_PROMPTS = [
    _BASE,
    _BASE[: 2 * BLOCK_SIZE] + toks(2, 4),
    _BASE[: 4 * BLOCK_SIZE] + toks(3, 3),
    toks(4, 5),
    _BASE[: 2 * BLOCK_SIZE] + toks(2, 1) + toks(5, 2),
]
TREE_CHAINS = [block_hashes(p) for p in TREE_PROMPTS]
# Every block hash -> the chain from the root up to and including it.
CHAIN_OF = {h: c[: i + 1] for c in TREE_CHAINS for i, h in enumerate(c)}
FOREIGN = block_hashes(toks(99, 2))  # never in the tree
TREE_WORKERS = st.sampled_from(["a", "b", "c"])
CHAIN = st.integers(0, len(TREE_CHAINS) - 1)
DEPTH = st.integers(1, max(len(c) for c in TREE_CHAINS))


class PrefixTreeMachine(RuleBasedStateMachine):
    """KV events (store / remove / clear) and routing decisions per worker; the model is
    the set of block hashes each worker caches (always prefix-closed)."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = PrefixTree()
        self.model: dict[str, set[int]] = {}
        self.now = 0.0
        # (leaf, worker) of routing decisions whose window counts are still held.
        self.routed: list[tuple[object, str]] = []

    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    @rule(w=TREE_WORKERS, c=CHAIN, k=DEPTH, j=DEPTH)
    def store(self, w: str, c: int, k: int, j: int) -> None:
        """BlockStored of blocks [j, k) of a chain, continuing block j - 1 (or the root)."""
        chain = TREE_CHAINS[c]
        k = min(k, len(chain))
        j = min(j, k) - 1  # the first stored block, in [0, k)
        parent = chain[j - 1] if j else None
        parent_known = parent is None or any(parent in m for m in self.model.values())
        placed = self.tree.store(w, parent, chain[j:k], self._tick())
        if parent_known:
            assert placed, "a chain continuing a cached block must be placed"
        if placed:
            self.model.setdefault(w, set()).update(chain[:k])

    @rule(w=TREE_WORKERS, c=CHAIN, picks=st.lists(st.integers(0, 6), max_size=3),
          foreign=st.booleans())
    def remove(self, w: str, c: int, picks: list[int], foreign: bool) -> None:
        """BlockRemoved: the worker loses these blocks and every later block of theirs."""
        chain = TREE_CHAINS[c]
        gone = [chain[i] for i in picks if i < len(chain)] + (FOREIGN if foreign else [])
        self.tree.remove_blocks(w, gone)
        if w in self.model:
            self.model[w] = {h for h in self.model[w]
                             if not any(g in CHAIN_OF[h] for g in gone)}

    @rule(w=TREE_WORKERS)
    def clear(self, w: str) -> None:
        """AllBlocksCleared."""
        self.tree.clear_worker(w)
        if w in self.model:
            self.model[w] = set()

    @rule(w=TREE_WORKERS, c=CHAIN, k=DEPTH)
    def route(self, w: str, c: int, k: int) -> None:
        """A routing decision: the prompt's path is recorded for the worker."""
        chain = TREE_CHAINS[c][:k]
        node, matched = self.tree.match(chain)
        leaf = self.tree.record(node, matched, chain, w, self._tick())
        self.routed.append((leaf, w))
        self.model.setdefault(w, set()).update(chain)

    @precondition(lambda self: self.routed)
    @rule(i=st.integers(0, 100))
    def expire(self, i: int) -> None:
        """Window expiry of one routing decision: counts only, caching is unchanged."""
        leaf, w = self.routed.pop(i % len(self.routed))
        self.tree.release(leaf, w)  # type: ignore[arg-type]

    @rule(w=TREE_WORKERS, blocks=st.integers(1, 8))
    def evict(self, w: str, blocks: int) -> None:
        """The model of the worker's own LRU eviction: it frees at least ``blocks`` blocks
        (or all it has) and what is left is still a prefix-closed part of what it held."""
        before = self.model.get(w, set())
        freed = self.tree.evict_lru(w, blocks)
        after = {h for n in self.tree.worker_lru(w) for h in n.hashes}
        assert after <= before and freed == len(before) - len(after)
        assert freed >= blocks or not after
        assert all(set(CHAIN_OF[h]) <= after for h in after)
        if w in self.model:
            self.model[w] = after

    @rule()
    def maintain(self) -> None:
        self.tree.maintain()

    @rule()
    def snapshot_and_restore(self) -> None:
        """Continue on a tree restored from a snapshot."""
        restored = PrefixTree()
        restored.restore(self.tree.snapshot())
        self.tree = restored
        self.routed.clear()  # leaves of the old tree

    @invariant()
    def each_worker_caches_what_the_model_says(self) -> None:
        for w, expected in self.model.items():
            nodes = list(self.tree.worker_lru(w))
            held = [h for n in nodes for h in n.hashes]
            assert len(held) == len(set(held))
            assert set(held) == expected
            assert self.tree.worker_blocks.get(w, 0) == len(expected)
            assert self.tree.cached_tokens(w) == len(expected) * BLOCK_SIZE
            position = {id(n): i for i, n in enumerate(nodes)}
            for i, n in enumerate(nodes):
                assert n.alive and w in n.workers
                # Prefix-closed, and an ancestor sits after its descendants in the LRU.
                assert n.parent is self.tree.root or position[id(n.parent)] > i

    @invariant()
    def matches_stay_inside_the_prompt_and_report_the_model(self) -> None:
        for chain in TREE_CHAINS:
            for prompt in (chain, chain[:2], chain[:3] + FOREIGN):
                node, matched = self.tree.match(prompt)
                assert 0 <= matched <= len(prompt)
                depths = self.tree.cached_depths(node, matched)
                expected = {w: _leading(prompt, m) for w, m in self.model.items()}
                assert depths == {w: d for w, d in expected.items() if d}


TestPrefixTreeProperties = PrefixTreeMachine.TestCase
TestPrefixTreeProperties.settings = MACHINE


def test_a_split_keeps_every_ancestor_after_its_descendants_in_the_lru() -> None:
    chain = TREE_CHAINS[0][:3]
    tree = PrefixTree()
    tree.record(*tree.match(chain), chain, "a", 1.0)  # one node of 3 blocks
    tree.record(*tree.match(chain[:1]), chain[:1], "a", 2.0)  # split after block 0
    tree.store("b", None, chain[:2], 3.0)  # split after block 1, a node whose parent a holds
    nodes = list(tree.worker_lru("a"))
    position = {id(n): i for i, n in enumerate(nodes)}
    assert all(n.parent is tree.root or position[id(n.parent)] > i
               for i, n in enumerate(nodes))
    tree.evict_lru("a", 2)
    # What a still caches must be a prefix: never a block without the blocks before it.
    assert tree.cached_depths(*tree.match(chain)).get("a", 0) == _leading(
        chain, {h for n in tree.worker_lru("a") for h in n.hashes})


# --------------------------------------------------------------------------- block cache

CACHE_BS = 4
CACHE_BLOCKS = 10  # few enough that admissions fail and cached blocks get evicted
CACHE_PROMPTS = [
    span(0, 16),
    span(0, 8) + span(100, 8),
    span(0, 12) + span(200, 4),
    span(300, 12),
    span(0, 4),
    span(400, 24),
]
CACHE_CHAINS = [block_hashes(p, block_size=CACHE_BS) for p in CACHE_PROMPTS]
CACHE_TOKENS = {h: tuple(p[i * CACHE_BS:(i + 1) * CACHE_BS])
                for p, c in zip(CACHE_PROMPTS, CACHE_CHAINS, strict=True)
                for i, h in enumerate(c)}


class BlockCacheMachine(RuleBasedStateMachine):
    """Requests admitted (reusing cached prefixes or not), raw allocations, frees, resets;
    the model is the block tables running requests hold."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = BlockCache(num_blocks=CACHE_BLOCKS, block_size=CACHE_BS)
        # Running requests: (block table, the prompt's hashes or None for raw blocks).
        self.held: list[tuple[list[int], list[int] | None]] = []
        self.events: list[KvEvent] = []

    @rule(p=st.integers(0, len(CACHE_PROMPTS) - 1), reuse=st.booleans())
    def admit(self, p: int, reuse: bool) -> None:
        """A prompt is admitted and computed: its cached prefix reused (or, as two requests
        admitted in one step, computed again), the rest allocated and stored."""
        tokens, hashes = CACHE_PROMPTS[p], CACHE_CHAINS[p]
        hits = self.cache.match_prefix(hashes, len(hashes)) if reuse else []
        free_before = self.cache.num_free
        new = self.cache.acquire(hits, len(hashes) - len(hits))
        if new is None:
            reusable = sum(self.cache.ref_count(b) == 0 for b in hits)
            assert len(hashes) - len(hits) > free_before - reusable
            assert self.cache.num_free == free_before  # all or nothing
            return
        table = hits + new
        first = len(hits)
        if first < len(hashes):
            self.cache.store(table, first, hashes[first:], hashes[first - 1] if first else None,
                             tokens[first * CACHE_BS:])
        self.held.append((table, hashes))

    @rule(n=st.integers(1, 4))
    def allocate_raw(self, n: int) -> None:
        """Blocks a request writes but never caches (a partial block, say)."""
        free_before = self.cache.num_free
        table = self.cache.allocate(n)
        if table is None:
            assert n > free_before and self.cache.num_free == free_before
            return
        assert len(table) == n == len(set(table))
        self.held.append((table, None))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        table, _ = self.held.pop(i % len(self.held))
        self.cache.free(table)

    @rule()
    def take_events(self) -> None:
        self.events += self.cache.take_events()

    @rule()
    def reset(self) -> None:
        if self.held:
            try:
                self.cache.reset()
            except RuntimeError:
                return
            raise AssertionError("reset() while blocks are referenced")
        self.cache.reset()
        assert self.cache.num_cached == 0 and self.cache.num_free == CACHE_BLOCKS

    @invariant()
    def references_are_the_running_tables(self) -> None:
        refs = Counter(b for table, _ in self.held for b in table)
        assert [self.cache.ref_count(b) for b in range(CACHE_BLOCKS)] == [
            refs[b] for b in range(CACHE_BLOCKS)]
        assert 0 <= self.cache.num_free == CACHE_BLOCKS - len(refs) <= CACHE_BLOCKS

    @invariant()
    def running_prompts_stay_cached(self) -> None:
        for table, hashes in self.held:
            if hashes is not None:
                assert [self.cache.block_hash(b) for b in table] == hashes
            else:
                assert all(self.cache.block_hash(b) is None for b in table)

    @invariant()
    def the_cache_is_prefix_closed_and_probes_agree(self) -> None:
        cached = set(self.cache.cached_hashes())
        assert len(cached) == self.cache.num_cached
        for hashes in CACHE_CHAINS:
            ids = self.cache.match_prefix(hashes, len(hashes))
            assert [self.cache.block_hash(b) for b in ids] == hashes[:len(ids)]
            assert set(hashes) & cached == set(hashes[:len(ids)])  # prefix-closed
            assert self.cache.cached_prefix_tokens(hashes) == len(ids) * CACHE_BS

    @invariant()
    def events_describe_the_cache(self) -> None:
        self.events += self.cache.take_events()
        live = replay_kv_events(self.events)  # parents first, removals of cached blocks only
        assert set(live) == set(self.cache.cached_hashes())
        assert all(tokens == CACHE_TOKENS[h] for h, (_, tokens) in live.items())
        assert replay_kv_events(self.cache.snapshot_events()) == live


TestBlockCacheProperties = BlockCacheMachine.TestCase
TestBlockCacheProperties.settings = MACHINE


# --------------------------------------------------------------------------- vLLM KV events

# Token sequences sharing prefixes; 96 tokens split into whole vLLM blocks of every size.
VLLM_SEQS = [span(0, 96), span(0, 48) + span(1000, 48), span(0, 24) + span(2000, 72),
             span(3000, 96)]
VLLM_BLOCK_SIZES = [8, 16, 24, 32]


def vllm_hash(seq: list[int], i: int, vbs: int) -> bytes:
    """vLLM's hash of block ``i``: like its sha256 one, a function of the whole prefix."""
    return hashlib.sha256(repr((vbs, seq[:(i + 1) * vbs])).encode()).digest()


def pm_span(i: int, n: int, vbs: int) -> range:
    """Indices of the prefixmesh blocks that end inside vLLM blocks ``i .. i + n - 1``."""
    return range((i * vbs) // BLOCK_SIZE, ((i + n) * vbs) // BLOCK_SIZE)


class TranslatorMachine(RuleBasedStateMachine):
    """vLLM's stores (of new blocks, second physical copies and orphans), evictions
    (leaves first, as vLLM frees tables tail first), unknown removals, skipped media and
    clears; the model is the live count of each vLLM block."""

    @initialize(vbs=st.sampled_from(VLLM_BLOCK_SIZES))
    def start(self, vbs: int) -> None:
        self.vbs = vbs
        self.tr = BlockTranslator()
        self.out: list[KvEvent] = []
        self.live: Counter[bytes] = Counter()
        # vLLM hash -> (sequence, block index), and its parent's hash.
        self.where: dict[bytes, tuple[int, int]] = {}
        self.parent: dict[bytes, bytes | None] = {}
        for s, seq in enumerate(VLLM_SEQS):
            for i in range(len(seq) // vbs):
                h = vllm_hash(seq, i, vbs)
                self.where.setdefault(h, (s, i))
                self.parent[h] = vllm_hash(seq, i - 1, vbs) if i else None

    def _pm(self, s: int) -> list[int]:
        return block_hashes(VLLM_SEQS[s])

    def _translate(self, events: list) -> list[KvEvent]:
        got = self.tr.translate(events)
        self.out += got
        return got

    @rule(s=st.integers(0, len(VLLM_SEQS) - 1), i=st.integers(0, 11), n=st.integers(1, 4))
    def store(self, s: int, i: int, n: int) -> None:
        seq, vbs = VLLM_SEQS[s], self.vbs
        i = min(i, len(seq) // vbs - 1)
        n = min(n, len(seq) // vbs - i)
        hashes = [vllm_hash(seq, k, vbs) for k in range(i, i + n)]
        parent = vllm_hash(seq, i - 1, vbs) if i else None
        orphans = self.tr.orphans
        got = self._translate([VllmBlockStored(hashes, parent, seq[i * vbs:(i + n) * vbs],
                                               vbs)])
        if parent is not None and not self.live[parent]:
            assert got == [] and self.tr.orphans == orphans + 1
            return
        self.live.update(hashes)
        pm = self._pm(s)
        idx = pm_span(i, n, vbs)
        first = (i * vbs) // BLOCK_SIZE
        expected = [BlockStored(block_hashes=[pm[j] for j in idx],
                                parent_block_hash=pm[first - 1] if first else None,
                                token_ids=seq[idx.start * BLOCK_SIZE:idx.stop * BLOCK_SIZE],
                                block_size=BLOCK_SIZE)] if idx else []
        assert got == expected  # re-hashed along the prefixmesh chain of the whole prefix

    @precondition(lambda self: +self.live)
    @rule(k=st.integers(0, 1000))
    def evict_a_leaf(self, k: int) -> None:
        alive = {h for h, n in self.live.items() if n}
        leaves = sorted(h for h in alive if not any(self.parent[c] == h for c in alive))
        h = leaves[k % len(leaves)]
        got = self._translate([VllmBlockRemoved([h])])
        self.live[h] -= 1
        if self.live[h]:
            assert got == []  # another physical copy is still cached
            return
        # Its prefixmesh blocks go, but for those another live vLLM block stands for too
        # (vLLM blocks larger than 16 tokens whose prompts part inside them).
        s, i = self.where[h]
        pm = self._pm(s)
        still = self._live_pm()
        gone = [pm[j] for j in pm_span(i, 1, self.vbs) if pm[j] not in still]
        assert got == ([BlockRemoved(block_hashes=gone)] if gone else [])

    @rule()
    def remove_unknown(self) -> None:
        before = self.tr.unknown_removals
        assert self._translate([VllmBlockRemoved([b"never stored"])]) == []
        assert self.tr.unknown_removals == before + 1

    @rule(s=st.integers(0, len(VLLM_SEQS) - 1),
          kind=st.sampled_from([{"medium": "CPU"}, {"group_idx": 1}, {"lora_id": 3}]))
    def store_elsewhere(self, s: int, kind: dict) -> None:
        """Blocks of another medium, KV-cache group or LoRA adapter: not ours."""
        seq = VLLM_SEQS[s]
        before = self.tr.skipped
        ev = VllmBlockStored([vllm_hash(seq, 0, self.vbs)], None, seq[:self.vbs], self.vbs,
                             **kind)
        assert self._translate([ev]) == [] and self.tr.skipped == before + 1

    @rule()
    def clear(self) -> None:
        assert self._translate([VllmAllBlocksCleared()]) == [AllBlocksCleared()]
        self.live.clear()

    def _live_pm(self) -> set[int]:
        out: set[int] = set()
        for h, n in self.live.items():
            if n:
                s, i = self.where[h]
                pm = self._pm(s)
                out.update(pm[j] for j in pm_span(i, 1, self.vbs))
        return out

    @invariant()
    def translated_events_describe_the_live_blocks(self) -> None:
        if not hasattr(self, "tr"):
            return
        view = replay_kv_events(self.out)  # parents known first, removals of known blocks
        assert set(view) == self._live_pm()
        assert self.tr.num_blocks == len(view)
        assert self.tr.num_vllm_blocks == sum(1 for n in self.live.values() if n)
        assert replay_kv_events(self.tr.snapshot_events()) == view
        for s in range(len(VLLM_SEQS)):
            pm = self._pm(s)
            assert self.tr.cached_prefix_tokens(pm) == _leading(pm, view) * BLOCK_SIZE


TestTranslatorProperties = TranslatorMachine.TestCase
TestTranslatorProperties.settings = MACHINE


@PROPERTY
@given(vbs=st.sampled_from(VLLM_BLOCK_SIZES),
       stores=st.lists(st.tuples(st.integers(0, len(VLLM_SEQS) - 1), st.integers(1, 12)),
                       min_size=1, max_size=6))
def test_stored_then_removed_nets_to_nothing(vbs: int,
                                             stores: list[tuple[int, int]]) -> None:
    """Whole prefixes stored (copies included), then every copy of every block removed
    leaf first: the translator forgets everything, and its events net to nothing."""
    tr = BlockTranslator()
    out: list[KvEvent] = []
    copies: Counter[bytes] = Counter()
    chains: list[list[bytes]] = []
    for s, n in stores:
        seq = VLLM_SEQS[s]
        n = min(n, len(seq) // vbs)
        hashes = [vllm_hash(seq, i, vbs) for i in range(n)]
        out += tr.translate([VllmBlockStored(hashes, None, seq[:n * vbs], vbs)])
        copies.update(hashes)
        chains.append(hashes)
    assert set(replay_kv_events(out)) == {
        h for s, n in stores for h in block_hashes(VLLM_SEQS[s][:min(n, 96 // vbs) * vbs])}
    for hashes in reversed(chains):  # a table is freed tail first, the last one first
        out += tr.translate([VllmBlockRemoved(hashes[::-1])])
    assert replay_kv_events(out) == {}
    assert tr.num_blocks == tr.num_vllm_blocks == 0
    assert tr.snapshot_events() == [AllBlocksCleared()]
    assert tr.orphans == tr.unknown_removals == 0


# --------------------------------------------------------------------------- batch planner

# Prompts over a three-token alphabet, built from a few shared pieces so that batches have
# deep, uneven prefix trees (short shared nodes above long ones, prompts that are prefixes
# of others, duplicates).
_PIECES = [[0], [1], [0, 1, 2] * 3, [2] * 20, [1, 0] * 6, []]


@PROPERTY
@given(st.lists(st.lists(st.integers(0, len(_PIECES) - 1), max_size=6), min_size=1,
                max_size=40))
def test_maximize_reuse_partitions_and_never_loses(choices: list[list[int]]) -> None:
    """Every prompt in exactly one group whose prefix all its members share; the planned
    tokens lie between the multi-level tree's and the naive first level's."""
    prompts = [[t for k in c for t in _PIECES[k]] for c in choices]
    tree = BatchTree(prompts)
    enlarged, naive = enlarged_groups(tree), naive_groups(tree)
    for groups in (enlarged, naive):
        assert sorted(i for g in groups for i in g.members) == list(range(len(prompts)))
        for g in groups:
            assert g.prefix_len == 0 or len(g.members) > 1
            head = prompts[g.members[0]][:g.prefix_len]
            assert len(head) == g.prefix_len
            assert all(prompts[i][:g.prefix_len] == head for i in g.members)
    lengths = tree.lengths
    assert tree.node_tokens() <= computed_tokens(enlarged, lengths)
    assert computed_tokens(enlarged, lengths) <= computed_tokens(naive, lengths)
    assert computed_tokens(naive, lengths) <= tree.total_tokens
