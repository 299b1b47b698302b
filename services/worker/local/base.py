"""The local-policy interface: the worker's own waiting queue and its admission order.

Each step, once the running batch has its decode and chunked-prefill tokens, the engine
offers what is left (free sequence slots, token budget) if anyone waits:
``select(now, max_requests, token_budget, cache)`` returns the requests to admit, in order,
removed from the queue. The engine admits a prefix of them; those it cannot place (KV
memory short, budget spent) and those it preempts by recompute because KV memory ran out
come back through ``requeue_front`` and must be offered first next time (vLLM's
waiting-queue prepend). Requests the policy itself asks to preempt (``preempt``) come back
through ``push`` instead.

How the five docs/design.md section 6 policies fit:
- ``fcfs``: arrival order.
- ``prefix_fair`` (Preble): ``select`` bins waiting requests by cached fraction, probing
  ``cache`` (which changes step to step), and takes from the bins in proportion to rank.
- ``sprpt_limited`` (TRAIL): ``select`` orders by predicted remaining output
  (``EngineRequest.predicted_output``, or the latest refinement passed to
  ``update_prediction``, less ``num_output_tokens``); ``preempt`` names running requests
  still inside their preemptable first ``floor(c * r)`` tokens when a shorter one waits
  and the engine has no free sequence slot or KV memory for it (``EngineView``).
- ``srjf_calibrated`` (PrefillOnly): ``select`` recomputes its score against ``cache``
  every step (it is called every step) and returns at most one request.
- ``batch_groups`` (BatchLLM): ``select`` returns whole prefix groups while the
  ``token_budget`` and its own KV token threshold allow, not a request count: its planned
  batch requests hold no sequence slot (``takes_slot``), so the engine runs them beyond
  ``max_num_seqs`` and ``max_requests`` counts only the others.

The engine passes itself as ``cache``: an ``EngineView``, i.e. the ``CacheProbe`` plus
the capacity figures (KV blocks, free blocks, sequence slots) the last two policies need.
Policies that only probe the cache declare the narrower ``CacheProbe``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Protocol, runtime_checkable

from prefixmesh.services.worker.engine.types import EngineRequest


@runtime_checkable
class CacheProbe(Protocol):
    """Read-only view of the engine's prefix cache (the engine implements it)."""

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        ...

    def cached_prefix_tokens(self, block_hashes: Sequence[int]) -> int:
        """Tokens of the longest cached prefix of ``block_hashes``; no side effects."""
        ...


@runtime_checkable
class EngineView(CacheProbe, Protocol):
    """The cache probe plus the engine's capacity, as the engine passes it to a policy."""

    @property
    def num_blocks(self) -> int:
        """KV blocks in the engine's pool (its KV memory, in blocks of ``block_size``)."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """KV blocks allocatable now (empty plus evictable cached ones)."""
        ...

    @property
    def max_num_seqs(self) -> int:
        """Most requests the engine runs at once (sequence slots)."""
        ...


def tokens_to_prefill(req: EngineRequest, cached_tokens: int, block_size: int) -> int:
    """Tokens the engine computes to admit ``req`` with ``cached_tokens`` of its prefix
    cached: the reused prefix is whole blocks and (as in vLLM) never covers the last token."""
    cap = (req.num_tokens - 1) // block_size * block_size
    return req.num_tokens - min(cached_tokens, cap)


def prefill_estimate(req: EngineRequest, cache: CacheProbe) -> int:
    """Tokens the engine would compute to admit ``req`` now."""
    return tokens_to_prefill(req, cache.cached_prefix_tokens(req.block_hashes), cache.block_size)


def take_in_order(pop: Callable[[], EngineRequest | None], max_requests: int,
                  token_budget: int, cache: CacheProbe) -> list[EngineRequest]:
    """Requests from ``pop`` in its order until it runs dry, ``max_requests`` are taken or
    their prefill estimates use up ``token_budget`` (``select``'s contract)."""
    out: list[EngineRequest] = []
    budget = token_budget
    while len(out) < max_requests and budget > 0:
        req = pop()
        if req is None:
            break
        out.append(req)
        budget -= prefill_estimate(req, cache)
    return out


def pop_by_id(lane: deque[EngineRequest], request_id: str) -> EngineRequest | None:
    """Take the request ``request_id`` out of ``lane`` (a front lane); None if absent."""
    for i, r in enumerate(lane):
        if r.request_id == request_id:
            del lane[i]
            return r
    return None


@runtime_checkable
class LocalPolicy(Protocol):
    """A worker's waiting queue and admission order. Pure logic: no clock, no I/O."""

    name: str

    def __len__(self) -> int:
        """Requests waiting (new and requeued)."""
        ...

    def __iter__(self) -> Iterator[EngineRequest]:
        """Every waiting request, in no guaranteed order."""
        ...

    def push(self, req: EngineRequest, now: float) -> None:
        """Queue a request: a new arrival, or a running one this policy chose to preempt
        (``preempt``), which goes back in the policy's own order."""
        ...

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a waiting request out (abort); None if it is not waiting here."""
        ...

    def requeue_front(self, reqs: Sequence[EngineRequest]) -> None:
        """Put back requests the engine could not admit or preempted, ahead of all others,
        in the given order."""
        ...

    def select(
        self, now: float, max_requests: int, token_budget: int, cache: EngineView
    ) -> list[EngineRequest]:
        """Requests to admit this step, in order, removed from the queue; at most
        ``max_requests`` that take a slot (``takes_slot``), stopping once their prefill
        estimates use up ``token_budget``."""
        ...

    def takes_slot(self, req: EngineRequest) -> bool:
        """Whether ``req``, once running, holds one of the engine's ``max_num_seqs`` sequence
        slots (``select``'s ``max_requests`` counts only these). Default: every request
        does; a policy that bounds some requests by KV memory itself answers False for
        them (``batch_groups``: planned batch requests, docs/design.md section 6)."""
        return True

    def preempt(
        self, now: float, running: Sequence[EngineRequest], cache: EngineView
    ) -> list[EngineRequest]:
        """Running requests (from ``running``) the engine should preempt by recompute before
        planning this step, to make room for waiting ones; called only while requests wait
        (by the ``sim`` and ``hf`` engines; ``vllm`` schedules in vLLM itself).
        Unlike a step that ran out of KV memory, admissions still happen in that step.
        Default: none."""
        return []

    def update_prediction(self, req: EngineRequest, remaining_tokens: float) -> None:
        """A refined prediction of the output tokens ``req`` (waiting or running) has left,
        counted from now. Default: record it on the request (``refined_output``); policies
        that order by it also re-rank the request."""
        req.refined_output = req.num_output_tokens + max(remaining_tokens, 0.0)


class WaitingQueue:
    """Arrival-ordered waiting requests with O(1) removal, plus a front lane for requeued
    ones. Building block for policies; not a policy itself."""

    def __init__(self) -> None:
        # Requeued (preempted or not admitted) requests, offered before anything else.
        self.front: deque[EngineRequest] = deque()
        # Everything else, by arrival.
        self.queue: OrderedDict[str, EngineRequest] = OrderedDict()

    def __len__(self) -> int:
        return len(self.front) + len(self.queue)

    def __iter__(self) -> Iterator[EngineRequest]:
        return chain(self.front, self.queue.values())

    def push(self, req: EngineRequest) -> None:
        """Append at the back."""
        if req.request_id in self.queue:
            raise ValueError(f"request {req.request_id!r} is already waiting")
        self.queue[req.request_id] = req

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a request out of either lane."""
        req = self.queue.pop(request_id, None)
        return req if req is not None else pop_by_id(self.front, request_id)

    def requeue_front(self, reqs: Sequence[EngineRequest]) -> None:
        """Prepend to the front lane keeping ``reqs``' order."""
        self.front.extendleft(reversed(reqs))

    def peek_oldest(self) -> EngineRequest | None:
        """What ``pop_oldest`` would return, left in place."""
        if self.front:
            return self.front[0]
        return next(iter(self.queue.values()), None)

    def pop_oldest(self) -> EngineRequest | None:
        """Front lane first, then earliest arrival."""
        if self.front:
            return self.front.popleft()
        if self.queue:
            return self.queue.popitem(last=False)[1]
        return None


class QueuedPolicy(LocalPolicy):
    """A policy over one ``WaitingQueue``: the bookkeeping every arrival-ordered policy
    shares (length, iteration, push, remove, requeue). Subclasses set ``name`` and write
    ``select`` (and ``preempt`` if they preempt)."""

    def __init__(self) -> None:
        self._q = WaitingQueue()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(self._q)

    def push(self, req: EngineRequest, now: float) -> None:
        """Queue at the back (a request's wait counts from ``req.arrival``)."""
        self._q.push(req)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a waiting request out."""
        return self._q.remove(request_id)

    def requeue_front(self, reqs: Sequence[EngineRequest]) -> None:
        """Put requests back ahead of everyone, in order."""
        self._q.requeue_front(reqs)
