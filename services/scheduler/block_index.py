"""Block hash -> the prefix tree's node holding it, in shards so that no insert stalls
routing.

The tree indexes every block hash it holds (KV events name blocks by hash alone). In one
dict of hundreds of thousands of hashes under steady churn (routing adds a request's new
blocks, the budget's eviction drops old ones), CPython reclaims the slots of deleted keys
only by rebuilding the whole table once its free entries run out, with routing stopped
meanwhile. Spread over 256 dicts by the hash's low bits, each rebuild moves 1/256 of the
entries (``loadgen/index_churn.py`` times both; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

SHARD_BITS = 8
SHARD_MASK = (1 << SHARD_BITS) - 1

N = TypeVar("N")


class BlockIndex(Generic[N]):
    """A dict from block hash to node, sharded by the hash's low ``SHARD_BITS`` bits.
    ``shards`` is public for hot loops (``shards[h & SHARD_MASK].get(h)``)."""

    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: list[dict[int, N]] = [{} for _ in range(SHARD_MASK + 1)]

    def get(self, block_hash: int) -> N | None:
        return self.shards[block_hash & SHARD_MASK].get(block_hash)

    def put(self, hashes: Iterable[int], node: N) -> None:
        """Point each of ``hashes`` at ``node``."""
        shards = self.shards
        for h in hashes:
            shards[h & SHARD_MASK][h] = node

    def discard(self, hashes: Iterable[int]) -> None:
        """Forget ``hashes`` (those not held are skipped)."""
        shards = self.shards
        for h in hashes:
            shards[h & SHARD_MASK].pop(h, None)

    def __len__(self) -> int:
        return sum(map(len, self.shards))
