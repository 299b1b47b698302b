"""Paged KV blocks with a block-hash prefix cache (vLLM's V1 KV cache manager, simplified).

A physical block holds ``block_size`` tokens of KV. Each block has a reference count (the
running requests whose block table holds it). A full block of computed tokens is
registered under its prefixmesh block hash (prefixmesh.shared.blocks: a chain hash naming the whole
prefix), so a later request with the same prefix reuses it instead of recomputing.

Unreferenced blocks stay cached until their memory is needed, then are evicted least
recently used first. Free blocks that hold no cached data are always reused before any
cached block is evicted (vLLM V1 pops its one free queue in order and may evict cached
blocks while empty ones wait behind them; keeping the cache longer only helps).

Invariant kept by the engine's usage (and relied on by ``snapshot_events``): the cache is
prefix-closed. A block table is a hash chain, so every request referencing a cached block
also references its parent; tables are freed tail first, so a child always becomes
evictable before its parent, and hits touch parents together with children. Duplicates are
never cached: a request that completes a block whose hash is already cached swaps its own
block for the cached one (vLLM V0 did the same).

Every change is queued as a KV event in vLLM's schema (prefixmesh.shared.wire), in order;
evictions between two other events are merged into one BlockRemoved.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefixmesh.shared.blocks import chain_runs
from prefixmesh.shared.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class BlockCache:
    """KV block pool plus prefix cache; all counts are in blocks unless named tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        # Per block while it is cached: its hash, its parent's hash and where its tokens are
        # (the last two only for resync snapshots). Plain lists: this is on the step hot
        # path. A block's tokens are ``_tok_src[b][_tok_off[b]:][:block_size]``: the token
        # list passed to ``store`` is shared by the blocks it registered, not sliced per
        # block (a slice per block was the simulator's largest single cost).
        self._hash: list[int | None] = [None] * num_blocks
        self._parent: list[int | None] = [None] * num_blocks
        self._tok_src: list[Sequence[int]] = [()] * num_blocks
        self._tok_off: list[int] = [0] * num_blocks
        # Unreferenced, uncached blocks; popped from the end (block 0 first at start).
        self._free = list(range(num_blocks - 1, -1, -1))
        # Unreferenced cached blocks, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Block hash -> block id of every cached block.
        self._cached: dict[int, int] = {}
        self._events: list[KvEvent] = []
        # Evicted hashes not yet folded into a BlockRemoved event.
        self._removed: list[int] = []

    # ------------------------------------------------------------------ probes (no side effects)

    @property
    def num_free(self) -> int:
        """Blocks available to allocate (empty ones plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        """Running requests holding ``block_id``."""
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """Hash ``block_id`` is cached under, or None."""
        return self._hash[block_id]

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block with this hash is in the cache."""
        return block_hash in self._cached

    def cached_hashes(self) -> list[int]:
        """Hashes of all cached blocks, in registration order."""
        return list(self._cached)

    def evictable_hashes(self) -> list[int]:
        """Hashes of unreferenced cached blocks, next to be evicted first."""
        return [self._hash[b] for b in self._evictable]  # type: ignore[misc]

    def match_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``)."""
        # One C-level pass of lookups, cut at the first miss (cheaper than a Python loop
        # that stops there: prompts are hundreds to thousands of blocks long).
        out = list(map(self._cached.get, block_hashes[:max_blocks]))
        if None in out:
            del out[out.index(None) :]
        return out  # type: ignore[return-value]

    def cached_prefix_tokens(self, block_hashes: Sequence[int]) -> int:
        """Tokens of the longest cached prefix of ``block_hashes``. Binary search, O(log n):
        the cache is prefix-closed, so along one hash chain "block i is cached" implies
        "block i - 1 is cached" (local policies probe every waiting request each step)."""
        cached = self._cached
        lo, hi = 0, len(block_hashes)  # invariant: blocks [0, lo) cached, [hi, n) not
        while lo < hi:
            mid = (lo + hi) // 2
            if block_hashes[mid] in cached:
                lo = mid + 1
            else:
                hi = mid
        return lo * self.block_size

    # ------------------------------------------------------------------ allocation

    def acquire(self, hits: Sequence[int], num_new: int) -> list[int] | None:
        """Reference the cached ``hits`` and allocate ``num_new`` more blocks, or do nothing
        and return None when memory is short (hits being reused do not count as free)."""
        ref = self._ref
        reusable = [ref[b] for b in hits].count(0)
        if num_new > self.num_free - reusable:
            return None
        hashes, evictable = self._hash, self._evictable
        for b in hits:  # _take_ref, inlined (one call per hit block)
            if ref[b] == 0 and hashes[b] is not None:
                del evictable[b]
            ref[b] += 1
        return self.allocate(num_new) if num_new else []

    def allocate(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` fresh blocks (ref 1), evicting LRU cached ones as needed; None
        (and no change) if too few are free."""
        free = self._free
        if num_blocks > len(free) + len(self._evictable):
            return None
        # As ``num_blocks`` calls of ``_pop``: empty blocks from the end of the free list
        # first, then evictions in LRU order.
        k = min(num_blocks, len(free))
        out = free[-k:][::-1] if k else []
        if k:
            del free[-k:]
            ref = self._ref
            for b in out:
                ref[b] = 1
        if k < num_blocks:
            self._evict_into(out, num_blocks - k)
        return out

    def allocate_one(self) -> int:
        """One fresh block id (ref 1), evicting if needed; -1 if none is free. Hot path."""
        if self._free:
            b = self._free.pop()
            self._ref[b] = 1
            return b
        if not self._evictable:
            return -1
        out: list[int] = []
        self._evict_into(out, 1)
        return out[0]

    def _evict_into(self, out: list[int], n: int) -> None:
        """Evict the ``n`` least recently released cached blocks (ref 1) onto ``out``; the
        caller has checked that there are that many."""
        popitem = self._evictable.popitem
        cached, hashes, src, ref = self._cached, self._hash, self._tok_src, self._ref
        removed = self._removed
        for _ in range(n):
            b, _ = popitem(last=False)
            h = hashes[b]
            assert h is not None  # an evictable block is a cached one: it has a hash
            del cached[h]
            hashes[b] = None
            src[b] = ()
            removed.append(h)
            ref[b] = 1
            out.append(b)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, tail first, so that when a whole table is
        released its last blocks are evicted before its first (keeps the cache prefix-closed)."""
        ref, hashes, evictable = self._ref, self._hash, self._evictable
        free = self._free.append
        for b in reversed(block_ids):
            r = ref[b] = ref[b] - 1
            if r == 0:
                if hashes[b] is None:
                    free(b)
                else:
                    evictable[b] = None  # most recently released: evicted last

    def _take_ref(self, block_id: int) -> None:
        if self._ref[block_id] == 0 and self._hash[block_id] is not None:
            del self._evictable[block_id]
        self._ref[block_id] += 1

    # ------------------------------------------------------------------ caching

    def store(
        self,
        table: list[int],
        first: int,
        block_hashes: list[int],
        parent_hash: int | None,
        token_ids: list[int],
    ) -> None:
        """Register ``table[first:first + len(block_hashes)]`` (full, computed blocks holding
        ``token_ids``) under ``block_hashes``; ``parent_hash`` is the hash of
        ``table[first-1]`` (None at the start of a chain). The cache keeps both lists. A block
        whose hash is already cached is swapped in ``table`` for the cached one and its own
        block freed."""
        cached = self._cached
        for h in block_hashes:
            if h in cached:
                self._store_sharing(table, first, block_hashes, parent_hash, token_ids)
                return
        # Common case (one decode block, or a fresh prompt): all new, one event.
        bs, hashes, parents = self.block_size, self._hash, self._parent
        src, off = self._tok_src, self._tok_off
        prev = parent_hash
        i = 0
        for b, h in zip(table[first : first + len(block_hashes)], block_hashes):
            cached[h] = b
            hashes[b] = h
            parents[b] = prev
            src[b] = token_ids
            off[b] = i
            i += bs
            prev = h
        if self._removed:
            self._flush_removed()
        self._events.append(BlockStored(block_hashes, parent_hash, token_ids, bs))

    def _store_sharing(self, table: list[int], first: int, block_hashes: list[int],
                       parent_hash: int | None, token_ids: list[int]) -> None:
        """``store`` when some blocks duplicate cached ones: one event per run of new blocks."""
        bs, cached = self.block_size, self._cached
        hashes, parents, src, off = self._hash, self._parent, self._tok_src, self._tok_off
        run_start = 0  # index in block_hashes where the current run of new blocks starts
        run_parent = prev = parent_hash
        for i, h in enumerate(block_hashes):
            shared = cached.get(h)
            if shared is None:
                b = table[first + i]
                cached[h] = b
                hashes[b] = h
                parents[b] = prev
                src[b] = token_ids
                off[b] = i * bs
            else:
                # Computed concurrently by another request: share the cached block.
                own = table[first + i]
                self._take_ref(shared)
                table[first + i] = shared
                self.free((own,))
                self._stored(block_hashes, run_start, i, run_parent, token_ids)
                run_start, run_parent = i + 1, h
            prev = h
        self._stored(block_hashes, run_start, len(block_hashes), run_parent, token_ids)

    def _stored(
        self, hashes: list[int], start: int, end: int, parent: int | None, tokens: list[int]
    ) -> None:
        if start < end:
            bs = self.block_size
            self._emit(BlockStored(hashes[start:end], parent, tokens[start * bs : end * bs], bs))

    def reset(self) -> None:
        """Forget every cached block; only legal while no block is referenced (a running
        request's later blocks would otherwise be cached without their parents)."""
        if self.num_free != self.num_blocks:
            raise RuntimeError("reset() while blocks are referenced by running requests")
        self._free.extend(self._evictable)
        self._evictable.clear()
        n = self.num_blocks
        self._hash, self._parent, self._tok_src = [None] * n, [None] * n, [()] * n
        self._cached.clear()
        self._removed.clear()  # superseded by the clear
        self._emit(AllBlocksCleared())

    # ------------------------------------------------------------------ events

    def _emit(self, event: KvEvent) -> None:
        if self._removed:
            self._flush_removed()
        self._events.append(event)

    def _flush_removed(self) -> None:
        self._events.append(BlockRemoved(block_hashes=self._removed))
        self._removed = []

    def take_events(self) -> list[KvEvent]:
        """Pending KV events in the order they happened; clears the queue."""
        if self._removed:
            self._flush_removed()
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KvEvent]:
        """``[AllBlocksCleared(), BlockStored...]`` rebuilding the current cache from scratch,
        parents before children, one event per straight run of a chain."""
        cached, parents, src, off = self._cached, self._parent, self._tok_src, self._tok_off
        bs = self.block_size
        events: list[KvEvent] = [AllBlocksCleared()]
        for run in chain_runs({h: parents[b] for h, b in cached.items()}):
            tokens: list[int] = []
            for h in run:
                b = cached[h]
                tokens.extend(src[b][off[b] : off[b] + bs])
            events.append(
                BlockStored(
                    block_hashes=run,
                    parent_block_hash=parents[cached[run[0]]],
                    token_ids=tokens,
                    block_size=bs,
                )
            )
        return events


class CachedEngine:
    """The cache half of an engine that keeps its own ``BlockCache`` (``self.cache``): the
    ``EngineView`` capacity and probe, and the cache's KV events."""

    cache: BlockCache

    @property
    def num_blocks(self) -> int:
        """KV blocks in the pool (EngineView, for local policies)."""
        return self.cache.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """KV blocks allocatable now: empty plus evictable cached (EngineView)."""
        return self.cache.num_free

    def cached_prefix_tokens(self, block_hashes: Sequence[int]) -> int:
        """Tokens of the longest cached prefix of ``block_hashes`` (a probe: no side effects)."""
        return self.cache.cached_prefix_tokens(block_hashes)

    def take_kv_events(self) -> list[KvEvent]:
        """KV events since the last call, in order."""
        return self.cache.take_events()

    def snapshot_events(self) -> list[KvEvent]:
        """``[AllBlocksCleared, BlockStored...]`` describing the whole cache (resync)."""
        return self.cache.snapshot_events()
