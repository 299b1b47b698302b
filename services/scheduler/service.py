"""Scheduler service: the global policy behind ``sched.route``, fed by KV events and loads.

The policy object is pure (``prefixmesh.services.scheduler.policies``); this shell owns the bus
subscriptions, worker liveness, KV-event sequence checking and write-behind persistence.
Routing never waits on Redis: snapshots are written by a background task.

Replicas are active-active (``replicas.py``): every replica routes from the ``sched.route``
queue group, hears every KV event, load report and completion, and charges the others'
decisions (``sched.decisions``). A booting replica joins the queue group only once it has
caught up. The Redis lease only picks the one replica that runs run-once jobs (snapshot
writes, the stats summary); routing never waits on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import msgspec
import nats.errors
import redis.asyncio as aioredis
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Gauge, Histogram

from prefixmesh.services.scheduler.engines import EngineIds
from prefixmesh.services.scheduler.lease import Lease, LeaseState
from prefixmesh.services.scheduler.place_batch import PlaceBatch
from prefixmesh.services.scheduler.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    make_policy,
)
from prefixmesh.services.scheduler.policies.base import (
    GlobalPolicy,
    NoWorkerError,
    PolicyConfig,
)
from prefixmesh.services.scheduler.replicas import (
    CatchUp,
    Peers,
    apply_peer_decisions,
    is_resync,
    route_input,
    routed,
)
from prefixmesh.services.scheduler.stats import HotPrefixWalk, build_stats
from prefixmesh.services.scheduler.store import StateStore
from prefixmesh.shared.bus import Bus, BusUnavailable, OnReply, reply_data
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel
from prefixmesh.shared.runtime.config import CommonConfig, option
from prefixmesh.shared.runtime.lifecycle import TaskSet
from prefixmesh.shared.runtime.metrics import (
    DECISION_BUCKETS_S,
    LATENCY_BUCKETS_S,
    LoopHistogram,
    serve_metrics,
)
from prefixmesh.shared.subjects import SCHEDULER_GROUP, Subjects
from prefixmesh.shared.wire import (
    BUS_EVENT,
    PLACE_REQUEST,
    ROUTE_REQUEST,
    AllBlocksCleared,
    ErrorInfo,
    KvEventBatch,
    LoadReportEvent,
    RequestDoneBatch,
    RequestDoneEvent,
    ResyncRequest,
    RouteBatchReply,
    RouteBatchRequest,
    RouteReply,
    RoutingDecisionsEvent,
    SchedulerRequest,
    SubmitReply,
    TokenizedRequest,
    done_records,
    encode,
)

log = logging.getLogger(__name__)

# Seconds drain() waits for the lease loop to finish its Redis call and stop.
LEASE_STOP_TIMEOUT_S = 5.0
# Seconds the scheduler waits for a worker to take its share of a placement (then: a
# retriable refusal naming the worker; the edge waits longer, then routes and submits
# itself).
PLACE_ACK_TIMEOUT_S = 2.0
# Tree nodes the stats loop's hot-prefix walk looks at between two yields to routing
# (about 1 us a node: a slice stalls routing well under a millisecond).
STATS_SLICE_NODES = 256
DECISIONS = Counter("prefixmesh_scheduler_decisions_total", "routing decisions by kind", ["kind"])
DECISION_LATENCY = LoopHistogram("prefixmesh_scheduler_decision_latency_seconds",
                                 "time to choose a worker", DECISION_BUCKETS_S)
KV_GAPS = Counter("prefixmesh_scheduler_kv_gaps_total", "KV event sequence gaps seen")
RESYNCS = Counter("prefixmesh_scheduler_resyncs_total", "resync requests sent to workers")
WORKERS = Gauge("prefixmesh_scheduler_workers", "workers eligible for routing")
ACTIVE = Gauge("prefixmesh_scheduler_active", "1 while this replica routes (in the queue group)")
LEADER = Gauge("prefixmesh_scheduler_leader", "1 while this replica holds the lease (run-once "
               "jobs: snapshots, stats)")
ENGINE_RESTARTS = Counter("prefixmesh_scheduler_engine_restarts_total",
                          "worker engines seen restarting (a new engine id): their blocks "
                          "dropped")
PEER_DECISIONS = Counter("prefixmesh_scheduler_peer_decisions_total",
                         "other replicas' routing decisions charged by this one")
PERSIST_FAILURES = Counter("prefixmesh_scheduler_persist_failures_total",
                           "write-behind flushes to Redis that failed")
PERSISTED_BYTES = Counter("prefixmesh_scheduler_persisted_bytes_total",
                          "bytes of policy state written to Redis")
ROUTE_ERRORS = Counter("prefixmesh_scheduler_errors_total",
                       "route requests answered with an error, by code", ["code"])
TREE_NODES = Gauge("prefixmesh_scheduler_tree_nodes", "nodes in the prefix tree")
TREE_TOKENS = Gauge("prefixmesh_scheduler_tree_tokens", "tokens held in the prefix tree")
KV_LAG = Histogram("prefixmesh_scheduler_kv_event_lag_seconds",
                   "age of a KV event batch when it reaches the scheduler (wall clock)",
                   buckets=LATENCY_BUCKETS_S)
REPLICAS = Counter("prefixmesh_scheduler_replicas_total",
                   "hot-prefix replicas changed by the background task, by change", ["change"])
# E2's decision kinds, exported at 0 from the start so dashboards and alerts see every
# series before the first decision of that kind (see policies/e2.py for their meaning).
E2_DECISION_KINDS = ("exploit", "explore", "affinity", "pd_balance", "rebalance", "replicate")


@dataclass(frozen=True)
class SchedulerConfig(CommonConfig):
    policy: str = option(DEFAULT_POLICY, "global scheduling policy", choices=POLICY_NAMES)
    profile: str = option(DEFAULT_PROFILE, "cost-model profile used for load estimates")
    load_interval_s: float = option(0.25, "workers' load report period (seconds)")
    missed_reports: int = option(3, "a worker silent for this many periods leaves routing")
    tick_interval_s: float = option(0.1, "period of background policy maintenance (seconds)")
    persist_interval_s: float = option(2.0, "period of write-behind snapshots to Redis")
    lease: bool = option(True, "hold a Redis lease among the replicas for run-once jobs "
                         "(state snapshots, the stats summary); routing never waits on it")
    lease_ttl_s: float = option(2.0, "lease lifetime; another replica takes the run-once "
                                "jobs over this long after the holder dies (seconds)")
    catchup_timeout_s: float = option(5.0, "a booting replica routes once every known worker "
                                      "has resent its cache, or after this long (seconds)")
    resync_min_interval_s: float = option(1.0, "least time between two resync requests to "
                                          "one worker (seconds)")
    stats_interval_s: float = option(1.0, "period of the summary (decision mix, hot "
                                     "prefixes) published for the metrics service (seconds)")
    time_scale: float = option(1.0, "wall seconds per model second of sim workers run with "
                               "the same --time-scale: the policy's clock is wall / K, so its "
                               "windows and cooldowns stay in model seconds")


class SchedulerService:
    name = "scheduler"

    def __init__(self, cfg: SchedulerConfig, policy_cfg: PolicyConfig | None = None) -> None:
        self.cfg = cfg
        if not cfg.time_scale > 0:
            raise ValueError("time_scale must be positive")
        # The policy's knobs (E2's H, IMBALR, Th_bal, replication, tree budget; the
        # baselines' parameters): ``PolicyConfig``, from PM_* env / CLI in ``__main__``.
        self.policy_cfg = policy_cfg if policy_cfg is not None else PolicyConfig()
        self.cost = CostModel.load(cfg.profile)
        self.policy: GlobalPolicy = self._fresh_policy()
        self.instance_id = uuid.uuid4().hex[:12]
        # In the routing queue group (after catch-up), and holder of the run-once lease.
        self.routing = False
        self.leader = False
        self.catchup: CatchUp | None = None
        # Whether the policy records its changes (since this replica first led).
        self._tracking = False
        self._lease: Lease | None = None
        # The lease loop; drain() stops it first, so that a stopping instance never takes
        # back the lease it is about to release (nor, as standby, one it would not serve).
        self._lease_task: asyncio.Task | None = None
        self._lease_stop = asyncio.Event()
        self.last_seen: dict[str, float] = {}
        # Per worker: last KV batch sequence number, a sequence number a load report named
        # that we had not seen yet, and when we last asked it for a resync (monotonic s).
        self.kv_seq: dict[str, int] = {}
        self._kv_behind: dict[str, int] = {}
        # Each worker's engine instance (a new one: the engine restarted, its cache empty).
        self.engines = EngineIds()
        self._resync_at: dict[str, float] = {}
        # Set by start(), before any handler or loop runs: see the accessors below.
        self._bus: Bus | None = None
        self._redis: aioredis.Redis | None = None
        self._store: StateStore | None = None
        self._subs: list[Subscription] = []
        self._load_sub: Subscription | None = None
        # Decisions by kind since start, and KV-event lag over the current stats period.
        self.decisions: dict[str, int] = {}
        # DECISIONS' child per kind (``labels()`` costs more than the increment), and the
        # count of each kind added to it so far (``_export_decisions``).
        self._decision_counters: dict[str, Counter] = {}
        self._exported: dict[str, int] = {}
        # The other replicas heard lately; this one's last hello (monotonic s).
        self.peers = Peers()
        self._hello_at = 0.0
        self._lag_sum = 0.0
        self._lag_n = 0
        self._gaps = 0
        self._replicas_seen = (0, 0)

    def policy_now(self) -> float:
        """The policy's clock: monotonic seconds over ``time_scale`` (model seconds).
        Liveness, resync pacing and leases stay on the wall clock."""
        return time.monotonic() / self.cfg.time_scale

    def _fresh_policy(self) -> GlobalPolicy:
        return make_policy(self.cfg.policy, self.policy_cfg, self.cost)

    # What start() sets up (Redis, lease, state store, NATS): handlers and loops run after.

    @property
    def bus(self) -> Bus:
        assert self._bus is not None, "scheduler used before start()"
        return self._bus

    @property
    def redis(self) -> aioredis.Redis:
        assert self._redis is not None, "scheduler used before start()"
        return self._redis

    @property
    def store(self) -> StateStore:
        """The persisted policy state; a fresh one each time this replica takes the lease."""
        assert self._store is not None, "scheduler used before start()"
        return self._store

    @property
    def lease(self) -> Lease:
        assert self._lease is not None, "scheduler used before start()"
        return self._lease

    @property
    def lease_key(self) -> str:
        return f"{self.cfg.redis_prefix}:sched:lease"

    @property
    def state_key(self) -> str:
        """Redis key prefix of the persisted policy state (``store.StateStore``)."""
        return f"{self.cfg.redis_prefix}:sched:{self.cfg.policy}"

    # ------------------------------------------------------------------ handlers

    async def _route(self, req: SchedulerRequest) -> RouteReply | RouteBatchReply:
        # A busy edge sends what it has to route in one message: decided in order, and
        # told to the other replicas in one message too (when there are any).
        told = self._told()
        if isinstance(req, RouteBatchRequest):
            reply: RouteReply | RouteBatchReply = RouteBatchReply(
                replies=[self._decide(r, told) for r in req.requests])
        else:
            reply = self._decide(req, told)
        self._export_decisions()
        await self._tell_peers(told)
        return reply

    def _told(self) -> list | None:
        """Where a turn's decisions are collected for the other replicas: None (not
        collected) while no other replica is heard."""
        return [] if self.peers.any(time.monotonic()) else None

    async def _hello(self) -> None:
        """Say this replica is there (an empty ``sched.decisions`` message), so that the
        others tell it their decisions."""
        self._hello_at = time.monotonic()
        try:
            await self.bus.publish(self.bus.subjects.sched_decisions, RoutingDecisionsEvent(
                scheduler_id=self.instance_id, ts=time.time(), decisions=[]))
        except nats.errors.Error as exc:
            log.warning("hello to the other replicas not sent: %s", exc)

    async def _tell_peers(self, told: list | None) -> None:
        """Publish this turn's decisions for the other replicas (``sched.decisions``).
        Best effort: the decisions are made and charged here, so a failed publish (the
        connection closing or reconnecting) must not turn them into an error for the edge
        or keep a placed request from its worker; peers then learn of that load from the
        workers' reports instead."""
        if not told:
            return
        try:
            await self.bus.publish(self.bus.subjects.sched_decisions, RoutingDecisionsEvent(
                scheduler_id=self.instance_id, ts=time.time(), decisions=told))
        except nats.errors.Error as exc:
            log.warning("decisions not told to the other replicas: %s", exc)

    async def _place(self, m: Msg) -> None:
        """``sched.place``: decide each request of an edge's ``SubmitBatch``, pass each
        chosen worker its share in one ``SubmitBatch`` and, once every worker has answered,
        answer the edge with each request's ``SubmitReply``, in order (the requests reach
        their workers one hop sooner than by route, then submit). A worker gone from the
        bus, or silent for ``PLACE_ACK_TIMEOUT_S``, is a retriable refusal naming it, so
        the edge places those again without it; no worker, or a malformed request, a
        refusal naming none."""
        try:
            requests = PLACE_REQUEST.decode(m.data).requests
        except msgspec.DecodeError as exc:
            if m.reply:
                await m.respond(encode(SubmitReply(request_id="", accepted=False, error=ErrorInfo(
                    f"malformed request: {exc}", "bad_request"))))
            return
        told = self._told()
        placement = PlaceBatch(requests, [self._decide(req, told) for req in requests])
        self._export_decisions()
        await self._tell_peers(told)
        if not placement.shares:
            if m.reply:
                await m.respond(placement.answer())
            return

        def answered(worker: str, subject: str) -> OnReply:
            def on_reply(answer: Msg | None) -> Awaitable[None] | None:
                try:
                    data, why = reply_data(answer, subject, PLACE_ACK_TIMEOUT_S), ""
                except BusUnavailable as exc:  # gone from the bus, or silent
                    data, why = None, str(exc)
                if placement.take(worker, data, why) and m.reply:  # the last to answer
                    return self.bus.nc.publish(m.reply, placement.answer())
                return None

            return on_reply

        for worker in placement.shares:
            subject = self.bus.subjects.worker_submit(worker)
            try:
                await self.bus.send_request(subject, placement.message(worker, m.data),
                                            PLACE_ACK_TIMEOUT_S, answered(worker, subject))
            except BusUnavailable as exc:  # not connected: this answer cannot go either
                log.debug("placing on %s failed: %s", worker, exc)

    def _decide(self, req: TokenizedRequest, told: list | None) -> RouteReply:
        """Route one request; its decision is appended to ``told`` (for the peers) unless
        that is None."""
        t0 = time.perf_counter()
        try:
            inp = route_input(req)
        except ValueError as exc:  # packed hashes that are not whole int64s
            ROUTE_ERRORS.labels("bad_request").inc()  # not a decision: none is counted
            return RouteReply(request_id=req.request_id, error=ErrorInfo(
                f"malformed request: {exc}", code="bad_request", param="packed_hashes"))
        try:
            d = self.policy.route(inp, self.policy_now())
        except NoWorkerError as exc:
            ROUTE_ERRORS.labels("unavailable").inc()
            self._count("none")
            return RouteReply(request_id=req.request_id, error=ErrorInfo(
                str(exc) or "no worker available", code="unavailable", retriable=True))
        DECISION_LATENCY.observe(time.perf_counter() - t0)
        if told is not None:
            told.append(routed(inp, d))
        self._count(d.kind)
        return RouteReply(request_id=req.request_id, worker_id=d.worker_id, decision=d.kind,
                          matched_tokens=d.matched_tokens)

    def _count(self, kind: str) -> None:
        self.decisions[kind] = self.decisions.get(kind, 0) + 1

    def _export_decisions(self) -> None:
        """Add the decisions counted since the last call to ``DECISIONS``: once a message,
        not once a decision (the counter's increment takes a lock)."""
        exported = self._exported
        for kind, n in self.decisions.items():
            done = exported.get(kind, 0)
            if n > done:
                counter = self._decision_counters.get(kind)
                if counter is None:
                    counter = self._decision_counters[kind] = DECISIONS.labels(kind)
                counter.inc(n - done)
                exported[kind] = n

    async def _on_event(self, ev: object) -> None:
        now, pnow = time.monotonic(), self.policy_now()
        if isinstance(ev, LoadReportEvent):
            if self.engines.stale(ev.worker_id, ev.engine_id):
                return  # a late report of an engine the worker has replaced
            if ev.worker_id not in self.last_seen or ev.worker_id not in self.policy.workers:
                log.info("worker %s joined (%d blocks)", ev.worker_id, ev.total_blocks)
                self.policy.add_worker(ev.worker_id, ev.total_blocks * ev.block_size, pnow)
            self.last_seen[ev.worker_id] = now
            if self.engines.restarted(ev.worker_id, ev.engine_id):
                self._engine_restarted(ev.worker_id, "new engine id in its load report")
            if self.catchup is not None and self.catchup.worker_known(ev.worker_id):
                await self._resync(ev.worker_id, "replica catching up", now)
            self.policy.on_load(ev, pnow)
            why = self._check_kv_tail(ev, now)
            if why:
                KV_GAPS.inc()
                self._gaps += 1
                await self._resync(ev.worker_id, why, now)
        elif isinstance(ev, KvEventBatch):
            await self._on_kv(ev, now)
        elif isinstance(ev, (RequestDoneEvent, RequestDoneBatch)):
            for done in done_records(ev):
                self.policy.on_done(done, pnow)
        elif isinstance(ev, RoutingDecisionsEvent):
            if ev.scheduler_id != self.instance_id and self.peers.heard(ev.scheduler_id, now):
                await self._hello()  # a new replica: let it know of this one at once
            if ev.decisions:
                PEER_DECISIONS.inc(apply_peer_decisions(self.policy, ev, self.instance_id,
                                                        pnow))

    async def _on_kv(self, batch: KvEventBatch, now: float) -> None:
        w = batch.worker_id
        if self.engines.stale(w, batch.engine_id):
            return  # blocks of an engine the worker has replaced: gone with it
        lag = max(time.time() - batch.ts, 0.0)
        KV_LAG.observe(lag)
        self._lag_sum += lag
        self._lag_n += 1
        if self.engines.restarted(w, batch.engine_id):
            if not is_resync(batch.events):
                self._engine_restarted(w, "new engine id in its kv events")
            self.kv_seq.pop(w, None)  # its sequence starts over: this is first contact
        last = self.kv_seq.get(w)
        self.kv_seq[w] = batch.seq
        if last is None:
            if batch.seq > 1:  # we missed its earlier events (we just started or took over)
                await self._resync(w, "first contact", now)
        elif batch.seq > last + 1:
            # Lost events: our view of that worker's cache is unreliable until it resends.
            KV_GAPS.inc()
            self._gaps += 1
            await self._resync(w, f"gap {last} -> {batch.seq}", now)
        elif batch.seq <= last:  # a new sequence: the worker restarted, its cache is new
            if w in self.policy.workers and not is_resync(batch.events):
                # What we believed it cached is gone with the old engine.
                self.policy.on_kv_events(w, [AllBlocksCleared()], self.policy_now())
            await self._resync(w, f"restart {last} -> {batch.seq}", now)
        if self.catchup is not None:
            self.catchup.kv_batch(w, batch.events)
        if w in self.policy.workers:
            self.policy.on_kv_events(w, batch.events, self.policy_now())

    def _engine_restarted(self, worker: str, why: str) -> None:
        """``worker``'s engine restarted: what the tree holds for it is gone with the old
        engine (dropped at once), and its KV sequence starts over (the next batch is first
        contact: one past 1 asks for a resync, as does a report naming a later one)."""
        log.warning("engine of %s restarted (%s): dropping its cached blocks", worker, why)
        ENGINE_RESTARTS.inc()
        if worker in self.policy.workers:
            self.policy.on_kv_events(worker, [AllBlocksCleared()], self.policy_now())
        self.kv_seq.pop(worker, None)
        self._kv_behind.pop(worker, None)

    def _check_kv_tail(self, report: LoadReportEvent, now: float) -> str:
        """A load report names the worker's last KV sequence number: if we are still behind
        it at the next report, the tail of its events was lost (reason), else ""."""
        w = report.worker_id
        have = self.kv_seq.get(w, 0)
        behind = self._kv_behind.pop(w, 0)
        if report.kv_seq <= have:
            return ""
        if behind and have < behind:
            return f"tail {have} < {behind}"
        # Maybe the batch is still in flight on the KV subject: look again next report.
        self._kv_behind[w] = report.kv_seq
        return ""

    async def _resync(self, worker: str, why: str, now: float) -> None:
        """Ask ``worker`` to resend its whole cache (AllBlocksCleared + BlockStored...)."""
        if now - self._resync_at.get(worker, float("-inf")) < self.cfg.resync_min_interval_s:
            return
        self._resync_at[worker] = now
        RESYNCS.inc()
        log.warning("kv events of %s: %s; asking for a resync", worker, why)
        await self.bus.publish(self.bus.subjects.worker_resync(worker),
                               ResyncRequest(worker_id=worker, reason=why))

    # ------------------------------------------------------------------ background

    async def _tick_loop(self) -> None:
        silent_after = self.cfg.load_interval_s * self.cfg.missed_reports
        # A tick that wakes this much late means our own loop was stalled (GC, a blocking
        # call): reports may sit unread in the socket, so silence is judged next tick.
        stall_s = self.cfg.tick_interval_s + self.cfg.load_interval_s
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.tick_interval_s)
            now = time.monotonic()
            stalled, last = now - last > stall_s, now
            # Judge silence only when our own inbox is drained: a report still queued here
            # means we are behind, not that the worker is gone.
            backlog = self._load_sub is not None and self._load_sub.pending_msgs > 0
            judge = not backlog and not stalled
            for w, seen in list(self.last_seen.items()):
                if judge and now - seen > silent_after and w in self.policy.workers:
                    log.warning("worker %s silent for %.1fs; dropped from routing", w, now - seen)
                    self.policy.remove_worker(w, self.policy_now())
                    del self.last_seen[w]
                    if self.catchup is not None:
                        self.catchup.worker_gone(w)
            WORKERS.set(len(self.policy.workers))
            if now - self._hello_at >= self.peers.hello_s:
                await self._hello()
            self.policy.tick(self.policy_now())
            self._observe_policy()

    def _observe_policy(self) -> None:
        """Gauges of the policy's state, and replica changes since the last look."""
        summary = self.policy.summary()
        if summary.tree is not None:
            TREE_NODES.set(len(summary.tree))
            TREE_TOKENS.set(summary.tree.tokens)
        added, dropped = self._replicas_seen  # reset with each fresh policy
        REPLICAS.labels("added").inc(max(summary.replicas_added - added, 0))
        REPLICAS.labels("dropped").inc(max(summary.replicas_dropped - dropped, 0))
        self._replicas_seen = (summary.replicas_added, summary.replicas_dropped)

    async def _stats_loop(self) -> None:
        """Publish the summary the metrics service shows (decision mix, hot prefixes)."""
        while True:
            await asyncio.sleep(self.cfg.stats_interval_s)
            if not self.leader:
                continue
            tree = self.policy.summary().tree
            hot = None
            if tree is not None:  # walked a slice at a time, routing in between
                walk = HotPrefixWalk(tree)
                while not walk.step(STATS_SLICE_NODES):
                    await asyncio.sleep(0)
                hot = walk.result()
            lag = self._lag_sum / self._lag_n if self._lag_n else 0.0
            self._lag_sum, self._lag_n = 0.0, 0
            stats = build_stats(self.instance_id, self.policy, self.decisions, time.time(),
                                lag, self._gaps, hot)
            await self.bus.publish(self.bus.subjects.sched_stats, stats)

    async def _persist_loop(self) -> None:
        """Write-behind: what changed goes to Redis, a slice at a time (``store``)."""
        failing = False
        while True:
            await asyncio.sleep(self.cfg.persist_interval_s)
            if not self.leader:
                if self._tracking:  # only the lease holder writes: drop what it would
                    self.policy.state.take_changes()
                continue
            try:
                stats = await self.store.flush(self.policy)
            except Exception as exc:  # Redis down: keep routing in memory, retry next period
                PERSIST_FAILURES.inc()
                if not failing:
                    log.warning("persist to redis failed (%s); routing goes on in memory", exc)
                failing = True
                continue
            if failing or stats.full:
                log.info("state written to redis in full (%d nodes, %d log segments, %d bytes)",
                         stats.nodes, stats.segments, stats.bytes)
            failing = False
            PERSISTED_BYTES.inc(stats.bytes)

    async def _restore(self) -> None:
        """Start from the latest snapshot in Redis (empty when there is none)."""
        self.policy = self._fresh_policy()
        try:
            found = await self.store.load(self.policy)
        except Exception as exc:
            log.warning("could not load state from redis (%s); starting empty", exc)
            self.policy = self._fresh_policy()
            return
        if found:
            # Restored workers must report again, or they leave routing like silent ones.
            now = time.monotonic()
            self.last_seen = {w: now for w in self.policy.workers}
            log.info("restored scheduler state from redis (%d workers, %d tree nodes)",
                     len(self.last_seen), len(self.policy.summary().tree or ()))

    async def _catch_up(self) -> None:
        """Hear the cluster until ``CatchUp`` says we may route: every known worker is
        asked to resend its whole cache (the snapshot may be old), new ones as they
        report. Subscribed to the event subjects already."""
        cfg = self.cfg
        now = time.monotonic()
        self.catchup = catchup = CatchUp(now, cfg.load_interval_s * cfg.missed_reports,
                                         cfg.catchup_timeout_s)
        for w in list(self.policy.workers):
            if catchup.worker_known(w):
                await self._resync(w, "replica catching up", now)
        while not catchup.check(time.monotonic()):
            await asyncio.sleep(min(cfg.load_interval_s, cfg.tick_interval_s))
        missing = sorted(catchup.pending)
        log.info("scheduler %s caught up (%s: %d workers synced%s)", self.instance_id,
                 catchup.how, len(catchup.synced), f", still waiting on {missing}" * bool(missing))
        self.catchup = None

    async def _join(self) -> None:
        """Route from now on: join the queue group of ``sched.route`` / ``sched.place``."""
        bus = self.bus
        self._subs.append(await bus.serve(
            bus.subjects.route, ROUTE_REQUEST, self._route,
            lambda why: RouteReply(request_id="", error=ErrorInfo(why, "bad_request")),
            queue=SCHEDULER_GROUP))
        self._subs.append(await bus.subscribe_raw(bus.subjects.place, self._place,
                                                  queue=SCHEDULER_GROUP))
        self.routing = True
        ACTIVE.set(1)
        log.info("scheduler %s routes (policy %s)", self.instance_id, self.cfg.policy)

    def _lead(self, leading: bool) -> None:
        """Take up (or give up) the run-once jobs: snapshot writes and the stats summary."""
        if leading == self.leader:
            return
        if leading:
            # A fresh store writes the whole state first; changes are tracked from here.
            self._store = StateStore(self.redis, self.state_key, clock=self.policy_now)
            self.policy.state.track_changes()
            self._tracking = True
            log.info("scheduler %s holds the lease (snapshots, stats)", self.instance_id)
        else:
            log.warning("scheduler %s lost the lease; routing goes on", self.instance_id)
        self.leader = leading
        LEADER.set(int(leading))

    async def _lease_loop(self) -> None:
        """Hold the lease, or take it over when it lapses; routing never waits on this."""
        period = self.cfg.lease_ttl_s / 3
        # Stopped by a flag, not by cancelling: a cancel that lands inside a redis-py call
        # can be swallowed there, and the loop would go on renewing after drain().
        while not self._lease_stop.is_set():
            if self.leader:
                if await self.lease.renew() is LeaseState.LOST:
                    self._lead(False)
            elif await self.lease.try_acquire() is LeaseState.HELD:
                self._lead(True)
            try:
                await asyncio.wait_for(self._lease_stop.wait(), period)
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ lifecycle

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        self._redis = redis = aioredis.from_url(self.cfg.redis_url, socket_timeout=1.0,
                                                socket_connect_timeout=1.0)
        stack.push_async_callback(redis.aclose)
        self._lease = Lease(redis, self.lease_key, self.instance_id, self.cfg.lease_ttl_s)
        self._store = StateStore(redis, self.state_key, clock=self.policy_now)
        # No echo: its own decisions (``sched.decisions``) are for the other replicas.
        self._bus = bus = await Bus.connect(self.cfg.nats_url, Subjects(self.cfg.subject_prefix),
                                           "scheduler", echo=False)
        stack.push_async_callback(bus.close)
        await serve_metrics(stack, self.cfg.metrics_port)
        for kind in E2_DECISION_KINDS if self.cfg.policy == "e2" else ():
            DECISIONS.labels(kind)
        ROUTE_ERRORS.labels("unavailable")
        for change in ("added", "dropped"):
            REPLICAS.labels(change)
        tasks = await stack.enter_async_context(TaskSet(on_crash=lambda _e: stop.set()))
        await self._restore()
        # Every replica hears every event (plain subscriptions, not a queue group).
        for subject in (bus.subjects.load_all, bus.subjects.kv_all, bus.subjects.done,
                        bus.subjects.sched_decisions):
            self._subs.append(await bus.subscribe(subject, BUS_EVENT, self._on_event))
        self._load_sub = self._subs[0]
        await self._hello()  # before catching up: the others tell us from now on
        tasks.spawn(self._tick_loop(), "scheduler-tick")
        tasks.spawn(self._persist_loop(), "scheduler-persist")
        tasks.spawn(self._stats_loop(), "scheduler-stats")
        if not self.cfg.lease:
            self._lead(True)
        else:
            state = await self.lease.try_acquire()
            # Redis down at start: nobody can coordinate; snapshots wait for the lease loop.
            self._lead(state is LeaseState.HELD)
            self._lease_task = tasks.spawn(self._lease_loop(), "scheduler-lease")
        await self._catch_up()
        await self._join()

    async def stop_intake(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        self._load_sub = None
        self.routing = False
        ACTIVE.set(0)

    async def drain(self) -> None:
        if self._lease_task is not None:
            self._lease_stop.set()
            # One Redis call at most is in flight (socket timeouts bound it); a cancel only
            # if that still does not end it.
            done, _ = await asyncio.wait({self._lease_task}, timeout=LEASE_STOP_TIMEOUT_S)
            if not done:
                self._lease_task.cancel()
                await asyncio.gather(self._lease_task, return_exceptions=True)
        if not self.leader:
            return
        try:
            await self.store.flush(self.policy)
        except Exception as exc:
            log.warning("final persist failed: %s", exc)
        if self.cfg.lease:
            await self.lease.release()
