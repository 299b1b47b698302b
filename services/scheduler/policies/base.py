"""The global-policy interface: inputs, decisions, configuration (docs/design.md section 5).

Policies are pure: no asyncio, no I/O, no clock. The scheduler service (or the cluster
simulator) passes ``now`` in seconds on one monotonic clock; snapshots store times
relative to the last ``now`` seen, so a restored policy may run on another clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import msgspec

from prefixmesh.services.scheduler.prefix_tree import Node, PrefixTree
from prefixmesh.shared.wire import KvEvent, LoadReportEvent, RequestDoneEvent, RoutedRequest


class NoWorkerError(RuntimeError):
    """No worker is eligible for the request (none registered, or all excluded)."""


class RouteInput(msgspec.Struct, frozen=True):
    """What the edge knows about a request when it asks for a worker."""

    request_id: str
    # prefixmesh block hashes of the prompt's full 16-token blocks (tenant-salted chain); the
    # edge's routing copy and a peer's decision bring them as an int64 array over their
    # packed bytes (replicas.py), whose ints are made only where read.
    block_hashes: Sequence[int]
    prompt_tokens: int
    max_tokens: int
    tenant: str = ""
    # Predicted output tokens (0 = none: the policy uses its windowed average).
    predicted_output: float = 0.0
    # Workers already tried for this request (retry after a failure).
    exclude: Collection[str] = frozenset()


class Decision(msgspec.Struct, frozen=True):
    """The chosen worker and why (a Struct: built on every decision, so it must be cheap)."""

    worker_id: str
    # "exploit" | "explore" | "affinity" | "pd_balance" | "rebalance" | "replicate", or a
    # baseline's name.
    kind: str
    # Prompt tokens the policy believes are cached on the chosen worker.
    matched_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Every knob of every global policy, with units. Defaults follow docs/design.md
    section 5 and the
    projects the baselines come from."""

    # ---------------------------------------------------------------- E2 (Preble)
    # H: sliding window of the load estimate L, the per-node request counts and the average
    # output length (seconds).
    window_s: float = 180.0
    # IMBALR: a worker whose decode share of scheduled tokens (load reports, [0, 1]) is
    # above this is decode-dominated and gets the next cold (prefill-heavy) request.
    imbalance_ratio: float = 0.5
    # Guard on that rule: the decode-dominated worker gets the cold request only when its
    # load cost is at most this multiple of the best worker's (a stale report must not
    # override a clearly better choice).
    pd_max_cost_ratio: float = 2.0
    # ... and only onto a worker whose latest report shows no request waiting: a queue
    # there (under cache pressure, requests waiting for KV memory) means it has no spare
    # capacity for a prefill (docs/sim-results.md, placement suite: multiturn under
    # cache pressure).
    pd_needs_room: bool = True
    # Load reports older than this are ignored (seconds; workers report every 0.25 s).
    load_report_stale_s: float = 2.0
    # Th_bal: rebalance when the exploit worker's L exceeds this multiple of the lightest's
    # (inf turns route-time rebalancing and the L-based overload signal off).
    th_bal: float = 1.5
    # ... and only when that worker is busy at all: L / H above this (estimated fraction of
    # its GPU time in the window). Below it nothing queues and a move only costs a prefill.
    rebalance_min_util: float = 0.05
    # An exploit whose worker's prefill backlog (prefills routed there and not yet done,
    # back to back) is longer than this multiple of the prefill the hit saves goes to the
    # cheapest worker by the full cost instead, when that is cheaper ("rebalance"). 0 = off.
    backlog_exploit: float = 0.0
    # A request explored to a worker whose prefill backlog is longer than this multiple of
    # its own prefill there, and than explore_wait_fleet x the other workers' mean
    # backlog, goes to the cheapest worker whose backlog is within the first bound, if
    # there is one: the load cost weighs R's wait once against the prefill slowing every
    # request in flight elsewhere, so in a burst long cold documents queued behind each
    # other on two of eight workers (docs/sim-results.md, placement suite). 0 = off.
    explore_wait: float = 2.0
    explore_wait_fleet: float = 2.0
    # Running batch assumed when pricing one more decoding sequence (sequences): DT is the
    # marginal cost of a sequence in a continuously batched step, not a lone decode step.
    dt_batch_size: int = 32
    # Output length assumed before any completion was seen (tokens).
    default_output_tokens: int = 64
    # Decode pressure in the load cost: + this x (R's expected output tokens) x (the
    # worker's mean engine step in its latest load report, s). L prices decode as the
    # marginal cost of one sequence in a batch, so a worker busy with long generations
    # looks cheap although every token of R would wait one of its long steps. Off (0) by
    # default: the step time in a 0.25 s report is too noisy to steer short requests by.
    # An idle worker's step counts as its GPU's lone decode step, not as zero.
    decode_step_weight: float = 0.0
    # The GPU's own decode speed in the load cost: + this x (R's expected output tokens) x
    # the lone decode step of the worker's profile. A constant in a fleet of one GPU type;
    # in a mixed fleet, what each output token of R takes on that GPU, which L (GPU work,
    # not latency) does not say (docs/sim-results.md, placement suite: the mixed fleets).
    gpu_step_weight: float = 0.5
    # In-flight aging: a request still running after producing (by the worker's reported
    # step time) more tokens than L charged it is recharged at this multiple of what it
    # has produced, on every tick; 0 turns it off. L otherwise sees a long generation
    # only once it has finished (docs/sim-results.md: programming).
    inflight_aging: float = 2.0
    # Prefill backlog in the load cost: + this x the seconds until the prefills already
    # routed to the worker would be done, run back to back from their assignment. L is
    # the work of the whole window H; this is the part still ahead of a new request. With
    # it on, P/D balancing also skips a decode-heavy worker that still has a backlog (its
    # report's decode share lags). 0 turns both off (docs/sim-results.md: loogle).
    prefill_backlog_weight: float = 1.0
    # The load term of the cost: True prices the queueing delay the window's work implies,
    # ``min(L, u / (1 - u) x L / n)`` with ``u = L / H`` the worker's utilisation and
    # ``L / n`` its mean work per request (M/M/1); False prices ``L`` itself (Preble). ``L``
    # is minutes of past work next to a prefill of milliseconds, so it outweighs what a
    # request would miss or how fast the GPU is until utilisation is near 1
    # (docs/sim-results.md: placement suite).
    load_wait: bool = True
    # ... never above this many seconds (0: no cap; with load_wait off, L is uncapped and
    # the affinity test below reads saturation from L alone). Near and past saturation the
    # M/M/1 delay runs to L itself, minutes, while a saturated worker's queue is seconds to
    # tens of seconds: in a fleet overloaded for minutes a worker just under u = 1 priced
    # at seconds next to ones just over it priced at minutes took every hot prefix's
    # traffic and queued it (docs/sim-results.md, placement suite: 3,000-request runs).
    # Capped, the saturated workers compare by what R costs there: its prefill, the
    # requests it delays, the prefill backlog.
    load_wait_cap_s: float = 20.0
    # PT of a request's missed tokens priced after the tokens the worker caches, as the
    # engine computes them (each chunk attends to the cached prefix: a short question
    # after a long document costs several times its PT from scratch); False: PT from
    # scratch (Preble's formula). Off by default: closer to the engine, but over the
    # placement suite it only moved tails, one point past 3% (docs/sim-results.md).
    pt_after_cached: bool = False
    # Interference in the load cost: + this x P(R's missed tokens) x the worker's running
    # sequences (see interference_inflight): under chunked prefill R's prefill delays each
    # of them by about P (docs/sim-results.md: loogle, programming). 0 turns it off.
    interference_weight: float = 0.5
    # What "running sequences" counts in that term: True, the requests routed there and
    # not done yet (the policy's own count, queued ones too: they wait behind R's prefill
    # as well); False, the worker's latest load report, up to a report interval old, so
    # the requests just sent there, the ones a long prefill would land on, are missing
    # (docs/sim-results.md, placement suite: 32 of 36 points within 3% against 28).
    interference_inflight: bool = True
    # A request explored with a prefill under 1/this of the longest prefill routed in the
    # last interference_mix_window_s seconds, that one at least interference_mix_min_s
    # long, is priced without the interference term. In a mix of long cold documents and
    # short requests, a short prefill's interference is small next to a document's, and
    # charging it spreads the short requests over every idle worker: then no worker is
    # left without decoding sequences when a document arrives, and each document's
    # seconds of prefill stall some short request's decode. Without long prefills in the
    # window the term applies as before. Off (0) by default: with 10 the placement suite's
    # tails improve below saturation, but E2's average lead on the documents' mixes
    # shrinks and a sustained overload's average is worse (docs/sim-results.md, placement
    # suite, "Short requests beside long documents").
    interference_mix_ratio: float = 0.0
    interference_mix_window_s: float = 10.0
    interference_mix_min_s: float = 1.0
    # The tree models a worker's eviction at routing (LRU over what was routed there, by
    # its KV capacity) for a worker that sends no KV events, and for one that does while
    # its latest load report says its requests waited less than this long in its queue
    # (seconds; 0 = never, inf = at any queue): a prompt routed there then runs within
    # about that time, so what the model evicts for it the worker evicts soon, before its
    # event says so (near the knee this look ahead helps the longest prompts' tails).
    # Behind a longer queue the worker's own BlockRemoved events say what it evicted: the
    # model evicts for prompts still queued (docs/sim-results.md, "What the tree evicts").
    model_eviction_queue_s: float = 1.0

    # ---------------------------------------------------------------- E2 replication
    # A node carrying at least this fraction of its worker's window requests is a hot
    # prefix of that worker ([0, 1]) ...
    replicate_share: float = 0.3
    # ... given at least this many window requests on that worker.
    replicate_min_requests: int = 16
    # Overload signal from queueing time: mean over the recent half of H at least this
    # multiple of the mean over the older half ("average queueing time doubles over H") ...
    replicate_queue_growth: float = 2.0
    # ... and at least this long (seconds), so 1 ms -> 2 ms is not an overload.
    replicate_min_queue_s: float = 0.1
    # Most workers one hot prefix is spread over (0 = no limit).
    replicate_max_workers: int = 8
    # Least time between two changes of one prefix's replica set (seconds).
    replicate_cooldown_s: float = 10.0
    # Shrink a replica set when the prefix's window requests fall below this fraction of
    # their peak since the last change and none of its workers is overloaded.
    shrink_ratio: float = 0.5

    # ---------------------------------------------------------------- prefix tree budget
    # Hard bounds on the global tree (nodes; tokens), LRU-pruned beyond them. These are
    # floors: E2 raises both as workers register (see tree_budget_factor).
    tree_max_nodes: int = 262_144
    tree_max_tokens: int = 8_388_608
    # E2 sizes its tree to max(tree_max_tokens, this x the sum of the registered workers'
    # KV capacity in tokens), and the node bound in proportion, so the tree always
    # remembers more than the cluster caches (a tree smaller than the cluster's cache prunes
    # prefixes that workers still hold and E2 explores instead of exploiting them). 2x
    # leaves room for prefixes evicted everywhere but still used in the window (affinity).
    tree_budget_factor: float = 2.0

    # ---------------------------------------------------------------- E2 affinity
    # When a request explores (no eligible worker caches enough of its prompt) but the
    # tree's window counts show workers that recently served its prefix (evicted since),
    # the cheapest of those gets it ("affinity") if its load cost L + M + P exceeds the
    # cheapest worker's by at most this multiple of PT(the prefix): the extra queueing it
    # accepts is bounded by the prefill a later hit on that worker saves. Keeps each
    # prefix's traffic on few workers after eviction, so working sets larger than the
    # cluster's cache stay partitioned (videoqa past its knee). 0 turns it off.
    affinity_prefill_slack: float = 0.5
    # On a saturated cluster (the cheapest worker's windowed work L >= H, or its cost at
    # least load_wait_cap_s: every GPU busy all the time, queues growing), affinity may
    # also cost up to this multiple of the cheapest worker's cost: throughput, i.e.
    # prefill saved, is then what bounds latency.
    affinity_saturated_ratio: float = 1.25

    # ---------------------------------------------------------------- baselines
    # prefix_hash: tokens of the prompt head that pick the ring position (the block hash at
    # this depth names the whole head), and virtual nodes per worker on the ring.
    prefix_hash_tokens: int = 512
    prefix_hash_vnodes: int = 64
    # cache_aware (SGLang router): balance when max_load - min_load > abs (requests) and
    # max_load > rel * min_load; else the longest match when match ratio > threshold.
    ca_balance_abs: int = 64
    ca_balance_rel: float = 1.5
    ca_cache_threshold: float = 0.3
    # Per-worker size of its approximate tree before LRU trimming (tokens; SGLang's
    # max_tree_size is 2**24 characters).
    ca_max_tree_tokens: int = 16_777_216
    # kv_cost (Dynamo KV router): cost = overlap_weight * prefill blocks + decode blocks.
    kv_overlap_weight: float = 1.0
    # Dynamo builds its index from KV events; False approximates it from routing decisions.
    kv_use_events: bool = True
    # weighted (llm-d): weights of the prefix, queue and KV-utilisation scorers.
    weighted_prefix: float = 3.0
    weighted_queue: float = 2.0
    weighted_kv: float = 2.0
    # Outstanding requests with no completion record after this long are forgotten (s).
    outstanding_ttl_s: float = 600.0
    # Seed of the random tie-breaks (kv_cost, weighted).
    seed: int = 0


class Changes(NamedTuple):
    """State changed since the last ``take_changes`` (or all of it, ``all_state``)."""

    # Tree nodes to (re)write: each encoded by ``encode_node`` (None if pruned meanwhile).
    nodes: Iterable[Node]
    # Ids of tree nodes pruned (to delete).
    gone: list[int]
    # Window-log items, encoded in slices by ``encode_log``.
    log: list


@dataclass(slots=True)
class PolicySummary:
    """What the scheduler reports of a policy beyond its decisions (``sched.stats``)."""

    # The policy's prefix tree (None: it keeps none): size and hot prefixes.
    tree: PrefixTree | None = None
    # Hot-prefix replicas added / dropped since the policy started (E2).
    replicas_added: int = 0
    replicas_dropped: int = 0


class PolicyState(Protocol):
    """A policy's persistence (the scheduler service's write-behind to Redis), apart from
    its routing.

    Two forms: ``snapshot``/``restore`` move the whole state at once; the incremental form
    writes a small meta record whole, tree nodes by id, and an append-only log that
    expires after ``log_window_s``, with times written ``offset`` added (the writer's
    epoch).
    """

    def snapshot(self) -> bytes:
        """State as msgpack bytes (times relative to the policy's last ``now``)."""
        ...

    def restore(self, data: bytes) -> None:
        """Replace the state by a ``snapshot()``; times are rebased on the next call."""
        ...

    @property
    def log_window_s(self) -> float:
        """Seconds a log segment stays relevant (0: the policy writes no log)."""
        ...

    def track_changes(self) -> None:
        """Start recording what changes, for ``take_changes``."""
        ...

    def take_changes(self) -> Changes:
        """What changed since the last call; O(1), safe on the event loop."""
        ...

    def all_state(self) -> Changes:
        """Everything, in the shape of changes (for a full rewrite)."""
        ...

    def encode_node(self, node: Node, offset: float) -> bytes | None:
        """One tree node's record, or None if it was pruned since."""
        ...

    def encode_log(self, items: list, offset: float) -> tuple[bytes, float]:
        """A log segment of ``items`` and its newest time (epoch)."""
        ...

    def encode_meta(self, offset: float) -> bytes:
        """The small rest of the state (workers, counters...)."""
        ...

    def load_persisted(self, meta: bytes, nodes: list[bytes], segments: list[bytes],
                       offset: float, now: float) -> None:
        """Replace the state by persisted pieces (times + ``offset`` = the caller's clock)."""
        ...


@runtime_checkable
class GlobalPolicy(Protocol):
    """What the scheduler service and the cluster simulator drive: routing, fed by the
    workers' events; its persistence is ``state``."""

    name: str

    @property
    def workers(self) -> Collection[str]:
        """Registered worker ids."""
        ...

    @property
    def state(self) -> PolicyState:
        """The policy's persistence."""
        ...

    def add_worker(self, worker_id: str, capacity_tokens: int, now: float) -> None:
        """Register a worker (idempotent: a known worker only gets its capacity updated)."""
        ...

    def remove_worker(self, worker_id: str, now: float) -> None:
        """Drop a worker from routing and from the cache model."""
        ...

    def route(self, req: RouteInput, now: float) -> Decision:
        """Choose a worker; raises ``NoWorkerError`` when none is eligible."""
        ...

    def apply_remote_decision(self, req: RouteInput, decision: Decision, now: float) -> None:
        """Account for a routing decision another scheduler replica made (active-active).

        ``req`` is what that replica routed, ``decision`` what it chose. The policy books it
        as if it had routed it itself, minus the choice: the in-flight load of the chosen
        worker (E2's window ``L`` and prefill backlog; a baseline's outstanding requests)
        and the prompt predicted on that worker's cache (tree entries; baselines that
        learn their cache view from decisions). Pure and idempotent per request id, so a
        decision delivered twice counts once; a decision for an unknown worker is ignored.
        Without it, N replicas each see 1/N of the load they route by.
        """
        ...

    def apply_routed(self, d: RoutedRequest, hashes: Sequence[int], now: float) -> None:
        """``apply_remote_decision`` of a peer's decision as decoded from the wire
        (``hashes``: its block hashes, unpacked by the caller); records exactly what
        ``apply_remote_decision`` records for the same request and decision."""
        ...

    def on_kv_events(self, worker_id: str, events: list[KvEvent], now: float) -> None:
        """Apply a worker's KV cache events (vLLM schema)."""
        ...

    def on_load(self, report: LoadReportEvent, now: float) -> None:
        """Take a worker's periodic load report."""
        ...

    def on_done(self, done: RequestDoneEvent, now: float) -> None:
        """Take a request's completion record."""
        ...

    def tick(self, now: float) -> None:
        """Background maintenance; cheap, and never needed for ``route`` to be correct."""
        ...

    def summary(self) -> PolicySummary:
        """Tree and replication figures for the scheduler's statistics."""
        ...
