"""Block hash -> the prefix tree's node holding it: written a node at a time into
generations, forgotten lazily, so that neither routing's inserts nor the budget's
evictions stall it or touch every evicted block.

The tree indexes every block hash it holds (KV events name blocks by hash alone):
hundreds of thousands under steady churn (routing adds a request's new blocks, the
budget's eviction drops old ones). In one plain dict that churn has two costs:

- CPython reclaims the slots of deleted keys only by rebuilding the whole table once its
  free entries run out, with routing stopped meanwhile (tens of milliseconds at a million
  hashes: ``loadgen/index_churn.py``);
- deleting an evicted node's hashes one by one reads memory untouched since the node was
  routed, a cache miss or more per block, on every decision.

So a node's hashes go into the newest of a list of tables (a generation of at most
``GEN_ENTRIES``); nothing is deleted when a node dies; a lookup
takes the newest entry of a hash and returns its node if that is still alive. Once the
entries exceed twice the blocks the tree holds, ``trim`` retires the oldest generation, a
step at a time (as many entries scanned or re-put per call as its caller says, so no call
stalls routing): it collects the generation's nodes, writes the still-live ones into the
newest generation (their hashes, from the node itself), then drops it.

Why the newest entry is right: a block hash is held by one live node at most (the hashes
chain the whole prefix), and a node comes to hold a hash only by being created with it
or split off with it, each followed by a ``put``; a node's hashes never grow. So the
newest entry names the hash's holder, or a node that has died since (no holder).

A generation's table is ``_hashtable.HashTable`` (C, built with the package): int64 keys
read straight from a packed run's buffer and one reference a put, where a dict holds an
int object and a reference for every hash (docs/benchmarks.md, "The block index in C").
Where the extension was not built, ``DictTable`` does the same with a dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, Generic, Protocol, TypeVar

# Entries of one generation (a C table is made with room for them, so filling it never
# stops a put to grow it); a lookup that misses probes every generation.
GEN_ENTRIES = 1 << 15


class DictTable(dict):
    """``HashTable``'s interface over a dict: the table where the C extension is not
    built (and the reference the tests hold it to)."""

    __slots__ = ()

    def __init__(self, entries: int = 0) -> None:  # a dict is not sized ahead
        super().__init__()

    def put(self, hashes: Iterable[int], value: Any) -> None:
        """Point every hash of ``hashes`` at ``value``."""
        for h in hashes:  # faster than update(zip(...)), which makes a pair of each hash
            self[h] = value


try:
    from prefixmesh.services.scheduler._hashtable import HashTable
except ImportError:  # the package was installed without its C extension
    HashTable = DictTable  # type: ignore[misc,assignment]


class Held(Protocol):
    """What the index needs of a node: whether it is alive, and its hashes."""

    @property
    def alive(self) -> bool: ...

    @property
    def hashes(self) -> Sequence[int]: ...


N = TypeVar("N", bound=Held)


class BlockIndex(Generic[N]):
    """Block hash -> live node, in generations oldest first (``gens[-1]`` is written)."""

    __slots__ = ("gens", "_table", "_older", "_scan", "_found", "_live")

    def __init__(self, table: type = HashTable) -> None:
        self._table = table  # one generation's type (``HashTable`` or ``DictTable``)
        self.gens: list[Any] = [table(GEN_ENTRIES)]
        self._older = 0  # entries in every generation but the newest
        # Retiring ``gens[0]``: what of its values is left to scan and the nodes found so
        # far, then the live ones left to re-put, last first (None: not retiring).
        self._scan: Iterator[N] | None = None
        self._found: set[N] = set()
        self._live: list[N] | None = None

    def get(self, block_hash: int) -> N | None:
        """The live node holding ``block_hash``, if any."""
        for gen in reversed(self.gens):
            node = gen.get(block_hash)
            if node is not None:
                return node if node.alive else None
        return None

    def put(self, hashes: Iterable[int], node: N) -> None:
        """Point each of ``hashes`` at ``node`` (which now holds them)."""
        gen = self.gens[-1]
        gen.put(hashes, node)
        if len(gen) >= GEN_ENTRIES:
            self._older += len(gen)
            self.gens.append(self._table(GEN_ENTRIES))

    def trim(self, held: int, step: int) -> None:
        """One step of retiring the oldest generation, if the entries exceed twice
        ``held`` (the blocks the tree holds) by more than a generation. A step scans
        ``step`` of the generation's values (a C table lists a node once a put, a dict
        once a hash), or re-puts about that many hashes of live nodes.
        ``PrefixTree`` calls this after each flush of its queued puts with a step of
        twice the hashes it put, so a generation of mostly dead nodes is retired faster
        than the puts fill a new one, a little at a time."""
        if self._scan is None and self._live is None:
            if len(self.gens) == 1 or len(self) <= 2 * held + GEN_ENTRIES:
                return
            self._scan = iter(self.gens[0].values())  # gens[0] is no longer written
        if self._scan is not None:
            chunk = list(islice(self._scan, step))
            self._found.update(chunk)
            if len(chunk) == step:
                return
            self._scan = None
            self._live = [n for n in self._found if n.alive]
            self._found = set()
        live = self._live
        assert live is not None
        budget = step
        while live and budget > 0:
            node = live.pop()
            if node.alive:
                self.put(node.hashes, node)
                budget -= len(node.hashes)
        if not live:
            self._live = None
            self._older -= len(self.gens.pop(0))

    def __len__(self) -> int:
        """Entries held, those of dead nodes included."""
        return self._older + len(self.gens[-1])
