"""The hf engine's prefix blocks: a running request's chain of KV blocks in the pool.

A request starts from the longest cached prefix of its block hashes (``_attach_prefix``):
at admission on the ordinary path; at its pass for a prefill-only request
(``HfEngine._next_pass``), since the cache may have grown while it waited behind others
(a request sharing its prefix may have just run).

Every full 16-token block a request has computed is copied into the paged ``KvPool`` and
registered in the ``BlockCache`` under its prefixmesh block hash (a ``BlockStored``
event), after the blocks the request holds already. The ordinary path copies from the
request's ``DynamicCache`` after each forward pass (``_store_blocks``); a prefill-only pass
(``hf_prefill_only.py``) is handed its blocks before it runs (``_new_blocks``), writes them
layer by layer, and they are registered when it is done (``_register_blocks``).
"""

from __future__ import annotations

from typing import Any

from prefixmesh.services.worker.engine.block_cache import BlockCache
from prefixmesh.services.worker.engine.kv_pool import KvPool
from prefixmesh.services.worker.engine.window import SlidingSums
from prefixmesh.shared.blocks import BLOCK_SIZE


class BlockChains:
    """Mixin of ``HfEngine``: block chains of its running requests (``seq``: its ``_Seq``,
    with ``req``, ``blocks``, ``pending``, ``prefill_only``, ``caching`` and ``past``)."""

    cache: BlockCache
    # Per first pass: (prompt tokens, cached tokens, queue seconds).
    _admit_win: SlidingSums

    def _pool(self) -> KvPool:
        """The KV pool, built by load() before any request runs."""
        pool: KvPool | None = getattr(self, "pool", None)
        assert pool is not None, "load() first"
        return pool

    def _store_blocks(self, seq: Any) -> None:
        """Copy newly full computed blocks into the pool and register them (BlockStored)."""
        first = len(seq.blocks)
        new = self._new_blocks(seq, seq.req.num_computed_tokens // BLOCK_SIZE)
        if not new:
            return
        layers = seq.past.layers
        keys, values = [la.keys for la in layers], [la.values for la in layers]
        pool = self._pool()
        for i, b in enumerate(new):
            pool.write(b, keys, values, (first + i) * BLOCK_SIZE)
        self._register_blocks(seq, new)

    def _new_blocks(self, seq: Any, full: int) -> list[int]:
        """Pool blocks for ``seq``'s full blocks past those it holds, up to ``full`` (fewer
        when the pool is full of referenced blocks: its chain stops growing there)."""
        req, first = seq.req, len(seq.blocks)
        if not seq.caching or full <= first:
            return []
        if len(req.block_hashes) < full:
            req.hash_blocks(full, BLOCK_SIZE)
        new: list[int] = []
        for _ in range(full - first):
            b = self.cache.allocate_one()
            if b < 0:
                seq.caching = False
                break
            new.append(b)
        return new

    def _register_blocks(self, seq: Any, new: list[int]) -> None:
        """Register ``new`` (written) blocks after ``seq``'s chain (BlockStored)."""
        if not new:
            return
        req, bs, first = seq.req, BLOCK_SIZE, len(seq.blocks)
        seq.blocks.extend(new)
        end = first + len(new)
        parent = req.block_hashes[first - 1] if first else None
        self.cache.store(seq.blocks, first, req.block_hashes[first:end], parent,
                         req.known_tokens(first * bs, end * bs))
        req.num_stored_blocks = end

    def _attach_prefix(self, seq: Any, now: float) -> None:
        """Reference ``seq``'s longest cached prefix (never its last token) and start from
        it: the ordinary path's first forward pass gathers that KV into its DynamicCache (on
        the executor); a prefill-only pass is also handed the pool blocks of its new full
        blocks (the rest of its KV is discarded). A request resumed after a preemption
        reports what it found cached in ``num_resumed_cached_tokens``."""
        req, bs = seq.req, BLOCK_SIZE
        hits = self.cache.match_prefix(req.block_hashes, (req.num_tokens - 1) // bs)
        self.cache.acquire(hits, 0)  # references only: never fails
        seq.blocks = list(hits)
        if seq.prefill_only:
            seq.pending = self._new_blocks(seq, req.num_prompt_tokens // bs)
        cached = len(hits) * bs
        req.num_computed_tokens = cached
        req.num_stored_blocks = len(hits)
        if req.first_scheduled is not None:  # resumed after a preemption
            req.num_resumed_cached_tokens = cached
            return
        req.first_scheduled = now
        req.num_cached_tokens = cached
        self._admit_win.add(now, req.num_prompt_tokens, cached, now - req.arrival)
