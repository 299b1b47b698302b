"""Bookkeeping the baseline policies share: outstanding requests, load reports, snapshots.

Baselines know what their projects' routers know: their own routing decisions minus
completions (outstanding requests, tokens, blocks), and the workers' latest load reports.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import msgspec

from prefixmesh.services.scheduler.policies.base import (
    Changes,
    Decision,
    NoWorkerError,
    PolicyConfig,
    PolicySummary,
    RouteInput,
)
from prefixmesh.services.scheduler.prefix_tree import Node, PrefixTree, TreeState
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.wire import KvEvent, LoadReportEvent, RequestDoneEvent, RoutedRequest

VERSION = 1


@dataclass(slots=True)
class _Req:
    worker: str
    tokens: int
    blocks: int
    t: float


class Outstanding:
    """Requests routed and not yet completed, per worker (count, tokens, KV blocks)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # Insertion-ordered: the oldest request is first (TTL expiry pops from the front).
        self.reqs: dict[str, _Req] = {}
        self.count: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.blocks: dict[str, int] = {}

    def add(self, rid: str, worker: str, tokens: int, blocks: int, now: float) -> None:
        """A request was routed to ``worker``."""
        if rid in self.reqs:
            self.done(rid)  # a retry: the earlier attempt no longer counts
        self.reqs[rid] = _Req(worker, tokens, blocks, now)
        self.count[worker] = self.count.get(worker, 0) + 1
        self.tokens[worker] = self.tokens.get(worker, 0) + tokens
        self.blocks[worker] = self.blocks.get(worker, 0) + blocks

    def done(self, rid: str) -> None:
        """A request completed (or was abandoned)."""
        r = self.reqs.pop(rid, None)
        if r is None:
            return
        w = r.worker
        if w in self.count:
            self.count[w] -= 1
            self.tokens[w] -= r.tokens
            self.blocks[w] -= r.blocks

    def expire(self, now: float) -> None:
        """Forget requests with no completion record after the TTL."""
        cut = now - self.ttl_s
        reqs = self.reqs
        while reqs:
            rid = next(iter(reqs))
            if reqs[rid].t >= cut:
                break
            self.done(rid)

    def add_worker(self, worker: str) -> None:
        """Start counting for ``worker``."""
        self.count.setdefault(worker, 0)
        self.tokens.setdefault(worker, 0)
        self.blocks.setdefault(worker, 0)

    def drop_worker(self, worker: str) -> None:
        """Stop counting for ``worker`` (its requests are retried elsewhere)."""
        self.count.pop(worker, None)
        self.tokens.pop(worker, None)
        self.blocks.pop(worker, None)


class _OutRec(msgspec.Struct, array_like=True):
    rid: str
    worker: str
    tokens: int
    blocks: int
    t: float


class BaselineState(msgspec.Struct, array_like=True):
    """Snapshot of any baseline: workers, outstanding requests, counter, optional tree."""

    version: int
    policy: str
    workers: dict[str, int]
    outstanding: list[_OutRec]
    counter: int = 0
    tree: TreeState | None = None


class BaselineMeta(msgspec.Struct, array_like=True):
    """Incremental persistence: everything but the tree (times in the writer's epoch)."""

    version: int
    policy: str
    workers: dict[str, int]
    outstanding: list[_OutRec]
    counter: int
    next_nid: int


_DECODER = msgspec.msgpack.Decoder(BaselineState)
_META_DECODER = msgspec.msgpack.Decoder(BaselineMeta)
_ENCODER = msgspec.msgpack.Encoder()


class BaselinePolicy:
    """Common shell of the baselines: membership, outstanding requests, load reports."""

    name = "baseline"
    # Whether the policy keeps a prefix tree (persisted with the snapshot).
    uses_tree = False

    def __init__(self, config: PolicyConfig, cost: CostModel) -> None:
        self.cfg = config
        self.cost = cost
        self.block = cost.block_size
        self._capacity: dict[str, int] = {}  # worker -> KV capacity (tokens), in add order
        self.out = Outstanding(config.outstanding_ttl_s)
        self.reports: dict[str, LoadReportEvent] = {}
        self.tree = self.new_tree()
        self.counter = 0
        self._now = 0.0
        self._rebase = False
        self.state = BaselinePersistence(self)

    def new_tree(self) -> PrefixTree:
        """An empty prefix tree within the configured bounds."""
        return PrefixTree(self.cfg.tree_max_nodes, self.cfg.tree_max_tokens, self.block)

    @property
    def workers(self) -> Collection[str]:
        """Registered worker ids, in the order they joined."""
        return self._capacity.keys()

    def clock(self, now: float) -> None:
        """Note the caller's time; after ``restore``, rebase the stored relative times on it."""
        if self._rebase:
            self._rebase = False
            for r in self.out.reqs.values():
                r.t += now
            self.tree.shift_times(now)
        self._now = now

    def add_worker(self, worker_id: str, capacity_tokens: int, now: float) -> None:
        """Register a worker (idempotent)."""
        self.clock(now)
        cap = capacity_tokens if capacity_tokens > 0 else self.cost.kv_capacity_tokens
        self._capacity[worker_id] = cap
        self.out.add_worker(worker_id)
        self.tree.add_worker(worker_id)

    def remove_worker(self, worker_id: str, now: float) -> None:
        """Drop a worker from routing."""
        self.clock(now)
        if self._capacity.pop(worker_id, None) is None:
            return
        self.out.drop_worker(worker_id)
        self.reports.pop(worker_id, None)
        self.tree.clear_worker(worker_id, forget=True)

    def eligible(self, req: RouteInput) -> list[str]:
        """Workers the request may go to, in join order; raises when there are none."""
        ws = list(self._capacity)
        if req.exclude:
            ws = [w for w in ws if w not in req.exclude]
        if not ws:
            raise NoWorkerError("no eligible worker")
        return ws

    def assigned(self, req: RouteInput, worker: str, now: float) -> None:
        """Book the request as outstanding on ``worker``."""
        blocks = math.ceil((req.prompt_tokens + req.predicted_output) / self.block)
        self.out.add(req.request_id, worker, req.prompt_tokens, blocks, now)

    def apply_remote_decision(self, req: RouteInput, decision: Decision, now: float) -> None:
        """Another replica routed ``req``: book it as outstanding on the chosen worker (a
        retried request id counts once, on its latest worker); baselines whose cache view
        is their own decisions also record the prompt there (``remember_remote``)."""
        self.clock(now)
        if decision.worker_id not in self._capacity:
            return
        self.remember_remote(req, decision.worker_id, now)
        self.assigned(req, decision.worker_id, now)

    def apply_routed(self, d: RoutedRequest, hashes: Sequence[int], now: float) -> None:
        """A peer's decision off the wire: as ``apply_remote_decision`` (baselines are not
        on the path the replicas' throughput is measured on, so it builds the inputs)."""
        self.apply_remote_decision(
            RouteInput(request_id=d.request_id, block_hashes=hashes,
                       prompt_tokens=d.prompt_tokens, max_tokens=d.max_tokens,
                       tenant=d.tenant, predicted_output=d.predicted_output),
            Decision(d.worker_id, d.kind, d.matched_tokens), now)

    def remember_remote(self, req: RouteInput, worker: str, now: float) -> None:
        """Record a remote decision in the cache view; nothing for baselines without one."""

    def on_kv_events(self, worker_id: str, events: list[KvEvent], now: float) -> None:
        """Most baselines ignore the workers' caches."""

    def on_load(self, report: LoadReportEvent, now: float) -> None:
        """Keep the latest load report of each worker."""
        self.clock(now)
        if report.worker_id in self._capacity:
            self.reports[report.worker_id] = report

    def on_done(self, done: RequestDoneEvent, now: float) -> None:
        """The request no longer counts as outstanding."""
        self.clock(now)
        self.out.done(done.request_id)

    def tick(self, now: float) -> None:
        """Forget outstanding requests that never completed."""
        self.clock(now)
        self.out.expire(now)
        self.tree.maintain()

    def summary(self) -> PolicySummary:
        """The tree (for the scheduler's statistics), when the baseline keeps one."""
        return PolicySummary(tree=self.tree if self.uses_tree else None)


class BaselinePersistence:
    """A baseline's state in Redis (the scheduler's ``store.py``): workers, outstanding
    requests, the counter and the tree; kept apart from routing, which never waits on it."""

    def __init__(self, policy: BaselinePolicy) -> None:
        self.policy = policy

    def snapshot(self) -> bytes:
        """Workers, outstanding requests, counter and tree as msgpack."""
        ref = self.policy._now
        state = BaselineState(
            version=VERSION,
            policy=self.policy.name,
            workers=dict(self.policy._capacity),
            outstanding=[
                _OutRec(rid, r.worker, r.tokens, r.blocks, r.t - ref)
                for rid, r in self.policy.out.reqs.items()
            ],
            counter=self.policy.counter,
            tree=self.policy.tree.dump_state(ref)[0] if self.policy.uses_tree else None,
        )
        return _ENCODER.encode(state)

    def restore(self, data: bytes) -> None:
        """Replace the state by a ``snapshot()``; times are rebased on the next call."""
        state = _DECODER.decode(data)
        if state.version != VERSION or state.policy != self.policy.name:
            raise ValueError(
                f"snapshot of {state.policy!r} v{state.version} given to {self.policy.name!r}"
            )
        self.policy._capacity = {}
        self.policy.out = Outstanding(self.policy.cfg.outstanding_ttl_s)
        self.policy.reports = {}
        self.policy.tree = self.policy.new_tree()
        if state.tree is not None:
            self.policy.tree.load_state(state.tree, 0.0)
        self.policy._rebase = False
        for w, cap in state.workers.items():
            self.policy.add_worker(w, cap, 0.0)
        for r in state.outstanding:
            self.policy.out.add(r.rid, r.worker, r.tokens, r.blocks, r.t)
        self.policy.counter = state.counter
        # Stored times are relative to the snapshot's last ``now``.
        self.policy._rebase = True

    @property
    def log_window_s(self) -> float:
        """Baselines keep no window log."""
        return 0.0

    def track_changes(self) -> None:
        """Start recording tree changes for ``take_changes``."""
        self.policy.tree.track_changes()

    def take_changes(self) -> Changes:
        """Changed and pruned tree nodes since the last call (O(1))."""
        nodes, gone = self.policy.tree.take_changes()
        return Changes(nodes, gone, [])

    def all_state(self) -> Changes:
        """The whole tree, as changes."""
        return Changes(self.policy.tree.nodes(), [], [])

    def encode_node(self, node: Node, offset: float) -> bytes | None:
        """One tree node's record (None once pruned)."""
        return self.policy.tree.node_record(node, offset)

    def encode_log(self, items: list, offset: float) -> tuple[bytes, float]:
        """Never called: baselines have no log."""
        raise NotImplementedError("baselines keep no window log")

    def encode_meta(self, offset: float) -> bytes:
        """Workers, outstanding requests and the counter."""
        return _ENCODER.encode(BaselineMeta(
            version=VERSION,
            policy=self.policy.name,
            workers=dict(self.policy._capacity),
            outstanding=[_OutRec(rid, r.worker, r.tokens, r.blocks, r.t + offset)
                         for rid, r in self.policy.out.reqs.items()],
            counter=self.policy.counter,
            next_nid=self.policy.tree.next_nid,
        ))

    def load_persisted(self, meta: bytes, nodes: list[bytes], segments: list[bytes],
                       offset: float, now: float) -> None:
        """Replace the state by persisted pieces (times + ``offset`` = the caller's clock)."""
        m = _META_DECODER.decode(meta)
        if m.version != VERSION or m.policy != self.policy.name:
            raise ValueError(f"state of {m.policy!r} v{m.version} given to {self.policy.name!r}")
        self.policy._capacity = {}
        self.policy.out = Outstanding(self.policy.cfg.outstanding_ttl_s)
        self.policy.reports = {}
        self.policy.tree = self.policy.new_tree()
        self.policy.tree.load_records(nodes, offset, m.next_nid)
        self.policy._rebase = False
        for w, cap in m.workers.items():
            self.policy.add_worker(w, cap, now)
        for r in m.outstanding:
            self.policy.out.add(r.rid, r.worker, r.tokens, r.blocks, r.t + offset)
        self.policy.counter = m.counter
        self.policy._now = now
