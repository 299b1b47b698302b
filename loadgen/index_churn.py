"""Why the prefix tree's block index is not one dict (docs/benchmarks.md): the slowest
insert into a million block hashes under steady churn, in one dict against ``--shards``
dicts, and in the tree's own index (``block_index.BlockIndex``: generations, dead nodes
forgotten lazily), with its C tables and with dicts as generations.

CPython reclaims a dict's deleted slots only when it rebuilds the whole table, once the
inserts have used up its free entries; routing adds hashes and the tree's budget drops
the oldest, so a single dict stops the scheduler for the length of a rebuild every so
often. Run: ``python -m prefixmesh.loadgen.index_churn --shards 1,256``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import time
from collections.abc import Sequence

from prefixmesh.services.scheduler.block_index import BlockIndex, DictTable, HashTable
from prefixmesh.services.scheduler.prefix_tree import TRIM_PER_PUT


def slowest_insert(shards: int, held: int, batch: int, rounds: int, seed: int) -> float:
    """Seconds of the slowest insert of ``batch`` new hashes while ``held`` are kept (the
    oldest dropped as new ones come), after the index first holds ``held``."""
    rng = random.Random(seed)
    index: list[dict[int, int]] = [{} for _ in range(shards)]
    order: collections.deque[int] = collections.deque()
    fill = held // batch
    worst = 0.0
    for i in range(fill + rounds):
        new = [rng.getrandbits(63) for _ in range(batch)]
        t = time.perf_counter()
        for h in new:
            index[h % shards][h] = i
        if i >= fill:
            worst = max(worst, time.perf_counter() - t)
        order.extend(new)
        while len(order) > held:
            h = order.popleft()
            del index[h % shards][h]
    return worst


class _Node:
    """What ``BlockIndex`` needs of a tree node."""

    __slots__ = ("hashes", "alive")

    def __init__(self, hashes: tuple[int, ...]) -> None:
        self.hashes, self.alive = hashes, True


def slowest_insert_generations(held: int, batch: int, rounds: int, seed: int,
                               table: type = HashTable) -> float:
    """``slowest_insert`` for the tree's ``BlockIndex``: each insert is one node's
    ``put`` and a ``trim`` step of ``TRIM_PER_PUT`` entries a hash put, as the tree's
    flushes give it (timed together); the oldest node dies (untimed: marking it is all
    the tree does)."""
    rng = random.Random(seed)
    index: BlockIndex[_Node] = BlockIndex(table)
    order: collections.deque[_Node] = collections.deque()
    fill = held // batch
    worst = 0.0
    for i in range(fill + rounds):
        node = _Node(tuple(rng.getrandbits(63) for _ in range(batch)))
        t = time.perf_counter()
        index.put(node.hashes, node)
        index.trim(len(order) * batch + batch, TRIM_PER_PUT * batch)
        if i >= fill:
            worst = max(worst, time.perf_counter() - t)
        order.append(node)
        while len(order) * batch > held:
            order.popleft().alive = False
    return worst


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got "
                                         f"{text!r}")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.index_churn",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=_counts, default=[1, 256],
                    help="comma-separated dict counts (default: 1,256)")
    ap.add_argument("--held", type=int, default=1_000_000, help="hashes kept in the index")
    ap.add_argument("--batch", type=int, default=20, help="new hashes per insert")
    ap.add_argument("--rounds", type=int, default=100_000, help="timed inserts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("held", "batch", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    gc.disable()  # the dicts alone, not the collector
    for n in args.shards:
        worst = slowest_insert(n, args.held, args.batch, args.rounds, args.seed)
        print(f"{n} dict(s), {args.held:,} hashes under churn: slowest insert of "
              f"{args.batch} hashes {worst * 1e3:.2f} ms", flush=True)
    tables = {"C tables": HashTable, "dicts": DictTable}
    if HashTable is DictTable:  # the C extension is not built here
        tables = {"dicts": DictTable}
    for name, table in tables.items():
        worst = slowest_insert_generations(args.held, args.batch, args.rounds, args.seed, table)
        print(f"generations of {name} (BlockIndex), {args.held:,} hashes under churn: "
              f"slowest insert of {args.batch} hashes {worst * 1e3:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
