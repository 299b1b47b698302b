"""``sprpt_limited``: TRAIL's shortest predicted remaining time first, with limited
preemption (docs/design.md section 6; TRAIL, "Don't Stop Me Now", section 4).

Key of a request: its predicted remaining output tokens, ``p - num_output_tokens`` where
``p`` is the latest refinement (``refined_output``, set by ``update_prediction``) or else
the initial prediction (``predicted_output``) or else ``default_prediction``, at most the
request's ``max_tokens`` (no reply outruns its budget); never below 0.
Waiting requests are admitted smallest key first (ties: arrival order).

Limited preemption: a running request may be preempted (by recompute) only while it has
produced fewer than ``floor(c * r)`` output tokens, ``r`` its initial prediction
(``predicted_output``, else ``default_prediction``, at most ``max_tokens``) and ``c`` =
``preempt_fraction`` (TRAIL's 0.8). Past that window it is close enough to done that
evicting it costs more than it saves (its KV is large, its remaining time small).
``preempt`` pairs the shortest waiting requests, in admission order, with the running
requests inside their window that have the longest keys, evicting one only when the
waiting request's key is strictly shorter and the engine has no free sequence slot or KV
memory for it. The ``sim`` and ``hf`` engines call it before each step; a victim goes back
into the waiting heap (``push``).

Refinement (``update_prediction``, the worker's TRAIL refiner on ``hf``, recorded readings
in the simulator) re-ranks both sets: a waiting request is re-inserted in the heap at once,
and a running one, whose key ``preempt`` reads afresh at every call, may become (or stop
being) the victim at the next step; a preempted request waits with its latest reading.

Cost: the waiting set is a binary heap with lazy deletion (stale entries are skipped and
the heap is rebuilt when they outnumber live ones), so push, remove and re-rank are
O(log n); ``select`` is O(k log n) for k admissions; ``preempt`` is O(running log running
+ k log n) for k candidates looked at (at most one per preemptable running request).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import count

from prefixmesh.services.worker.engine.types import EngineRequest
from prefixmesh.services.worker.local.base import (
    EngineView,
    LocalPolicy,
    pop_by_id,
    prefill_estimate,
    take_in_order,
)

# Heap entries kept before a rebuild: live ones times this factor, plus a floor (entries).
_COMPACT_FACTOR = 2
_COMPACT_FLOOR = 64


@dataclass(frozen=True, slots=True)
class SprptConfig:
    """Knobs of ``sprpt_limited``."""

    # TRAIL's c: a running request is preemptable during its first floor(c * r) output
    # tokens, r its initial prediction.
    preempt_fraction: float = 0.8
    # Output tokens assumed for a request without predicted_output or refinement (tokens);
    # the worker's own default mean output (WorkerConfig.default_output_mean) is 128 too.
    default_prediction: float = 128.0
    # Running requests one ``preempt`` call names at most: bounds the recompute one step
    # can cause.
    max_preempt_per_step: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.preempt_fraction <= 1.0:
            raise ValueError("preempt_fraction must be in [0, 1]")
        if self.default_prediction < 1 or self.max_preempt_per_step < 0:
            raise ValueError(f"invalid sprpt_limited config: {self}")


class SprptPolicy(LocalPolicy):
    """Shortest predicted remaining output first; preemption only early in a request."""

    name = "sprpt_limited"

    def __init__(self, config: SprptConfig | None = None) -> None:
        self.config = config or SprptConfig()
        # Requeued (not admitted, or preempted for memory) requests, offered first.
        self._front: deque[EngineRequest] = deque()
        # (key, seq, request); an entry is live iff _live[request_id][0] == seq.
        self._heap: list[tuple[float, int, EngineRequest]] = []
        # Waiting requests of the heap by id: (seq of their live entry, request).
        self._live: dict[str, tuple[int, EngineRequest]] = {}
        self._seq = count()

    # ------------------------------------------------------------------ keys

    def remaining(self, req: EngineRequest) -> float:
        """Predicted output tokens ``req`` has left (tokens, >= 0)."""
        total = req.refined_output or req.predicted_output or self.config.default_prediction
        return max(min(total, req.max_tokens) - req.num_output_tokens, 0.0)

    def preempt_window(self, req: EngineRequest) -> int:
        """Output tokens during which ``req`` may be preempted: floor(c * r)."""
        r = min(req.predicted_output or self.config.default_prediction, req.max_tokens)
        return math.floor(self.config.preempt_fraction * r)

    def preemptable(self, req: EngineRequest) -> bool:
        """Whether ``req`` is still inside its preemptable window."""
        return req.num_output_tokens < self.preempt_window(req)

    # ------------------------------------------------------------------ queue

    def __len__(self) -> int:
        return len(self._front) + len(self._live)

    def __iter__(self) -> Iterator[EngineRequest]:
        yield from self._front
        yield from (r for _, r in self._live.values())

    def push(self, req: EngineRequest, now: float) -> None:
        """Queue by predicted remaining output."""
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id!r} is already waiting")
        self._insert(req)

    def _insert(self, req: EngineRequest) -> None:
        seq = next(self._seq)
        self._live[req.request_id] = (seq, req)
        heapq.heappush(self._heap, (self.remaining(req), seq, req))

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a waiting request out (its heap entry goes stale)."""
        entry = self._live.pop(request_id, None)
        if entry is not None:
            self._maybe_compact()
            return entry[1]
        return pop_by_id(self._front, request_id)

    def requeue_front(self, reqs: Sequence[EngineRequest]) -> None:
        """Put requests back ahead of everyone, in order."""
        self._front.extendleft(reversed(reqs))

    def update_prediction(self, req: EngineRequest, remaining_tokens: float) -> None:
        """Record the refinement and, if ``req`` waits in the ranked heap, re-rank it."""
        req.refined_output = req.num_output_tokens + max(remaining_tokens, 0.0)
        if req.request_id in self._live:
            self._insert(req)  # the older entry goes stale
            self._maybe_compact()

    def _pop(self) -> EngineRequest | None:
        """The waiting request with the smallest key, removed."""
        entry = self._pop_entry()
        return None if entry is None else entry[2]

    def _maybe_compact(self) -> None:
        if len(self._heap) > _COMPACT_FACTOR * len(self._live) + _COMPACT_FLOOR:
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)

    # ------------------------------------------------------------------ scheduling

    def select(
        self, now: float, max_requests: int, token_budget: int, cache: EngineView
    ) -> list[EngineRequest]:
        """Requeued requests first, then shortest predicted remaining output first."""
        def pop() -> EngineRequest | None:
            return self._front.popleft() if self._front else self._pop()

        return take_in_order(pop, max_requests, token_budget, cache)

    def preempt(
        self, now: float, running: Sequence[EngineRequest], cache: EngineView
    ) -> list[EngineRequest]:
        """Running requests inside their window to evict for strictly shorter waiting ones
        that the engine has no slot or KV memory for (see module doc)."""
        limit = self.config.max_preempt_per_step
        if limit == 0:
            return []
        # Longest predicted remaining first: evicting those helps most.
        victims = sorted(
            ((self.remaining(r), r) for r in running if self.preemptable(r)),
            key=lambda kr: kr[0],
        )
        if not victims:
            return []
        bs = cache.block_size
        slots = cache.max_num_seqs - len(running)
        free = cache.num_free_blocks
        out: list[EngineRequest] = []
        looked: list[tuple[float, int, EngineRequest]] = []  # heap entries to put back
        front = iter(list(self._front))
        try:
            while victims and len(out) < limit:
                cand = next(front, None)
                if cand is None:
                    entry = self._pop_entry()
                    if entry is None:
                        break
                    looked.append(entry)
                    cand = entry[2]
                need = -(-prefill_estimate(cand, cache) // bs)  # KV blocks to admit it
                key = self.remaining(cand)
                while (slots <= 0 or need > free) and victims and victims[-1][0] > key:
                    _, victim = victims.pop()
                    out.append(victim)
                    slots += 1
                    free += len(victim.block_ids)
                    if len(out) >= limit:
                        break
                if slots <= 0 or need > free:
                    break  # no victim helps this one, nor (being longer) anyone after it
                slots -= 1
                free -= need
        finally:
            for entry in looked:  # candidates stay waiting, in their places
                self._live[entry[2].request_id] = (entry[1], entry[2])
                heapq.heappush(self._heap, entry)
        return out

    def _is_live(self, entry: tuple[float, int, EngineRequest]) -> bool:
        live = self._live.get(entry[2].request_id)
        return live is not None and live[0] == entry[1]

    def _pop_entry(self) -> tuple[float, int, EngineRequest] | None:
        """Pop the smallest live heap entry (the request leaves the waiting set)."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            if self._is_live(entry):
                del self._live[entry[2].request_id]
                return entry
        return None
