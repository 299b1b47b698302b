"""Global prefix tree over prefixmesh block hashes (docs/design.md section 5).

A radix tree whose edges are runs of consecutive block hashes. Block hashes are chained
(``prefixmesh.shared.blocks``): one hash names the whole prefix up to and including its block, so
the tree is prefix-closed and a run matches a prompt as soon as its *last* hash equals
the prompt's hash at that depth. ``match`` therefore walks from the root with one dict
lookup and one comparison per node.

Per node: its run of hashes (``tokens`` = blocks x block size), the workers that
cache the whole run, per-worker counts of requests in the policy's sliding window that
went through it, and the last access time. A worker caching a node caches all of its
ancestors (a paged prefix cache can only use a block after its parent).

Per worker, an ``OrderedDict`` of the nodes it caches, least recently used first, is the
scheduler's model of that worker's LRU eviction. Paths are refreshed leaf -> root, so
ancestors always sit after their descendants and eviction from the front never orphans a
cached node.

A hash -> node index serves KV events (BlockStored / BlockRemoved name blocks by hash).
Routing never reads it: index updates and pruning are queued and applied by ``flush``
(before the next index lookup, once enough wait, or in ``maintain``), and a dropped
node's entries are forgotten lazily (``block_index.py``), so inserting or dropping a
600-block video prefix costs the routing path one C-level update at most. A node/token
budget bounds memory under an endless stream of unique prompts: ``maintain`` drops least
recently accessed leaves.

Persistence comes in two forms. ``snapshot``/``restore`` encode the whole tree at once
(tests, the simulator). The scheduler service instead persists incrementally: with
``track_changes`` on, every node whose run, caching set, counts or last access changed is
kept in a dirty set and every pruned node's id in a list; ``take_changes`` hands both over
in O(1) and ``node_record`` encodes one node (ids are stable, ``nid``), so a background
task can write only what changed, a slice at a time, while routing goes on. A record holds
each worker's LRU stamp (``Node.workers`` values: a counter taken when the node was last
refreshed for that worker), from which ``load_records`` rebuilds every worker's LRU order.

Node identity is stable in one direction: when a node splits, the existing object keeps
the *lower* (deeper) part and a new node takes the upper part. Callers may therefore hold
the node a request ended in and walk ``parent`` later (window expiry), across splits and
after the node was pruned (pruned nodes keep their ``parent``).

No I/O, no clock: times are passed in by the caller.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import msgspec

from prefixmesh.services.scheduler.block_index import BlockIndex
from prefixmesh.services.scheduler.leaf_queue import LeafQueue
from prefixmesh.shared.blocks import BLOCK_SIZE, packed_run, unpack_hashes
from prefixmesh.shared.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

# KV events about these media concern the GPU prefix cache (vLLM marks blocks offloaded
# to CPU memory with another medium).
GPU_MEDIA = frozenset({None, "GPU", "gpu", "cuda"})

SNAPSHOT_VERSION = 1
# Budgets by default: about 2.5x the KV cache of 16 A6000 workers (16 x 198,516 tokens),
# so the tree remembers more than the cluster caches but never grows without bound.
DEFAULT_MAX_NODES = 262_144
DEFAULT_MAX_TOKENS = 8_388_608
# Queued prune candidates beyond which the queue is flushed at once (bounds its memory).
PRUNE_QUEUE_LIMIT = 65_536
# Block hashes awaiting their index update beyond which the updates are applied at once
# (about 0.1 us a hash): routing pays them a few nodes at a time instead of the periodic
# ``maintain`` paying for every decision since the last one in one stall of the event loop
# (8-43 ms at 10,000 decisions/s). Small, so that no decision pays for many others (at
# 4,096, every 200th ToolBench decision put some 4,000 hashes: docs/benchmarks.md).
INDEX_QUEUE_HASHES = 256
# Old index entries a flush lets ``BlockIndex.trim`` scan (or re-put) per hash it put: the
# oldest generation is retired faster than the puts fill a new one.
TRIM_PER_PUT = 2
# The budget's LRU queue is compacted once it holds more than twice the tree's nodes and
# this many entries more (entries of nodes pruned without the budget popping them).
LRU_SLACK_ENTRIES = 4096


def hash_run(hashes: Sequence[int]) -> array[int] | tuple[int, ...]:
    """A node's run of block hashes: an int64 array as it came (a request's packed hashes
    off the wire, sliced: 8 bytes a hash, nothing for the garbage collector to look at,
    written to Redis as its bytes without reading an int), else a tuple of the ints."""
    if isinstance(hashes, array) and hashes.typecode == "q":
        return hashes
    return tuple(hashes)


class Node(msgspec.Struct, eq=False, gc=False):
    """One run of consecutive block hashes.

    Untracked by the garbage collector (``gc=False``) so full collections do not walk the
    tree; the only reference cycles (parent <-> children) are broken when a tree is
    discarded (``PrefixTree._dismantle``). Compared and hashed by identity.
    """

    # The run (``hash_run``: an int64 array, or a tuple of ints; never changed in place).
    hashes: array[int] | tuple[int, ...]
    # Blocks from the root before this node (absolute position of hashes[0]).
    start: int
    parent: Node | None
    # First block hash of each child's run -> child.
    children: dict[int, Node] = {}
    # Workers caching the whole run (routed there, or reported by KV events) -> the LRU
    # stamp of the node in that worker's cache model (larger = more recently used). A dict
    # of strings to ints is not tracked by the garbage collector, unlike a set of nodes.
    workers: dict[str, int] = {}
    # Worker -> requests in the policy window routed through this node (no zero entries).
    counts: dict[str, int] = {}
    last_access: float = 0.0
    # False once pruned from the tree.
    alive: bool = True
    # Id unique within the tree and stable for the node's life (persistence key).
    nid: int = 0

    @property
    def end(self) -> int:
        """Blocks from the root to the end of this node."""
        return self.start + len(self.hashes)

    def __repr__(self) -> str:
        return (
            f"Node(start={self.start}, blocks={len(self.hashes)}, workers={sorted(self.workers)}, "
            f"counts={self.counts}, alive={self.alive})"
        )


# --------------------------------------------------------------------------- persistence


class NodeState(msgspec.Struct, array_like=True):
    """One node of a snapshot; ``parent`` indexes ``TreeState.nodes`` (-1 = root)."""

    parent: int
    hashes: list[int]
    workers: list[str]
    counts: dict[str, int]
    # Seconds relative to the snapshot's reference time (<= 0).
    last_access: float


class NodeRecord(msgspec.Struct, array_like=True):
    """One node as persisted incrementally (``node_record``); times in the caller's epoch."""

    nid: int
    parent: int  # nid of the parent; -1 = root
    start: int
    # The run packed as ``pack_hashes`` does (a run held as an array), or its ints.
    hashes: bytes | tuple[int, ...]
    # Worker -> LRU stamp.
    workers: dict[str, int]
    counts: dict[str, int]
    last_access: float


class TreeState(msgspec.Struct, array_like=True):
    """Whole tree: nodes parents-first and each worker's LRU order (oldest first)."""

    version: int
    block_size: int
    nodes: list[NodeState]
    worker_lru: dict[str, list[int]]


_TREE_DECODER = msgspec.msgpack.Decoder(TreeState)
_RECORD_DECODER = msgspec.msgpack.Decoder(NodeRecord)
_ENCODER = msgspec.msgpack.Encoder()


class PrefixTree:
    """Radix tree of block-hash runs with caching sets, window counts and an LRU budget."""

    def __init__(
        self,
        max_nodes: int = DEFAULT_MAX_NODES,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self.block_size = block_size
        self.set_budget(max_nodes, max_tokens)
        self.root = Node((), 0, None)
        self._init_state()

    def set_budget(self, max_nodes: int, max_tokens: int) -> None:
        """Set the node/token budget (a smaller one takes effect at the next ``maintain``)."""
        self.max_nodes = max(max_nodes, 1)
        self.max_blocks = max(max_tokens // self.block_size, 1)

    def _init_state(self) -> None:
        self._dismantle()
        self.root = Node((), 0, None)
        self._index: BlockIndex[Node] = BlockIndex()
        self._wlru: dict[str, OrderedDict[Node, None]] = {}
        # Blocks each worker caches in this model (public for the routing hot path; read-only).
        self.worker_blocks: dict[str, int] = {}
        self.n_nodes = 0
        self.n_blocks = 0
        # Nodes whose current hashes must be (re)pointed to them in the index, and nodes
        # that may have become prunable; both applied by ``flush``.
        self._index_q: list[Node] = []
        self._index_q_hashes = 0  # hashes of the nodes in _index_q
        self._prune_q: list[Node] = []
        # BlockStored events whose parent block is unknown (resync material).
        self.orphan_stores = 0
        # Nodes dropped to respect the budget although possibly cached or in the window.
        self.budget_evictions = 0
        # The budget's eviction order: (last_access, nid, node) of every leaf, kept lazily.
        # A leaf is pushed when it becomes one (created, or its last child detached); an
        # entry whose node has died or grown children is dropped when popped, and one
        # whose node was touched since is pushed again with the newer time. So every live
        # leaf has an entry no later than its last access, and the budget pops leaves in
        # exact LRU order without sorting the tree (``_evict_lru_leaves``; ``LeafQueue``:
        # a heap's order, most entries in a sorted run beside it).
        self._lru: LeafQueue[tuple[float, int, Node]] = LeafQueue()
        # Next node id and next LRU stamp (both only grow).
        self._next_nid = 1
        self._stamp = 1
        # Change tracking for incremental persistence (None: off): nodes changed since the
        # last ``take_changes`` and ids of nodes pruned since.
        self._dirty: dict[Node, None] | None = None
        self._gone: list[int] = []
        # Nodes with ids from this one on were made since the last hand-over: none has
        # been written, so one pruned before the next goes to no one's ``gone`` list.
        self._unsaved_from = 0

    def _dismantle(self) -> None:
        """Break the parent <-> children cycles of the current tree so it can be freed."""
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children = {}

    def __del__(self) -> None:
        self._dismantle()

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return self.n_nodes

    @property
    def tokens(self) -> int:
        """Tokens held in the tree (all nodes)."""
        return self.n_blocks * self.block_size

    def nodes(self) -> Iterator[Node]:
        """All nodes, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def node_of(self, block_hash: int) -> Node | None:
        """The node holding ``block_hash``, if any."""
        if self._index_q:
            self.flush()
        return self._index.get(block_hash)

    def match(self, hashes: Sequence[int]) -> tuple[Node, int]:
        """Deepest node on the path of ``hashes`` and the number of leading blocks matched.

        A child whose last hash equals the prompt's hash at that depth matches entirely
        (chained hashes); otherwise the match ends inside it, found by binary search
        (block ``i`` matches only if every block before it does). Returns the root and 0
        when nothing matches.
        """
        node = self.root
        pos = 0
        n = len(hashes)
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None:
                break
            ch = child.hashes
            end = pos + len(ch)
            if end <= n and hashes[end - 1] == ch[-1]:
                node = child
                pos = end
                continue
            lo, hi = 1, min(len(ch), n - pos)  # ch[:lo] matches
            if hashes[pos + hi - 1] == ch[hi - 1]:
                return child, pos + hi
            hi -= 1  # ch[:hi + 1] does not match
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if hashes[pos + mid - 1] == ch[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            return child, pos + lo
        return node, pos

    def path(self, node: Node) -> list[Node]:
        """Nodes from ``node`` up to (not including) the root, deepest first."""
        out = []
        root = self.root
        while node is not root and node is not None:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        return out

    def cached_depths(self, node: Node, matched: int) -> dict[str, int]:
        """Blocks of a matched path cached on each worker (the deepest node it holds)."""
        out: dict[str, int] = {}
        depth = matched
        root = self.root
        while node is not root:
            for w in node.workers:
                if w not in out:
                    out[w] = depth
            depth = node.start
            node = node.parent  # type: ignore[assignment]
        return out

    def cached_tokens(self, worker: str) -> int:
        """Tokens the scheduler believes ``worker`` caches."""
        return self.worker_blocks.get(worker, 0) * self.block_size

    def worker_lru(self, worker: str) -> Iterator[Node]:
        """Nodes cached on ``worker``, least recently used first (descendants first)."""
        lru = self._wlru.get(worker)
        return iter(lru) if lru is not None else iter(())

    # ------------------------------------------------------------------ insertion

    def insert(self, hashes: Sequence[int], now: float) -> Node:
        """Make ``hashes`` a path ending exactly at a node boundary; return that node."""
        node, m = self.match(hashes)
        return self.extend(node, m, hashes, now)

    def extend(self, node: Node, matched: int, hashes: Sequence[int], now: float) -> Node:
        """``insert`` reusing a ``match`` result: split on a partial match, add the rest
        as a leaf."""
        if matched and matched < node.start + len(node.hashes):
            node = self._split(node, matched - node.start)
        if matched == len(hashes):
            if self.n_nodes > self.max_nodes:  # the split above
                self._evict_lru_leaves(node)
            return node
        leaf = Node(hash_run(hashes[matched:]), matched, node, last_access=now,
                    nid=self._next_nid)
        self._next_nid += 1
        node.children[hashes[matched]] = leaf
        self._lru.push((now, leaf.nid, leaf))
        self._index_q.append(leaf)
        self._index_q_hashes += len(leaf.hashes)
        if self._index_q_hashes >= INDEX_QUEUE_HASHES:
            self._flush_index()
        if self._dirty is not None:
            self._dirty[leaf] = None
        self.n_nodes += 1
        self.n_blocks += len(leaf.hashes)
        if self.n_nodes > self.max_nodes or self.n_blocks > self.max_blocks:
            # Over budget: the least recently used leaves go now, a few at a time, so no
            # decision ever waits for a pass over the whole tree.
            self._evict_lru_leaves(leaf)
        return leaf

    def record(self, node: Node, matched: int, hashes: Sequence[int], worker: str,
               now: float) -> Node:
        """``extend`` then ``touch``: a routing decision for ``hashes`` (matched up to
        ``node``/``matched``) sent to ``worker``, recorded at once. Returns the leaf."""
        if matched != len(hashes) or matched != node.start + len(node.hashes):
            node = self.extend(node, matched, hashes, now)
        self.touch(node, worker, now)
        return node

    def record_path(self, node: Node, matched: int, worker: str, now: float) -> Node:
        """``record`` of the matched part of a path only (``matched`` > 0 blocks, ending in
        ``node``), i.e. ``record(node, matched, hashes[:matched], worker, now)`` without
        the slice: split ``node`` where the match ends inside it, then ``touch``. Returns
        the node the path ends in."""
        if matched < node.start + len(node.hashes):
            node = self._split(node, matched - node.start)
        self.touch(node, worker, now)
        return node

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after ``k`` blocks; a new node takes the upper part (returned)."""
        parent = node.parent
        assert parent is not None and node.alive and 0 < k < len(node.hashes)
        upper = Node(
            node.hashes[:k],
            node.start,
            parent,
            workers=dict.fromkeys(node.workers, 0),  # stamps set below
            counts=dict(node.counts),
            last_access=node.last_access,
            nid=self._next_nid,
        )
        self._next_nid += 1
        if self._dirty is not None:
            self._dirty[upper] = None
            self._dirty[node] = None
        node.hashes = node.hashes[k:]
        node.start += k
        node.parent = upper
        upper.children[node.hashes[0]] = node
        parent.children[upper.hashes[0]] = upper
        self._index_q.append(upper)  # its hashes still point at ``node`` until the flush
        self._index_q_hashes += len(upper.hashes)
        # The upper part goes to the end of its workers' LRU orders, and so do the
        # ancestors each of them holds, nearest first: an ancestor must sit after its
        # descendants in every LRU order (evicting it first would orphan them). Fresh
        # stamps to match, so a restored order equals the live one.
        stamp = self._stamp
        for w in upper.workers:
            lru = self._wlru[w]
            held: Node | None = upper
            while held is not None and held is not self.root:
                if w in held.workers:
                    lru[held] = None
                    lru.move_to_end(held)
                    held.workers[w] = stamp
                    stamp += 1
                    if self._dirty is not None:
                        self._dirty[held] = None
                held = held.parent
        self._stamp = stamp
        self.n_nodes += 1
        return upper

    # ------------------------------------------------------------------ routing decisions

    def add_worker(self, worker: str) -> None:
        """Register a worker (idempotent)."""
        if worker not in self._wlru:
            self._wlru[worker] = OrderedDict()
            self.worker_blocks[worker] = 0

    def touch(self, leaf: Node, worker: str, now: float, count: bool = True) -> int:
        """Record that ``worker`` serves (and so caches) the path to ``leaf``.

        Adds the worker to every node's caching set, refreshes its LRU order leaf -> root,
        and (``count``) increments the window counts. Returns blocks newly cached.
        """
        wlru = self._wlru.get(worker)
        if wlru is None:
            self.add_worker(worker)
            wlru = self._wlru[worker]
        root = self.root
        dirty = self._dirty
        stamp = self._stamp
        added = 0
        node = leaf
        while node is not root:
            ws = node.workers
            if worker in ws:
                wlru.move_to_end(node)
            else:
                wlru[node] = None
                added += len(node.hashes)
            ws[worker] = stamp  # leaf -> root: an ancestor's stamp exceeds its descendants'
            stamp += 1
            if count:
                c = node.counts
                c[worker] = c.get(worker, 0) + 1
            node.last_access = now
            if dirty is not None:
                dirty[node] = None
            node = node.parent  # type: ignore[assignment]
        self._stamp = stamp
        if added:
            self.worker_blocks[worker] += added
        return added

    def release(self, leaf: Node, worker: str) -> None:
        """Undo one ``touch(count=True)`` of ``worker`` on the path to ``leaf`` (window expiry)."""
        dirty = self._dirty
        node: Node | None = leaf
        while node is not None:
            c = node.counts
            v = c.get(worker)
            if v is not None:
                if v > 1:
                    c[worker] = v - 1
                else:
                    del c[worker]
                if dirty is not None and node.alive:
                    dirty[node] = None
            node = node.parent
        if not leaf.counts and not leaf.workers and not leaf.children:
            self._prune_q.append(leaf)

    # ------------------------------------------------------------------ KV events

    def store(self, worker: str, parent_hash: int | None, hashes: list[int], now: float) -> bool:
        """BlockStored: ``worker`` now caches ``hashes`` (a chain continuing ``parent_hash``).

        Returns False when the chain cannot be placed (unknown parent: the caller may ask
        the worker for a resync).
        """
        if not hashes:
            return True
        last = hashes[-1]
        node = self.node_of(last)
        if node is not None:
            if worker in node.workers:
                return True  # already known (the routing decision recorded it)
            off = node.hashes.index(last) + 1
            if off < len(node.hashes):
                node = self._split(node, off)
            self.touch(node, worker, now, count=False)
            return True
        if parent_hash is None:
            chain = hashes
        else:
            pnode = self.node_of(parent_hash)
            if pnode is None:
                self.orphan_stores += 1
                return False
            chain = self._chain_to(pnode, pnode.hashes.index(parent_hash) + 1) + hashes
        leaf = self.insert(chain, now)
        if leaf.alive:
            self.touch(leaf, worker, now, count=False)
        return True

    def _chain_to(self, node: Node, upto: int) -> list[int]:
        """Block hashes from the root through ``node.hashes[:upto]``."""
        parts = [node.hashes[:upto]]
        node = node.parent  # type: ignore[assignment]
        while node is not self.root:
            parts.append(node.hashes)
            node = node.parent  # type: ignore[assignment]
        out: list[int] = []
        for p in reversed(parts):
            out.extend(p)
        return out

    def remove_blocks(self, worker: str, hashes: Iterable[int]) -> None:
        """BlockRemoved: ``worker`` lost these blocks and, with them, every later block of
        their prefixes (a prefix cache cannot use a block whose parent is gone)."""
        if self._index_q:
            self.flush()
        # Node -> the first of its blocks named (where the worker's copy is cut).
        cut: dict[Node, int] = {}
        get = self._index.get
        seq = hashes if isinstance(hashes, list) else list(hashes)
        i, n = 0, len(seq)
        while i < n:
            h = seq[i]
            node = get(h)
            if node is None:
                i += 1
                continue
            held = node.hashes
            pos = held.index(h)
            if worker in node.workers and pos < cut.get(node, pos + 1):
                cut[node] = pos
            # Evictions name long runs of one node's blocks: the rest of a run that
            # continues in the node's order needs no lookup (compared as one slice).
            k = min(len(held) - pos, n - i)
            i += k if k > 1 and list(held[pos : pos + k]) == seq[i : i + k] else 1
        for node in sorted(cut, key=lambda nd: nd.start):
            if not node.alive or worker not in node.workers:
                continue  # already dropped with an ancestor
            off = cut[node]
            if off:
                self._split(node, off)  # the new upper part stays cached
            self.drop_subtree(node, worker)

    def drop_subtree(self, node: Node, worker: str) -> int:
        """Remove ``worker`` from ``node`` and every descendant it caches; returns blocks freed."""
        wlru = self._wlru.get(worker)
        if wlru is None:
            return 0
        freed = 0
        stack = [node]
        while stack:
            n = stack.pop()
            if worker not in n.workers:
                continue
            del n.workers[worker]
            wlru.pop(n, None)
            freed += len(n.hashes)
            self._changed(n)
            self._prune_up(n)
            stack.extend(n.children.values())
        self.worker_blocks[worker] -= freed
        return freed

    def apply_events(self, worker: str, events: Iterable[KvEvent], now: float) -> None:
        """A worker's KV events, in order: BlockStored adds the worker to the blocks'
        caching sets, BlockRemoved and AllBlocksCleared take it out. Events about blocks
        outside GPU memory (vLLM's offload tiers) are not the prefix cache routing sees."""
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.medium in GPU_MEDIA:
                    self.store(worker, ev.parent_block_hash, ev.block_hashes, now)
            elif isinstance(ev, BlockRemoved):
                if ev.medium in GPU_MEDIA:
                    self.remove_blocks(worker, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear_worker(worker)

    def clear_worker(self, worker: str, forget: bool = False) -> None:
        """AllBlocksCleared (or ``forget``: the worker left): it caches nothing any more."""
        wlru = self._wlru.get(worker)
        if wlru is None:
            return
        nodes = list(wlru)
        wlru.clear()
        for n in nodes:
            n.workers.pop(worker, None)
            self._changed(n)
            self._prune_up(n)
        self.worker_blocks[worker] = 0
        if forget:
            del self._wlru[worker]
            del self.worker_blocks[worker]

    def evict_lru(self, worker: str, blocks: int, protect: Node | None = None) -> int:
        """Model ``worker``'s own LRU eviction of at least ``blocks`` blocks.

        Stops at ``protect`` (the path just refreshed sits at the end of the order, so
        everything after it is on that path too). Returns blocks evicted.
        """
        wlru = self._wlru.get(worker)
        freed = 0
        while wlru and freed < blocks:
            node = next(iter(wlru))
            if node is protect:
                break
            del wlru[node]
            node.workers.pop(worker, None)
            freed += len(node.hashes)
            self._changed(node)
            self._prune_up(node)
        if freed:
            self.worker_blocks[worker] -= freed
        return freed

    # ------------------------------------------------------------------ pruning and budget

    def _changed(self, node: Node) -> None:
        if self._dirty is not None:
            self._dirty[node] = None

    def _prune_up(self, node: Node) -> None:
        """Queue ``node`` for pruning if it looks unused (checked again when flushed)."""
        if not node.children and not node.workers and not node.counts:
            self._prune_q.append(node)
            if len(self._prune_q) > PRUNE_QUEUE_LIMIT:
                self.flush()

    def _flush_index(self) -> None:
        """Point the queued nodes' hashes to them in the index."""
        q, self._index_q = self._index_q, []
        queued, self._index_q_hashes = self._index_q_hashes, 0
        put = self._index.put
        for n in q:
            if n.alive:
                put(n.hashes, n)
        self._index.trim(self.n_blocks, TRIM_PER_PUT * queued)

    def flush(self) -> None:
        """Apply queued index updates, then remove unused nodes: no cacher, no request in
        the window, no children (and their ancestors that end up the same)."""
        self._flush_index()
        q, self._prune_q = self._prune_q, []
        root = self.root
        for node in q:
            while not node.alive:
                node = node.parent  # type: ignore[assignment]
            while node is not root and not node.children and not node.workers and not node.counts:
                parent = node.parent
                self._detach(node)
                node = parent  # type: ignore[assignment]

    def maintain(self) -> None:
        """Periodic upkeep (the owner's ``tick``): flush the queues, enforce the budget."""
        self.flush()
        if self.n_nodes > self.max_nodes or self.n_blocks > self.max_blocks:
            # A few nodes split by KV events or peers' decisions, or a smaller budget.
            self._evict_lru_leaves(None)
            self.flush()
        if len(self._lru) > 2 * self.n_nodes + LRU_SLACK_ENTRIES:
            self._compact_lru()  # nodes pruned by KV events and the window, never popped

    def _detach(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.hashes[0]]
        if not parent.children and parent is not self.root:
            self._lru.push((parent.last_access, parent.nid, parent))
        for w in node.workers:
            self._wlru[w].pop(node, None)
            self.worker_blocks[w] -= len(node.hashes)
        node.workers = {}
        node.alive = False
        if self._dirty is not None:
            self._dirty.pop(node, None)
            if node.nid < self._unsaved_from:  # handed to a writer before: delete it
                self._gone.append(node.nid)
        self.n_nodes -= 1
        self.n_blocks -= len(node.hashes)

    def _evict_lru_leaves(self, keep: Node | None) -> int:
        """Detach least recently accessed leaves (never ``keep``, a node just inserted)
        until the tree is within its budget; their emptied ancestors are queued for
        pruning. Routing keeps the tree within it so, a leaf for each node it adds beyond
        it (``extend``), and ``maintain`` catches up with the rest (nodes split by KV events
        or peers' decisions, a smaller budget). Dropped nodes may still be cached or used in
        the window: the budget wins, so memory stays bounded. Returns how many were dropped."""
        lru = self._lru
        pop, push = lru.pop, lru.push
        kept: list[tuple[float, int, Node]] = []
        dropped = 0
        while lru and (self.n_nodes > self.max_nodes or self.n_blocks > self.max_blocks):
            entry = pop()
            n = entry[2]
            if not n.alive or n.children:
                continue  # gone, or no leaf now (pushed again if it becomes one)
            if n.last_access != entry[0]:
                push((n.last_access, entry[1], n))  # touched since: later in line
                continue
            if n is keep:
                kept.append(entry)
                continue
            parent = n.parent
            self._detach(n)
            self._prune_up(parent)  # type: ignore[arg-type]
            dropped += 1
        for entry in kept:
            push(entry)
        self.budget_evictions += dropped
        return dropped

    def _compact_lru(self) -> None:
        """Drop the entries of dead nodes (pruned outside the budget, never popped)."""
        self._lru = LeafQueue(e for e in self._lru if e[2].alive)

    def _rebuild_lru(self) -> None:
        """The eviction order of a tree built at once (a restore): every leaf."""
        self._lru = LeafQueue((n.last_access, n.nid, n) for n in self.nodes()
                              if not n.children and n is not self.root)

    # ------------------------------------------------------------------ persistence

    def shift_times(self, delta: float) -> None:
        """Add ``delta`` seconds to every stored time (rebasing onto another clock)."""
        for n in self.nodes():
            n.last_access += delta
        # The same shift for every key keeps the queue's order.
        self._lru = LeafQueue((t + delta, nid, n) for t, nid, n in self._lru)

    def dump_state(self, ref_time: float) -> tuple[TreeState, dict[Node, int]]:
        """Snapshot as a struct (times relative to ``ref_time``) and the node -> index map."""
        self.flush()
        order = list(self.nodes())
        ids = {n: i for i, n in enumerate(order)}
        ids[self.root] = -1
        nodes = [
            NodeState(
                parent=ids[n.parent],  # type: ignore[index]
                hashes=list(n.hashes),
                workers=sorted(n.workers),
                counts=n.counts,
                last_access=n.last_access - ref_time,
            )
            for n in order
        ]
        state = TreeState(
            version=SNAPSHOT_VERSION,
            block_size=self.block_size,
            nodes=nodes,
            worker_lru={w: [ids[n] for n in lru] for w, lru in self._wlru.items()},
        )
        return state, ids

    def load_state(self, state: TreeState, ref_time: float) -> list[Node]:
        """Replace the tree by ``state`` (times shifted by ``ref_time``); returns nodes by index."""
        if state.version != SNAPSHOT_VERSION or state.block_size != self.block_size:
            raise ValueError(
                f"incompatible tree snapshot (version {state.version}, block {state.block_size})"
            )
        self._init_state()
        nodes: list[Node] = []
        idx = self._index
        for rec in state.nodes:
            parent = self.root if rec.parent < 0 else nodes[rec.parent]
            n = Node(
                hash_run(rec.hashes),
                parent.start + len(parent.hashes),
                parent,
                workers=dict.fromkeys(rec.workers, 0),
                counts=dict(rec.counts),
                last_access=rec.last_access + ref_time,
                nid=self._next_nid,
            )
            self._next_nid += 1
            parent.children[n.hashes[0]] = n
            idx.put(n.hashes, n)
            nodes.append(n)
            self.n_nodes += 1
            self.n_blocks += len(n.hashes)
        for w, order in state.worker_lru.items():
            self.add_worker(w)
            lru = self._wlru[w]
            for i in order:
                lru[nodes[i]] = None
                nodes[i].workers[w] = self._stamp
                self._stamp += 1
            self.worker_blocks[w] = sum(len(nodes[i].hashes) for i in order)
        self._rebuild_lru()
        return nodes

    # ------------------------------------------------------------------ incremental persistence

    def track_changes(self) -> None:
        """Start (or restart) recording changed and pruned nodes for ``take_changes``."""
        self._dirty = {}
        self._gone = []
        self._unsaved_from = self._next_nid

    def take_changes(self) -> tuple[list[Node], list[int]]:
        """Nodes changed and ids of nodes pruned since the last call (O(1): the containers
        are handed over, not copied). Changed nodes may be pruned by the time they are
        encoded: ``node_record`` of a dead node is None."""
        if self._dirty is None:
            raise RuntimeError("change tracking is off (call track_changes first)")
        if self._index_q or self._prune_q:
            self.flush()
        dirty, self._dirty = self._dirty, {}
        gone, self._gone = self._gone, []
        self._unsaved_from = self._next_nid
        return list(dirty), gone

    @property
    def next_nid(self) -> int:
        """The id the next node will get (persisted so ids are never reused)."""
        return self._next_nid

    def node_record(self, node: Node, offset: float) -> bytes | None:
        """msgpack of one live node (times + ``offset``), None if it was pruned."""
        if not node.alive:
            return None
        parent = node.parent
        run = node.hashes
        return _ENCODER.encode(
            NodeRecord(
                node.nid,
                -1 if parent is self.root else parent.nid,  # type: ignore[union-attr]
                node.start,
                packed_run(run) if type(run) is array else run,  # type: ignore[arg-type]
                node.workers,
                node.counts,
                node.last_access + offset,
            )
        )

    def load_records(
        self, blobs: Iterable[bytes], offset: float, next_nid: int = 0
    ) -> dict[int, Node]:
        """Replace the tree by ``node_record`` blobs (times + ``offset``); returns nid -> node.

        The records may come from different moments (they are written a slice at a time):
        a node is kept only if its parent was kept, its run starts where the parent's ends
        and no kept sibling starts with the same hash; the rest are dropped (with their
        subtrees). Each worker's LRU order is rebuilt from the stamps.
        """
        recs = sorted((_RECORD_DECODER.decode(b) for b in blobs), key=lambda r: r.start)
        self._init_state()
        by_id: dict[int, Node] = {-1: self.root}
        idx = self._index
        top_nid = next_nid
        top_stamp = 0
        for r in recs:
            top_nid = max(top_nid, r.nid + 1)
            parent = by_id.get(r.parent)
            try:
                run = unpack_hashes(r.hashes) if isinstance(r.hashes, bytes) else r.hashes
            except ValueError:  # packed bytes that are not whole int64s
                continue
            if (
                parent is None
                or not run
                or parent.start + len(parent.hashes) != r.start
                or run[0] in parent.children
            ):
                continue
            n = Node(run, r.start, parent, workers=r.workers, counts=r.counts,
                     last_access=r.last_access + offset, nid=r.nid)
            parent.children[run[0]] = n
            idx.put(n.hashes, n)
            by_id[r.nid] = n
            self.n_nodes += 1
            self.n_blocks += len(n.hashes)
            for st in r.workers.values():
                top_stamp = max(top_stamp, st)
        self._next_nid = top_nid
        self._stamp = top_stamp + 1
        # LRU per worker: by stamp; equal stamps (a split copies them) put the deeper first.
        per_worker: dict[str, list[tuple[int, int, Node]]] = {}
        for n in by_id.values():
            for w, st in n.workers.items():
                per_worker.setdefault(w, []).append((st, -n.start, n))
        for w, items in per_worker.items():
            items.sort(key=lambda x: (x[0], x[1]))
            self.add_worker(w)
            lru = self._wlru[w]
            for _, _, n in items:
                lru[n] = None
            self.worker_blocks[w] = sum(len(n.hashes) for _, _, n in items)
        del by_id[-1]
        self._rebuild_lru()
        return by_id

    def snapshot(self) -> bytes:
        """msgpack bytes of the whole tree (times kept as stored)."""
        return _ENCODER.encode(self.dump_state(0.0)[0])

    def restore(self, data: bytes) -> None:
        """Replace the tree by a ``snapshot()``."""
        self.load_state(_TREE_DECODER.decode(data), 0.0)
