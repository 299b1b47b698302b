"""Cost-model estimates for the routing hot path, tabulated.

E2 prices several workers per decision, with prompt lengths that rarely repeat (every
video of a VideoQA-like load has its own length), and ``CostModel.prefill_time`` walks a
chunked prefill step by step. So:

- PT is tabulated by block count (rounded up: at most one block's worth of prefill
  more, < 0.1% for prompts of hundreds of tokens), each entry computed from a prefix sum
  of full chunks plus one step for the last partial chunk, exactly as ``prefill_time``.
- DT is tabulated by context block: exact below ``DT_BUCKET_TOKENS`` of context, linearly
  interpolated between bucket edges above it. The marginal decode cost is linear in the
  context there (attention over ``ctx`` tokens; the fitted profiles have no other
  dependence), so the interpolation is exact up to float rounding and a table entry costs
  two cost-model evaluations per bucket instead of two per block.
"""

from __future__ import annotations

from prefixmesh.shared.costmodel import CostModel

# Context bucket of the DT table (tokens); below one bucket DT is tabulated per block.
DT_BUCKET_TOKENS = 1024
# Entries of the PT-after-a-cached-prefix memo before it starts over.
_AFTER_MAX = 1 << 16


class CostTables:
    """PT (prefill seconds) and DT (marginal decode seconds per output token)."""

    __slots__ = ("cost", "batch", "block", "lone_step", "_pt", "_chunks", "_dt", "_dt_edges",
                 "_after")

    def __init__(self, cost: CostModel, dt_batch_size: int) -> None:
        self.cost = cost
        self.batch = dt_batch_size
        self.block = cost.block_size
        # Seconds of a decode step of one short sequence: the least any output token waits.
        self.lone_step = cost.decode_time(0)
        self._pt: list[float | None] = [0.0]
        # _chunks[q] = seconds of the first q full prefill chunks.
        self._chunks: list[float] = [0.0]
        self._dt: list[float | None] = []
        self._dt_edges: list[float | None] = []
        # PT after a cached prefix, by (cached blocks, new blocks); cleared when full.
        self._after: dict[tuple[int, int], float] = {}

    def pt(self, tokens: int) -> float:
        """PT(n): seconds to prefill ``n`` uncached tokens (chunked like the engine)."""
        if tokens <= 0:
            return 0.0
        b = -(-tokens // self.block)
        t = self._pt
        if b < len(t) and (v := t[b]) is not None:
            return v
        return _put(t, b, self._prefill(b * self.block))

    def pt_after(self, tokens: int, cached_tokens: int) -> float:
        """PT of ``tokens`` uncached tokens computed after ``cached_tokens`` cached ones
        (``CostModel.prefill_time(tokens, cached_tokens)``, in blocks rounded up): every
        chunk attends to the cached prefix, so a short tail after a long document costs
        several times its ``pt``."""
        if cached_tokens <= 0:
            return self.pt(tokens)
        if tokens <= 0:
            return 0.0
        key = (cached_tokens // self.block, -(-tokens // self.block))
        memo = self._after
        v = memo.get(key)
        if v is None:
            if len(memo) >= _AFTER_MAX:
                memo.clear()
            v = memo[key] = self.cost.prefill_time(key[1] * self.block, key[0] * self.block)
        return v

    def _prefill(self, n: int) -> float:
        """``CostModel.prefill_time(n)`` in one step: full chunks from a prefix sum."""
        c = self.cost.max_batched_tokens
        q, r = divmod(n, c)
        chunks = self._chunks
        while len(chunks) <= q:
            k = len(chunks)
            chunks.append(chunks[-1] + self.cost.step_time(((c, k * c),)))
        return chunks[q] + (self.cost.step_time(((r, n),)) if r else 0.0)

    def dt(self, context_tokens: int) -> float:
        """DT: seconds one more sequence of this context adds to a batched decode step.

        The GPU cost of one output token under continuous batching (docs/design.md
        section 5: the sequential per-token time would make L count requests, not GPU
        work).
        """
        b = context_tokens // self.block if context_tokens > 0 else 0
        t = self._dt
        if b < len(t) and (v := t[b]) is not None:
            return v
        ctx = b * self.block
        if ctx < DT_BUCKET_TOKENS:
            return _put(t, b, self.cost.marginal_decode_time(ctx, self.batch))
        k, r = divmod(ctx, DT_BUCKET_TOKENS)
        lo = self._edge(k)
        return _put(t, b, lo + (self._edge(k + 1) - lo) * (r / DT_BUCKET_TOKENS))

    def _edge(self, k: int) -> float:
        e = self._dt_edges
        if k < len(e) and (v := e[k]) is not None:
            return v
        return _put(e, k, self.cost.marginal_decode_time(k * DT_BUCKET_TOKENS, self.batch))


def _put(table: list[float | None], i: int, value: float) -> float:
    """``table[i] = value``, the table grown with gaps (None) as needed; returns value."""
    if i >= len(table):
        table.extend([None] * (i + 1 - len(table)))
    table[i] = value
    return value
