"""Paged KV blocks and the block-hash prefix cache (services/worker/engine/block_cache.py)."""

from __future__ import annotations

import pytest

from prefixmesh.services.worker.engine.block_cache import BlockCache
from prefixmesh.shared.blocks import block_hashes
from prefixmesh.shared.wire import AllBlocksCleared, BlockRemoved, BlockStored
from tests.helpers import replay_kv_events, span

BS = 4  # small blocks keep the token lists short


def _cached_chain(cache: BlockCache, tokens: list[int]) -> list[int]:
    """Allocate, store and return the block table of a fully computed ``tokens``."""
    hashes = block_hashes(tokens, block_size=BS)
    table = cache.allocate(len(hashes))
    assert table is not None
    cache.store(table, 0, hashes, None, tokens)
    return table


def test_allocate_and_free_track_references() -> None:
    cache = BlockCache(num_blocks=4, block_size=BS)
    table = cache.allocate(3)
    assert table is not None and len(set(table)) == 3
    assert cache.num_free == 1
    assert all(cache.ref_count(b) == 1 for b in table)
    assert cache.allocate(2) is None  # all-or-nothing
    assert cache.num_free == 1
    cache.free(table)
    assert cache.num_free == 4
    assert cache.take_events() == []  # nothing cached, nothing to report


def test_store_emits_chain_with_parent_and_tokens() -> None:
    cache = BlockCache(num_blocks=8, block_size=BS)
    tokens = span(100, 12)
    hashes = block_hashes(tokens, block_size=BS)
    table = cache.allocate(3)
    assert table is not None
    cache.store(table, 0, hashes[:2], None, tokens[:8])
    cache.store(table, 2, hashes[2:], hashes[1], tokens[8:])
    first, second = cache.take_events()
    assert first == BlockStored(
        block_hashes=hashes[:2], parent_block_hash=None, token_ids=tokens[:8], block_size=BS
    )
    assert second == BlockStored(
        block_hashes=hashes[2:], parent_block_hash=hashes[1], token_ids=tokens[8:], block_size=BS
    )
    assert cache.cached_prefix_tokens(hashes) == 12
    assert cache.take_events() == []  # taken once


def test_unreferenced_blocks_are_evicted_lru_children_first() -> None:
    cache = BlockCache(num_blocks=6, block_size=BS)
    a = _cached_chain(cache, span(0, 8))
    b = _cached_chain(cache, span(100, 4))
    c = _cached_chain(cache, span(200, 4))
    cache.take_events()
    cache.free(a)  # released first: oldest
    cache.free(c)
    cache.free(b)
    ha = cache.cached_hashes()[:2]  # registration order: a's chain first
    hb, hc = cache.cached_hashes()[2:]
    # Within a table the tail goes first, so the cache stays prefix-closed.
    assert cache.evictable_hashes() == [ha[1], ha[0], hc, hb]
    assert cache.num_free == 6  # 2 empty + 4 evictable
    got = cache.allocate(3)  # 2 empty blocks first, then one eviction
    assert got is not None
    assert cache.take_events() == [BlockRemoved(block_hashes=[ha[1]])]
    cache.allocate(2)
    assert cache.take_events() == [BlockRemoved(block_hashes=[ha[0], hc])]
    assert cache.cached_hashes() == [hb]


def test_prefix_probe_after_partial_eviction() -> None:
    cache = BlockCache(num_blocks=8, block_size=BS)
    tokens = span(0, 32)
    hashes = block_hashes(tokens, block_size=BS)
    cache.free(_cached_chain(cache, tokens))
    assert cache.cached_prefix_tokens(hashes) == 32
    assert cache.cached_prefix_tokens([*hashes, 12345]) == 32
    assert cache.cached_prefix_tokens([]) == 0
    cache.allocate(3)  # evicts the chain's last 3 blocks, tail first
    for n in range(len(hashes) + 1):
        assert cache.cached_prefix_tokens(hashes[:n]) == min(n, 5) * BS
    assert cache.cached_prefix_tokens(block_hashes(tokens, "other", BS)) == 0


def test_referenced_blocks_are_never_evicted() -> None:
    cache = BlockCache(num_blocks=3, block_size=BS)
    held = _cached_chain(cache, span(0, 8))
    assert cache.allocate(2) is None  # only one block is free
    assert cache.allocate_one() >= 0
    assert cache.allocate_one() == -1
    assert all(cache.is_cached(cache.block_hash(b)) for b in held)  # type: ignore[arg-type]


def test_acquire_reuses_hits_and_is_atomic() -> None:
    cache = BlockCache(num_blocks=4, block_size=BS)
    tokens = span(0, 8)
    hashes = block_hashes(tokens, block_size=BS)
    cache.free(_cached_chain(cache, tokens))
    hits = cache.match_prefix(hashes, max_blocks=10)
    assert len(hits) == 2
    assert cache.match_prefix(hashes, max_blocks=1) == hits[:1]
    # 2 hits are evictable; 2 empty blocks remain: asking 3 new must fail and change nothing.
    assert cache.acquire(hits, 3) is None
    assert cache.num_free == 4 and cache.evictable_hashes() == hashes[::-1]
    new = cache.acquire(hits, 2)
    assert new is not None and len(new) == 2
    assert [cache.ref_count(b) for b in hits] == [1, 1]
    assert cache.num_free == 0
    assert cache.take_events() and cache.take_events() == []


def test_storing_a_duplicate_shares_the_cached_block() -> None:
    cache = BlockCache(num_blocks=4, block_size=BS)
    tokens = span(0, 4)
    first = _cached_chain(cache, tokens)
    cache.take_events()
    table = cache.allocate(1)
    assert table is not None
    own = table[0]
    cache.store(table, 0, block_hashes(tokens, block_size=BS), None, tokens)
    assert table == first
    assert cache.ref_count(first[0]) == 2
    assert cache.ref_count(own) == 0 and cache.num_free == 3
    assert cache.take_events() == []  # nothing new was cached


def test_snapshot_round_trips_and_orders_parents_first() -> None:
    cache = BlockCache(num_blocks=32, block_size=BS)
    shared = span(0, 8)
    tables = [
        _cached_chain(cache, shared + span(100, 8)),
        _cached_chain(cache, span(500, 4)),
    ]
    # A sibling branch off the shared prefix, stored after the first chain.
    branch = shared + span(900, 4)
    hashes = block_hashes(branch, block_size=BS)
    table = cache.match_prefix(hashes, 2)
    new = cache.acquire(table, 1)
    assert new is not None
    table += new
    cache.store(table, 2, hashes[2:], hashes[1], branch[8:])
    cache.free(tables[1])  # evict a whole chain
    cache.allocate(cache.num_free)
    live = replay_kv_events(cache.take_events())
    snapshot = cache.snapshot_events()
    assert isinstance(snapshot[0], AllBlocksCleared)
    assert replay_kv_events(snapshot) == live  # _replay also checks parents come first
    assert set(live) == set(cache.cached_hashes())
    assert live[hashes[2]] == (hashes[1], tuple(branch[8:]))


def test_reset_clears_everything_but_not_while_referenced() -> None:
    cache = BlockCache(num_blocks=4, block_size=BS)
    table = _cached_chain(cache, span(0, 8))
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.free(table)
    cache.take_events()
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.num_cached == 0 and cache.num_free == 4
    assert cache.snapshot_events() == [AllBlocksCleared()]
