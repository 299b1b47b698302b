"""E2 snapshots for Redis persistence: msgspec structs, msgpack, no pickle.

Times are stored relative to the policy's last ``now`` and rebased onto the clock of the
first call after ``restore``, so a standby on another host (another monotonic clock) can
take over. Load reports and queueing-time samples are not persisted: workers send fresh
ones every 250 ms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from prefixmesh.services.scheduler.policies.base import Changes
from prefixmesh.services.scheduler.policies.e2_load import (
    LoadWindow,
    WindowEntry,
    WorkerState,
)
from prefixmesh.services.scheduler.policies.e2_replicate import Replica, Replicator
from prefixmesh.services.scheduler.prefix_tree import Node, PrefixTree, TreeState

VERSION = 1


@dataclass(slots=True)
class E2Parts:
    """The parts of E2's state that persist, handed over by the policy (which this module
    does not know): loading fills them in place."""

    tree: PrefixTree
    workers: dict[str, WorkerState]
    # Workers marked decode-heavy (not persisted: cleared on load).
    decode_heavy: set[str]
    window: LoadWindow
    replicator: Replicator
    # The load window's length H (seconds): older log entries are dropped on load.
    window_s: float
    # The policy's last ``now``: snapshot times are stored relative to it.
    now: float = 0.0
_NONE = -2  # node reference meaning "no node"


class WorkerRec(msgspec.Struct, array_like=True):
    id: str
    capacity_blocks: int


class EntryRec(msgspec.Struct, array_like=True):
    t: float
    worker: str
    cost: float
    node: int
    rid: str
    dt_tok: float
    out_est: float


class ReplicaRec(msgspec.Struct, array_like=True):
    node: int
    pending: list[str]
    added: list[str]
    changed: float
    peak: int


class E2State(msgspec.Struct, array_like=True):
    version: int
    tree: TreeState
    workers: list[WorkerRec]
    window: list[EntryRec]
    outputs: list[tuple[float, int]]
    replicas: list[ReplicaRec]


_DECODER = msgspec.msgpack.Decoder(E2State)
_ENCODER = msgspec.msgpack.Encoder()


def dump(parts: E2Parts, ref: float) -> bytes:
    """Encode the state, times relative to ``ref`` (the policy's last ``now``)."""
    tree_state, ids = parts.tree.dump_state(ref)

    def ref_of(node: Node | None) -> int:
        if node is None:
            return _NONE
        while not node.alive:  # pruned since: its alive ancestor carries the counts
            parent = node.parent
            assert parent is not None  # a pruned node was detached from a parent; root lives
            node = parent
        return ids[node]

    state = E2State(
        version=VERSION,
        tree=tree_state,
        workers=[
            WorkerRec(ws.id, ws.capacity_blocks) for ws in parts.workers.values()
        ],
        window=[
            EntryRec(e.t - ref, e.ws.id, e.cost, ref_of(e.leaf), e.rid, e.dt_tok, e.out_est)
            for e in parts.window.entries
        ],
        outputs=[(t - ref, n) for t, n in parts.window.outputs],
        replicas=[
            ReplicaRec(ids[n], list(r.pending), list(r.added), r.changed - ref, r.peak)
            for n, r in parts.replicator.entries.items()
            if n.alive
        ],
    )
    return _ENCODER.encode(state)


def load(parts: E2Parts, data: bytes) -> None:
    """Replace the state by ``data`` (times stay relative until ``rebase``)."""
    state = _DECODER.decode(data)
    if state.version != VERSION:
        raise ValueError(f"unsupported E2 snapshot version {state.version}")
    tree = parts.tree
    nodes = tree.load_state(state.tree, 0.0)

    def node_at(i: int) -> Node | None:
        if i == _NONE:
            return None
        return tree.root if i < 0 else nodes[i]

    parts.workers.clear()
    parts.decode_heavy.clear()
    for rec in state.workers:
        parts.workers[rec.id] = WorkerState(rec.id, rec.capacity_blocks)
        tree.add_worker(rec.id)
    window = parts.window
    window.light = None
    window.entries.clear()
    window.by_rid.clear()
    gone: dict[str, WorkerState] = {}  # workers removed before the snapshot
    for er in state.window:
        ws = parts.workers.get(er.worker)
        if ws is None:
            ws = gone.get(er.worker)
            if ws is None:
                ws = gone[er.worker] = WorkerState(er.worker, 0)
                ws.alive = False
        leaf = node_at(er.node) or tree.root
        e = WindowEntry(er.t, ws, er.cost, leaf, er.rid, er.dt_tok, er.out_est)
        window.entries.append(e)
        if er.rid:
            window.track(e, in_flight=False)
        ws.L += er.cost
        ws.n += 1
    window.outputs.clear()
    window.outputs.extend((t, n) for t, n in state.outputs)
    window.out_sum = sum(n for _, n in state.outputs)
    rep = parts.replicator
    rep.entries = {}
    for rr in state.replicas:
        r = Replica(rr.changed, rr.peak)
        r.pending = list(rr.pending)
        r.added = list(rr.added)
        rep.entries[nodes[rr.node]] = r


def rebase(parts: E2Parts, now: float) -> None:
    """Shift every restored (relative) time onto the caller's clock."""
    parts.tree.shift_times(now)
    parts.window.shift(now)
    for r in parts.replicator.entries.values():
        r.changed += now


# --------------------------------------------------------------------------- incremental
# The scheduler service persists E2 a piece at a time (``scheduler/store.py``): tree
# nodes by id (``PrefixTree.node_record``), the window as an append-only log of segments
# (new entries, corrected entries, completions), and a small meta record (workers, replica
# sets). Times are in the writer's epoch (``offset`` added: wall-clock seconds), so a
# standby on another host reads them back onto its own clock.


class E2Meta(msgspec.Struct, array_like=True):
    version: int
    workers: list[WorkerRec]
    # ReplicaRec.node is a node id here; ``changed`` in the epoch.
    replicas: list[ReplicaRec]
    next_nid: int


class SegmentRec(msgspec.Struct, array_like=True):
    # EntryRec.node is a node id here (-1 = root); ``t`` in the epoch.
    entries: list[EntryRec]
    outputs: list[tuple[float, int]]


_META_DECODER = msgspec.msgpack.Decoder(E2Meta)
_SEGMENT_DECODER = msgspec.msgpack.Decoder(SegmentRec)


def _nid(parts: E2Parts, node: Node) -> int:
    while not node.alive:  # pruned since: its alive ancestor carries the counts
        node = node.parent  # type: ignore[assignment]
    return -1 if node is parts.tree.root else node.nid


def encode_meta(parts: E2Parts, offset: float) -> bytes:
    """Workers and replica sets (small: written whole on every flush)."""
    return _ENCODER.encode(E2Meta(
        version=VERSION,
        workers=[WorkerRec(ws.id, ws.capacity_blocks) for ws in parts.workers.values()],
        replicas=[
            ReplicaRec(n.nid, list(r.pending), list(r.added), r.changed + offset, r.peak)
            for n, r in parts.replicator.entries.items()
            if n.alive
        ],
        next_nid=parts.tree.next_nid,
    ))


def encode_log(parts: E2Parts, items: list, offset: float) -> tuple[bytes, float]:
    """One log segment from window-journal items; returns it and its newest time (epoch)."""
    entries = []
    outputs = []
    newest = float("-inf")
    for it in items:
        if isinstance(it, WindowEntry):
            t = it.t + offset
            entries.append(EntryRec(t, it.ws.id, it.cost, _nid(parts, it.leaf), it.rid,
                                    it.dt_tok, it.out_est))
        else:
            t = it[0] + offset
            outputs.append((t, it[1]))
        if t > newest:
            newest = t
    return _ENCODER.encode(SegmentRec(entries, outputs)), newest


def load_incremental(
    parts: E2Parts,
    meta: bytes,
    nodes: list[bytes],
    segments: list[bytes],
    offset: float,
    now: float,
) -> None:
    """Replace the state by persisted pieces (times + ``offset`` = own clock).

    Window entries are deduplicated by request id (a later record corrects the cost),
    entries older than the window dropped, the rest ordered by time.
    """
    m = _META_DECODER.decode(meta)
    if m.version != VERSION:
        raise ValueError(f"unsupported E2 state version {m.version}")
    tree = parts.tree
    by_id = tree.load_records(nodes, offset, m.next_nid)
    parts.workers.clear()
    parts.decode_heavy.clear()
    for rec in m.workers:
        parts.workers[rec.id] = WorkerState(rec.id, rec.capacity_blocks)
        tree.add_worker(rec.id)
    cut = now - parts.window_s
    window = parts.window
    window.light = None
    window.entries.clear()
    window.by_rid.clear()
    entries: list[WindowEntry] = []
    keyed: dict[tuple[str, str, float], WindowEntry] = {}
    outputs: list[tuple[float, int]] = []
    gone: dict[str, WorkerState] = {}
    for blob in segments:
        seg = _SEGMENT_DECODER.decode(blob)
        for er in seg.entries:
            t = er.t + offset
            if t < cut:
                continue
            key = (er.rid, er.worker, er.t)
            e = keyed.get(key) if er.rid else None
            if e is not None:  # a correction of an entry seen before
                e.cost, e.out_est = er.cost, er.out_est
                continue
            ws = parts.workers.get(er.worker) or gone.get(er.worker)
            if ws is None:
                ws = gone[er.worker] = WorkerState(er.worker, 0)
                ws.alive = False
            leaf = by_id.get(er.node, tree.root)
            e = WindowEntry(t, ws, er.cost, leaf, er.rid, er.dt_tok, er.out_est)
            entries.append(e)
            if er.rid:
                keyed[key] = e
        outputs.extend((t + offset, n) for t, n in seg.outputs if t + offset >= cut)
    entries.sort(key=lambda e: e.t)
    for e in entries:
        window.entries.append(e)
        if e.rid:
            window.track(e, in_flight=False)
        e.ws.L += e.cost
        e.ws.n += 1
    outputs.sort()
    window.outputs.clear()
    window.outputs.extend(outputs)
    window.out_sum = sum(n for _, n in outputs)
    rep = parts.replicator
    rep.entries = {}
    for rr in m.replicas:
        node = by_id.get(rr.node)
        if node is not None:
            r = Replica(rr.changed + offset, rr.peak)
            r.pending = list(rr.pending)
            r.added = list(rr.added)
            rep.entries[node] = r


class E2Persistence:
    """E2's ``PolicyState``: its tree, window, workers and replica sets in Redis, in the
    forms above. It sees the policy only through ``parts`` (what persists) and
    ``restored`` (told when the state was replaced, with the clock its times read on, or
    None: rebase them on the next call)."""

    def __init__(self, parts: Callable[[], E2Parts],
                 restored: Callable[[float | None], None]) -> None:
        self.parts = parts
        self.restored = restored
        # The tree, which the policy keeps for good: a flush encodes it a node at a time.
        self.tree = parts().tree

    def snapshot(self) -> bytes:
        p = self.parts()
        return dump(p, p.now)

    def restore(self, data: bytes) -> None:
        load(self.parts(), data)
        self.restored(None)

    @property
    def log_window_s(self) -> float:
        """How long a window-log segment stays relevant (seconds): H."""
        return self.parts().window_s

    def track_changes(self) -> None:
        p = self.parts()
        p.tree.track_changes()
        p.window.journal = []

    def take_changes(self) -> Changes:
        """Changed nodes, pruned node ids and window-log items since the last call (O(1))."""
        p = self.parts()
        nodes, gone = p.tree.take_changes()
        return Changes(nodes, gone, p.window.take_journal())

    def all_state(self) -> Changes:
        """Everything, as changes (a full rewrite); nodes are yielded lazily."""
        p = self.parts()
        log: list = list(p.window.entries)
        log.extend(p.window.outputs)
        return Changes(p.tree.nodes(), [], log)

    def encode_node(self, node: Node, offset: float) -> bytes | None:
        return self.tree.node_record(node, offset)

    def encode_log(self, items: list, offset: float) -> tuple[bytes, float]:
        return encode_log(self.parts(), items, offset)

    def encode_meta(self, offset: float) -> bytes:
        return encode_meta(self.parts(), offset)

    def load_persisted(self, meta: bytes, nodes: list[bytes], segments: list[bytes],
                       offset: float, now: float) -> None:
        load_incremental(self.parts(), meta, nodes, segments, offset, now)
        self.restored(now)
