"""Active-active scheduler replicas: what one replica tells the others, and when a booting
replica may route (pure: no I/O, no clock; the service passes times in).

Every replica receives every KV event, load report and completion record, so each keeps
the whole prefix tree by itself. What only the deciding replica knows is its routing
decisions: it publishes them (``RoutingDecisionsEvent``) and every other replica charges
them with ``GlobalPolicy.apply_decision``, so N replicas splitting the traffic each still
see the whole in-flight load instead of 1/N of it.

A replica with no other replica to tell skips all of that (building, packing and
publishing a record per decision was more than a tenth of a lone scheduler's work):
every replica says it is there with an empty ``RoutingDecisionsEvent`` when it starts and
every ``PEER_HELLO_S`` (``Peers``), answers a replica it had not heard with a hello of its
own, and records its decisions only while it has heard another one lately. A replica that
starts says so before it catches up, so the others tell it everything from a few
milliseconds after its start, long before it routes.

A booting replica starts from the Redis snapshot, then asks every worker for a resync
(``AllBlocksCleared`` + ``BlockStored``...). ``CatchUp`` says when it has heard enough to
route: every worker it knows has resent its cache since, or a timeout passed. Until then
it stays out of the routing queue group, so it never routes from an empty tree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prefixmesh.services.scheduler.policies.base import Decision, GlobalPolicy, RouteInput
from prefixmesh.shared.blocks import pack_hashes, unpack_hashes
from prefixmesh.shared.wire import (
    AllBlocksCleared,
    KvEvent,
    RoutedRequest,
    RoutingDecisionsEvent,
    TokenizedRequest,
)

log = logging.getLogger(__name__)

# Seconds between two "I am here" messages of a replica, and how many of them may be
# missed (lost, or a stalled loop) before the others stop telling it their decisions.
PEER_HELLO_S = 1.0
PEER_MISSED_HELLOS = 3


class Peers:
    """The other scheduler replicas heard lately (any ``sched.decisions`` message from
    them, an empty one being a hello): whether this replica's decisions need telling."""

    def __init__(self, hello_s: float = PEER_HELLO_S, missed: int = PEER_MISSED_HELLOS) -> None:
        self.hello_s = hello_s
        self.ttl_s = hello_s * missed
        self.heard_at: dict[str, float] = {}

    def heard(self, scheduler_id: str, now: float) -> bool:
        """Record a message of ``scheduler_id``; True when it was not known (then answer
        with a hello, so that it knows of this one at once too)."""
        new = scheduler_id not in self.heard_at
        self.heard_at[scheduler_id] = now
        return new

    def any(self, now: float) -> bool:
        """Whether another replica was heard within the last ``ttl_s`` (the silent ones
        are forgotten)."""
        if not self.heard_at:
            return False
        cut = now - self.ttl_s
        for sid in [s for s, t in self.heard_at.items() if t < cut]:
            del self.heard_at[sid]
        return bool(self.heard_at)


def route_input(req: TokenizedRequest) -> RouteInput:
    """What the policy needs of an edge's request (its hashes read in place when packed)."""
    hashes = unpack_hashes(req.packed_hashes) if req.packed_hashes else req.block_hashes
    return RouteInput(request_id=req.request_id, block_hashes=hashes,
                      prompt_tokens=req.prompt_tokens or len(req.token_ids),
                      max_tokens=req.sampling.max_tokens, tenant=req.tenant,
                      predicted_output=req.predicted_output, exclude=frozenset(req.exclude))


def routed(inp: RouteInput, d: Decision) -> RoutedRequest:
    """The record of one decision, for the other replicas."""
    packed = pack_hashes(inp.block_hashes)
    return RoutedRequest(request_id=inp.request_id, worker_id=d.worker_id,
                         block_hashes=[] if packed else list(inp.block_hashes),
                         prompt_tokens=inp.prompt_tokens, max_tokens=inp.max_tokens,
                         predicted_output=inp.predicted_output, tenant=inp.tenant,
                         kind=d.kind, matched_tokens=d.matched_tokens, packed_hashes=packed)


def routed_hashes(d: RoutedRequest) -> Sequence[int]:
    """The block hashes of a peer's decision: an int64 array over its packed bytes (ints
    made only where read), or its list."""
    return unpack_hashes(d.packed_hashes) if d.packed_hashes else d.block_hashes


def apply_peer_decisions(policy: GlobalPolicy, ev: RoutingDecisionsEvent, own_id: str,
                         now: float) -> int:
    """Charge a peer's decisions to ``policy`` (our own echo is skipped; a decision whose
    packed hashes are malformed is logged and skipped, the others applied); returns how
    many were applied."""
    if ev.scheduler_id == own_id:
        return 0
    # Straight from the wire struct (``apply_routed``): no RouteInput and Decision built
    # per decision, as ``apply_remote_decision`` would need.
    apply = policy.apply_routed
    applied = 0
    for d in ev.decisions:
        try:
            hashes = routed_hashes(d)
        except ValueError as exc:  # packed hashes that are not whole int64s: this one only
            log.warning("peer %s: decision for %s skipped: %s", ev.scheduler_id,
                        d.request_id, exc)
            continue
        apply(d, hashes, now)
        applied += 1
    return applied


def is_resync(events: list[KvEvent]) -> bool:
    """Whether a KV batch is a whole cache state (a resync, or an engine that restarted
    empty): it starts with ``AllBlocksCleared``."""
    return bool(events) and isinstance(events[0], AllBlocksCleared)


class CatchUp:
    """Whether a booting replica knows the cluster well enough to route.

    Caught up when at least ``min_wait_s`` passed (every live worker has sent a load
    report, so the replica knows them all) and every known worker has resent its whole
    cache since ``start``; or, whatever is missing, after ``timeout_s`` (a worker that
    never answers is dropped by liveness like any silent one).
    """

    def __init__(self, start: float, min_wait_s: float, timeout_s: float) -> None:
        self.start = start
        self.min_wait_s = min_wait_s
        self.timeout_s = timeout_s
        # Known workers whose full cache has not arrived yet, and those whose has.
        self.pending: set[str] = set()
        self.synced: set[str] = set()
        self.done = False
        # Why it finished: "synced" or "timeout" ("" while catching up).
        self.how = ""

    def worker_known(self, worker: str) -> bool:
        """A worker was seen (snapshot or load report); True when it must be asked for a
        resync (first time seen while catching up)."""
        if self.done or worker in self.synced or worker in self.pending:
            return False
        self.pending.add(worker)
        return True

    def kv_batch(self, worker: str, events: list[KvEvent]) -> None:
        """A KV batch arrived: a whole cache state brings ``worker`` up to date."""
        if not self.done and is_resync(events):
            self.pending.discard(worker)
            self.synced.add(worker)

    def worker_gone(self, worker: str) -> None:
        """A worker left (silent): nothing more to wait for from it."""
        self.pending.discard(worker)

    def check(self, now: float) -> bool:
        """Whether the replica may route from now on (stays True once it is)."""
        if not self.done:
            waited = now - self.start
            if waited >= self.timeout_s:
                self.done, self.how = True, "timeout"
            elif waited >= self.min_wait_s and not self.pending:
                self.done, self.how = True, "synced"
        return self.done
