"""``batch_groups``: BatchLLM's prefix-group scheduling for offline batch requests
(docs/design.md section 6; BatchLLM, sections 3-4).

Interactive requests (no ``batch_id``) come first, in arrival order, at every step: batch
work only ever gets what they leave (slots, token budget), and it never fills more than
the memory threshold, so it cannot starve them.

Batch requests are grouped by the prefix they share with other waiting batch requests:
each waiting batch request adds 1 to a counter per block hash of its prompt, and since a
block hash names its whole prefix, the counters fall monotonically along a chain; a
request's group is its deepest block still counted at least twice (a binary search), so
requests in one group share exactly ``L_prefix`` tokens. A request sharing nothing is a
group of its own with ``L_prefix`` = 0. Groups are run one at a time, the one with the
largest ``1 / (L_prefix + sum L_distinct)`` first (BatchLLM's ordering: the least total
prompt tokens, so small groups clear memory soonest); ties go to the oldest.

Running a group: its first request (the leader) is admitted alone; the rest wait until
the leader's shared prefix is in the prefix cache, and then go in together, each
computing only its distinct part (an engine caches a block only after the step that
computes it, so admitting the whole group at once would compute the prefix once per
member). If the leader stops without caching the prefix (finished, aborted, requeued and
later evicted), the next member becomes leader. Batch requests arriving with the running
group's prefix join it.

Batches are bounded by KV memory (BatchLLM's memory-centric token batching), not by a
request count: batch admissions stop once the engine's referenced KV blocks, plus what the
running batch requests will still add, plus the new request's (prompt and predicted or
maximum output, less its cached prefix) would pass the KV token threshold (``kv_tokens``,
else ``memory_threshold`` of ``EngineView.num_blocks``), or once the step's token budget
(its chunk size) is spent. Batch requests hold no sequence slot (``takes_slot``): the
engine runs them beyond ``max_num_seqs``, which stays whole for interactive requests (the
sim engine caps them only where a step could no longer decode every running request,
docs/design.md section 6).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

from prefixmesh.services.worker.engine.types import EngineRequest, RequestStatus
from prefixmesh.services.worker.local.base import (
    EngineView,
    LocalPolicy,
    WaitingQueue,
    prefill_estimate,
)

# BatchLLM's M_threshold: share of the KV pool batch admissions may fill (fraction); the
# rest is headroom for interactive requests and for the decode growth of running ones.
DEFAULT_MEMORY_THRESHOLD = 0.9
# Oldest waiting batch requests looked at when choosing the next group (requests); bounds
# the work of a group choice, which happens once per group.
DEFAULT_SCAN_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class BatchGroupsConfig:
    """Knobs of ``batch_groups``."""

    # M_threshold as a fraction of the engine's KV blocks (used when kv_tokens is 0).
    memory_threshold: float = DEFAULT_MEMORY_THRESHOLD
    # The KV token threshold itself (tokens of KV the engine may hold, running requests
    # included, before batch admissions stop); 0 = memory_threshold of the engine's pool.
    kv_tokens: int = 0
    # Waiting batch requests considered per group choice.
    scan_limit: int = DEFAULT_SCAN_LIMIT
    # True: batch requests hold sequence slots like any other, so max_num_seqs caps them
    # too (request-count batching, the baseline the KV threshold replaces; comparisons).
    batch_slots: bool = False

    def __post_init__(self) -> None:
        if (not 0.0 < self.memory_threshold <= 1.0 or self.kv_tokens < 0
                or self.scan_limit < 1):
            raise ValueError(f"invalid batch_groups config: {self}")

    def limit_blocks(self, cache: EngineView) -> float:
        """The KV token threshold in ``cache``'s blocks."""
        if self.kv_tokens:
            return self.kv_tokens / cache.block_size
        return self.memory_threshold * cache.num_blocks


@dataclass(slots=True)
class PrefixGroup:
    """Batch requests that share their first ``prefix_blocks`` block hashes."""

    prefix_blocks: int
    # Members not yet admitted, oldest first.
    members: deque[EngineRequest] = field(default_factory=deque)
    # The member admitted to compute the shared prefix (None until one is).
    leader: EngineRequest | None = None

    def key_hash(self) -> int | None:
        """Hash of the last shared block (None: nothing shared)."""
        if not self.prefix_blocks or (not self.members and self.leader is None):
            return None
        ref = self.leader or self.members[0]
        return ref.block_hashes[self.prefix_blocks - 1]


class BatchGroupsPolicy(LocalPolicy):
    """Interactive first (FCFS); batch requests by prefix group under a memory threshold."""

    name = "batch_groups"

    def __init__(self, config: BatchGroupsConfig | None = None) -> None:
        self.config = config or BatchGroupsConfig()
        # Requeued requests (any kind) in the front lane; interactive ones by arrival.
        self._interactive = WaitingQueue()
        # Waiting batch requests by id, in arrival order (members of the current group too).
        self._batch: dict[str, EngineRequest] = {}
        # Waiting batch requests per prompt block hash.
        self._counts: dict[int, int] = {}
        # The group being admitted.
        self._group: PrefixGroup | None = None
        # Batch requests admitted and maybe still running, by id (``_growth``).
        self._admitted: dict[str, EngineRequest] = {}
        # The other groups, best first, as last computed; None after a push changed them.
        # Kept between steps so that a run of single-request groups costs one grouping,
        # not one per group; members that left the pool meanwhile are skipped.
        self._plan: deque[PrefixGroup] | None = None

    # ------------------------------------------------------------------ queue

    def __len__(self) -> int:
        return len(self._interactive) + len(self._batch)

    def __iter__(self) -> Iterator[EngineRequest]:
        yield from self._interactive
        yield from self._batch.values()

    def push(self, req: EngineRequest, now: float) -> None:
        """Interactive requests join the FCFS lane; batch ones the group pool."""
        if not req.batch_id:
            self._interactive.push(req)
            return
        if req.request_id in self._batch:
            raise ValueError(f"request {req.request_id!r} is already waiting")
        self._batch[req.request_id] = req
        self._plan = None
        counts = self._counts
        for h in req.block_hashes:
            counts[h] = counts.get(h, 0) + 1
        g = self._group
        if g is not None and (key := g.key_hash()) is not None:
            if len(req.block_hashes) >= g.prefix_blocks and (
                req.block_hashes[g.prefix_blocks - 1] == key
            ):
                g.members.append(req)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a waiting request out of whichever lane holds it."""
        req = self._batch.get(request_id)
        if req is None:
            return self._interactive.remove(request_id)
        self._take(req)
        g = self._group
        if g is not None and req in g.members:
            g.members.remove(req)
        return req

    def requeue_front(self, reqs: Sequence[EngineRequest]) -> None:
        """Put requests back ahead of everyone, in order."""
        self._interactive.requeue_front(reqs)

    def _take(self, req: EngineRequest) -> None:
        """Drop a batch request from the pool and its hash counts."""
        del self._batch[req.request_id]
        counts = self._counts
        for h in req.block_hashes:  # unchanged while waiting: the ones counted at push
            c = counts[h] - 1
            if c:
                counts[h] = c
            else:
                del counts[h]

    # ------------------------------------------------------------------ groups

    def shared_blocks(self, req: EngineRequest) -> int:
        """Leading prompt blocks ``req`` shares with at least one other waiting batch
        request (counts fall monotonically along a chain: binary search)."""
        counts = self._counts
        return bisect.bisect_left(req.block_hashes, True, key=lambda h: counts.get(h, 0) < 2)

    def next_group(self, block_size: int) -> PrefixGroup | None:
        """The next group to run, taken off the plan (regrouped when stale); None when
        no batch request waits."""
        while True:
            if not self._plan:
                self._plan = self.plan_groups(block_size)
                if not self._plan:
                    return None
            g = self._plan.popleft()
            g.members = deque(r for r in g.members if r.request_id in self._batch)
            if g.members:
                return g

    def plan_groups(self, block_size: int) -> deque[PrefixGroup]:
        """Waiting batch requests as prefix groups, the largest 1 / (L_prefix + sum
        L_distinct) first (oldest first among equals)."""
        groups: dict[object, tuple[int, list[EngineRequest]]] = {}
        for req in islice(self._batch.values(), self.config.scan_limit):
            k = self.shared_blocks(req)
            key: object = req.block_hashes[k - 1] if k else req.request_id
            entry = groups.get(key)
            if entry is None:
                groups[key] = (k, [req])
            else:
                entry[1].append(req)
        ranked: list[tuple[int, int, PrefixGroup]] = []
        # Dicts keep insertion order, so ``i`` orders groups by their oldest member.
        for i, (k, members) in enumerate(groups.values()):
            prefix = k * block_size
            total = prefix + sum(r.num_prompt_tokens - prefix for r in members)
            ranked.append((total, i, PrefixGroup(k, deque(members))))
        ranked.sort(key=lambda t: t[:2])
        return deque(g for _, _, g in ranked)

    # ------------------------------------------------------------------ scheduling

    def takes_slot(self, req: EngineRequest) -> bool:
        """Interactive requests hold a sequence slot; batch ones are bounded by the KV
        token threshold instead (unless ``batch_slots``)."""
        return self.config.batch_slots or not req.batch_id

    def select(
        self, now: float, max_requests: int, token_budget: int, cache: EngineView
    ) -> list[EngineRequest]:
        """Requeued, then interactive (FCFS) while slots last, then the current batch
        group's members while KV memory (below the threshold) and the token budget allow;
        ``max_requests`` counts slot holders only."""
        out: list[EngineRequest] = []
        budget = token_budget
        slots = max_requests
        q = self._interactive
        while budget > 0 and (req := q.peek_oldest()) is not None:
            slot = self.takes_slot(req)  # a requeued batch request needs none
            if slot and slots <= 0:
                break
            q.pop_oldest()
            slots -= slot
            out.append(req)
            budget -= prefill_estimate(req, cache)
        if not self._batch:
            return out
        limit = self.config.limit_blocks(cache)
        # Referenced by running requests now, plus what the running batch requests will
        # still add before they end, plus what this step's picks will hold.
        used = cache.num_blocks - cache.num_free_blocks + self._growth(cache.block_size)
        for req in out:
            used += self._blocks_needed(req, cache)
        while budget > 0:
            picked = self._next_batch(out, cache)
            if picked is None:
                break
            g, req = picked
            need = self._blocks_needed(req, cache)
            if used + need > limit and used > 0:
                g.members.appendleft(req)  # over the threshold: it waits for memory
                break
            self._take(req)
            self._admitted[req.request_id] = req
            out.append(req)
            used += need
            budget -= prefill_estimate(req, cache)
        return out

    def _growth(self, block_size: int) -> int:
        """KV blocks the running batch requests admitted here will still add: each one's
        final size (prompt plus predicted, else maximum, output) less what it has
        computed. Forgets those no longer running (finished, aborted, requeued)."""
        total = 0
        for rid, req in list(self._admitted.items()):
            if req.status is not RequestStatus.RUNNING:
                del self._admitted[rid]
                continue
            computed = -(-req.num_computed_tokens // block_size)
            total += max(_final_blocks(req, block_size) - computed, 0)
        return total

    def _next_batch(
        self, out: list[EngineRequest], cache: EngineView
    ) -> tuple[PrefixGroup, EngineRequest] | None:
        """The current group and its next member to admit, taken off its member list;
        None while the leader is still computing the shared prefix."""
        g = self._group
        while True:
            if g is None or (not g.members and not self._leader_pending(g, out, cache)):
                g = self._group = self.next_group(cache.block_size)
                if g is None:
                    return None
            if not g.members:
                return None  # leader still computing
            if g.leader is not None and self._leader_pending(g, out, cache):
                return None
            req = g.members.popleft()
            if req.request_id not in self._batch:
                continue  # left the pool meanwhile
            if g.leader is None or not self._prefix_cached(g, req, cache):
                g.leader = req  # computes the prefix; the rest wait for it
            return g, req

    def _prefix_cached(self, g: PrefixGroup, req: EngineRequest, cache: EngineView) -> bool:
        shared = g.prefix_blocks
        return not shared or cache.cached_prefix_tokens(req.block_hashes[:shared]) >= (
            shared * cache.block_size
        )

    def _leader_pending(self, g: PrefixGroup, out: list[EngineRequest], cache: EngineView) -> bool:
        """Whether the group's leader is still on its way to caching the shared prefix."""
        leader = g.leader
        if leader is None or self._prefix_cached(g, leader, cache):
            return False
        if leader in out or leader in self._interactive.front:
            return True  # chosen this step, or requeued: it will run soon
        return leader.status is RequestStatus.RUNNING

    def _blocks_needed(self, req: EngineRequest, cache: EngineView) -> int:
        """KV blocks ``req`` will hold at its end: prompt plus predicted (else maximum)
        output, less the whole blocks it finds cached now."""
        bs = cache.block_size
        cached = cache.cached_prefix_tokens(req.block_hashes) // bs
        return max(_final_blocks(req, bs) - cached, 0)


def _final_blocks(req: EngineRequest, block_size: int) -> int:
    """KV blocks of ``req``'s prompt plus predicted (else maximum) output."""
    out = int(req.predicted_output) or req.max_tokens
    return -(-(req.num_prompt_tokens + out) // block_size)
