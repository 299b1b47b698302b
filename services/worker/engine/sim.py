"""Simulated GPU engine (the ``sim`` backend): vLLM V1's scheduler as pure logic
(docs/design.md section 7).

Clock-agnostic: every call takes ``now`` (seconds), real or virtual. One step::

    plan = engine.plan_step(now)           # None: nothing to run
    ... wait plan.duration seconds ...
    outputs = engine.finish_step(plan, now_after)

Each step has a token budget (``max_batched_tokens``) and at most ``max_num_seqs`` requests
holding a sequence slot run; requests the local policy bounds by KV memory instead
(``LocalPolicy.takes_slot``: planned batch requests under ``batch_groups``) run beside them,
up to ``max_batched_tokens - max_num_seqs`` of them, so that one step still decodes every
running request and interactive requests keep every slot:
1. running requests in decode get one token each, in admission order;
2. running requests part-way through their prompt get their next chunk;
3. unless step 1 or 2 preempted someone, waiting requests are admitted in the local
   policy's order, each reusing its longest cached block prefix and getting a first chunk.
When a running request needs a KV block and none is free, the most recently admitted running
request not yet scheduled this step is preempted by recompute (vLLM V1): its blocks are
freed (still cached while unreferenced) and it goes to the front of the waiting queue, to
recompute its prompt and output so far later, most likely from the prefix cache.

A step computes KV for its scheduled tokens; a request whose known tokens are then all
computed samples one token (so the final prefill chunk yields the first token). Blocks that
are full of computed tokens enter the prefix cache after the step (BlockStored events).
Output tokens come from a fixed pool offset by crc32 of the request id: reproducible across
processes. Work per step is O(scheduled requests); nothing scans all blocks or requests.
"""

from __future__ import annotations

import zlib
from itertools import islice

from prefixmesh.services.worker.engine.block_cache import BlockCache, CachedEngine
from prefixmesh.services.worker.engine.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineRequest,
    EngineStats,
    RequestStatus,
    SimEngineConfig,
    StepOutput,
    StepPlan,
)
from prefixmesh.services.worker.engine.window import SlidingSums, engine_stats
from prefixmesh.services.worker.local.base import LocalPolicy
from prefixmesh.services.worker.local.fcfs import FcfsPolicy
from prefixmesh.shared.blocks import block_hashes
from prefixmesh.shared.costmodel import CostModel

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING


class SimEngine(CachedEngine):
    """A simulated GPU that schedules like vLLM; step times come from a CostModel."""

    def __init__(
        self,
        cost_model: CostModel,
        policy: LocalPolicy | None = None,
        config: SimEngineConfig | None = None,
    ) -> None:
        self.config = config or SimEngineConfig()
        self.cost_model = cost_model
        self.policy: LocalPolicy = policy if policy is not None else FcfsPolicy()
        self._init_limits()
        self._init_state()
        self._init_stats()

    def _init_limits(self) -> None:
        cfg, cost = self.config, self.cost_model
        self._block_size = cfg.block_size
        self._max_tokens = cfg.max_batched_tokens or cost.max_batched_tokens
        self._max_seqs = cfg.max_num_seqs or cost.max_num_seqs
        if self._max_seqs > self._max_tokens:  # vLLM's rule too; step 1 relies on it
            raise ValueError("max_num_seqs must not exceed max_batched_tokens")
        # Running requests without a slot at most: with every slot taken too, a step's
        # budget still decodes them all. 0: every request takes a slot.
        self._extra_seqs = self._max_tokens - self._max_seqs
        self._chunk_cap = cfg.max_prefill_chunk or self._max_tokens
        num_blocks = cfg.num_blocks or cost.kv_capacity_tokens // cfg.block_size
        self.cache = BlockCache(num_blocks, cfg.block_size)
        self._pool = cfg.output_token_pool
        # Decodes can be priced in aggregate when no sequence can reach the profile's
        # long-prompt threshold (e * s = s for a decode; s is bounded by the KV pool).
        self._aggregate_decodes = cost.kv_capacity_tokens <= cost.quadratic_threshold

    def _init_state(self) -> None:
        # Waiting (in the policy) and running requests by id.
        self._requests: dict[str, EngineRequest] = {}
        # Running requests in admission order (the last one is preempted first).
        self._running: list[EngineRequest] = []
        # Running requests that hold a sequence slot (``_takes_slot``).
        self._slotted = 0
        self._step_id = 0
        self._inflight: StepPlan | None = None
        # Free blocks when an admission last failed for KV memory (-1: not blocked). The
        # failed request heads the queue, so admissions wait until more blocks are free
        # instead of re-running the policy's selection every step under overload.
        self._admit_blocked_at = -1

    def _init_stats(self) -> None:
        span = self.config.stats_window_s
        # Per finished step: (seconds, decode tokens, all tokens).
        self._step_win = SlidingSums(span)
        # Per first admission: (prompt tokens, cached tokens, queue seconds).
        self._admit_win = SlidingSums(span)
        self._preemptions = 0

    # ------------------------------------------------------------------ requests

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._block_size

    @property
    def max_num_seqs(self) -> int:
        """Most requests running at once (EngineView)."""
        return self._max_seqs

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests in the local policy's queue."""
        return len(self.policy)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    def get(self, request_id: str) -> EngineRequest | None:
        """A waiting or running request by id."""
        return self._requests.get(request_id)

    def add(self, req: EngineRequest, now: float) -> None:
        """Queue a new request in the local policy; raises ValueError if it can never fit."""
        bs = self._block_size
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        if req.status is not _WAITING or req.first_scheduled is not None:
            raise ValueError(f"request {req.request_id!r} was already used")
        if not req.block_hashes:
            req.block_hashes = block_hashes(req.prompt_token_ids, req.tenant, bs)
        elif len(req.block_hashes) != req.num_prompt_tokens // bs:
            raise ValueError(f"request {req.request_id!r}: block_hashes do not match the prompt")
        else:
            req.block_hashes = list(req.block_hashes)  # grows with output; keep the caller's
        # KV is needed for every token but the last generated one.
        needed = -(-(req.num_prompt_tokens + req.target_output_tokens - 1) // bs)
        if needed > self.cache.num_blocks:
            raise ValueError(
                f"request {req.request_id!r} needs {needed} KV blocks; "
                f"the engine has {self.cache.num_blocks}"
            )
        req.arrival = now
        req.token_seed = zlib.crc32((req.sample_key or req.request_id).encode())
        self._requests[req.request_id] = req
        self.policy.push(req, now)

    def update_prediction(self, request_id: str, remaining_tokens: float) -> bool:
        """Pass a refined prediction of a waiting or running request's remaining output
        tokens to the local policy (TRAIL's per-step refinement); False if unknown."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.policy.update_prediction(req, remaining_tokens)
        return True

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a waiting or running request at once, freeing its blocks (they stay cached
        while unreferenced); False if unknown or already done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is _WAITING:
            self.policy.remove(request_id)
            self._admit_blocked_at = -1  # it may have been the request that did not fit
        else:
            self._running.remove(req)
            self._slotted -= self._takes_slot(req)
            plan = self._inflight
            if plan is not None and req in plan.requests:
                # Its step's work is lost; finish_step must not touch it.
                i = plan.requests.index(req)
                del plan.requests[i], plan.batch[i]
            self.cache.free(req.block_ids)
            req.block_ids = []
        req.status = RequestStatus.ABORTED
        req.finish_reason = FINISH_ABORT
        req.finish_time = now
        return True

    # ------------------------------------------------------------------ stepping

    def plan_step(self, now: float) -> StepPlan | None:
        """Schedule the next step (see module doc); None when there is nothing to run."""
        if self._inflight is not None:
            raise RuntimeError("finish_step() the previous plan before planning another")
        self._step_id += 1
        plan = StepPlan(self._step_id, now)
        waiting = len(self.policy)
        if waiting and self._running:
            for victim in self.policy.preempt(now, self._running, self):
                self._preempt(victim, plan, requeue_front=False)
                self.policy.push(victim, now)  # back in the policy's own order
        chosen = len(plan.preempted)  # the policy's own preemptions make room to admit
        budget, mid_prefill = self._schedule_decodes(plan, self._max_tokens)
        if mid_prefill:
            budget = self._schedule_prefills(plan, budget)
        # As vLLM: no admissions in a step that ran out of KV memory.
        if (
            waiting
            and budget > 0
            and len(plan.preempted) == chosen
            and self.cache.num_free > self._admit_blocked_at
        ):
            self._admit_waiting(plan, budget, now)
        if not plan.requests:
            return None
        k = plan.decode_entries
        if k and self._aggregate_decodes:
            plan.duration = self.cost_model.step_time(
                islice(plan.batch, k, None), k, plan.decode_ctx)
        else:
            plan.duration = self.cost_model.step_time(plan.batch)
        self._inflight = plan
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> tuple[int, bool]:
        """Step 1: one token for each running request whose known tokens are all computed
        but the last; returns the budget left and whether any request is mid-prefill.
        No budget checks: at most max_batched_tokens requests run (``_admit_waiting``).
        This loop and finish_step's are the per-step hot path: keep them lean."""
        bs = self._block_size
        reqs, batch = plan.requests, plan.batch
        allocate_one = self.cache.allocate_one
        mid_prefill = False
        prompt_tail = 0  # the last token of a prompt is prefill work, not decode
        ctx = 0
        # _grow may preempt (remove) entries, but only ones after req (or req itself, and
        # then the loop ends), which a list iterator tolerates.
        for req in self._running:
            c = req.num_computed_tokens
            if req.num_tokens - c != 1:
                mid_prefill = True
                continue
            # A running request holds ceil(c / bs) blocks, so a new one is due at c % bs == 0.
            if not c % bs:
                block = allocate_one()
                if block >= 0:
                    req.block_ids.append(block)
                elif not self._grow(req, 1, plan):
                    break  # req preempted itself: it was the last one running
            reqs.append(req)
            batch.append((1, c + 1))
            ctx += c + 1
            if c < req.num_prompt_tokens:
                prompt_tail += 1
        plan.decode_entries = len(reqs)
        plan.decode_ctx = ctx
        plan.decode_tokens += len(reqs) - prompt_tail
        plan.prefill_tokens += prompt_tail
        return budget - len(reqs), mid_prefill

    def _schedule_prefills(self, plan: StepPlan, budget: int) -> int:
        """Step 2: the next chunk of each running request part-way through its prompt."""
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            i += 1
            c = req.num_computed_tokens
            if req.num_tokens - c <= 1:
                continue  # decode: scheduled in step 1
            n = min(req.num_tokens - c, budget, self._chunk_cap)
            if not self._grow(req, n, plan):
                break
            plan.requests.append(req)
            plan.batch.append((n, c + n))
            plan.prefill_tokens += n
            budget -= n
        return budget

    def _grow(self, req: EngineRequest, n: int, plan: StepPlan) -> bool:
        """Give ``req`` blocks for ``n`` more tokens, preempting the latest unscheduled
        running requests as needed; False if ``req`` itself had to go."""
        bs = self._block_size
        needed = -(-(req.num_computed_tokens + n) // bs) - len(req.block_ids)
        if needed <= 0:
            return True
        while (new := self.cache.allocate(needed)) is None:
            scheduled = set(plan.requests)  # rare path: memory is short
            victim = next(r for r in reversed(self._running) if r not in scheduled)
            self._preempt(victim, plan)
            if victim is req:
                return False
        req.block_ids.extend(new)
        return True

    def _preempt(self, req: EngineRequest, plan: StepPlan, requeue_front: bool = True) -> None:
        """Preempt by recompute: free the blocks and (by default, as vLLM does when memory
        runs out) put the request back at the front of the queue."""
        req.hash_blocks(req.num_tokens // self._block_size, self._block_size)  # to match later
        self._running.remove(req)
        self._slotted -= self._takes_slot(req)
        self.cache.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_stored_blocks = 0
        req.status = _WAITING
        req.num_preemptions += 1
        self._preemptions += 1
        if requeue_front:
            self.policy.requeue_front([req])
        plan.preempted.append(req.request_id)

    def _takes_slot(self, req: EngineRequest) -> bool:
        """Whether ``req`` counts against ``max_num_seqs`` while it runs."""
        return self._extra_seqs <= 0 or self.policy.takes_slot(req)

    def _admit_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        """Step 3: admit what the local policy selects, slot holders up to
        ``max_num_seqs``, the others up to ``_extra_seqs``; what cannot go now goes back
        to the front of the queue in the policy's order."""
        slots = self._max_seqs - self._slotted
        picked = self.policy.select(now, slots, budget, self)
        held: list[EngineRequest] = []
        for i, req in enumerate(picked):
            if budget <= 0:
                held += picked[i:]
                break
            slot = self._takes_slot(req)
            if slots <= 0 if slot else len(self._running) - self._slotted >= self._extra_seqs:
                held.append(req)  # no room of its kind; the other kind may still go
                continue
            n = self._admit(req, budget, plan, now)
            if n == 0:  # KV memory short
                held += picked[i:]
                self._admit_blocked_at = self.cache.num_free
                break
            self._admit_blocked_at = -1
            budget -= n
            slots -= slot
        if held:
            self.policy.requeue_front(held)

    def _admit(self, req: EngineRequest, budget: int, plan: StepPlan, now: float) -> int:
        """Start ``req`` with its cached prefix and a first chunk; returns the tokens
        scheduled (0 = no KV room)."""
        bs = self._block_size
        # Reuse whole cached blocks, never the one holding the last token (vLLM).
        hits = self.cache.match_prefix(req.block_hashes, (req.num_tokens - 1) // bs)
        cached = len(hits) * bs
        n = min(req.num_tokens - cached, budget, self._chunk_cap)
        new = self.cache.acquire(hits, -(-(cached + n) // bs) - len(hits))
        if new is None:
            return 0
        hits.extend(new)
        req.block_ids = hits
        req.num_computed_tokens = cached
        req.num_stored_blocks = cached // bs
        req.status = _RUNNING
        self._running.append(req)
        self._slotted += self._takes_slot(req)
        if req.first_scheduled is None:
            req.first_scheduled = now
            req.num_cached_tokens = cached
            self._admit_win.add(now, req.num_prompt_tokens, cached, now - req.arrival)
        plan.requests.append(req)
        plan.batch.append((n, cached + n))
        plan.prefill_tokens += n
        return n

    def finish_step(
        self, plan: StepPlan, now: float, finished_only: bool = False
    ) -> list[StepOutput]:
        """Apply a planned step's results: KV computed, tokens sampled, requests finished.

        Returns one output per scheduled request, or with ``finished_only`` only those of
        requests that finished: the cluster simulator reads nothing else, and building an
        output per running request per step is most of a step's cost there.
        """
        if plan is not self._inflight:
            raise RuntimeError("finish_step() got a plan that is not the one in flight")
        self._inflight = None
        bs, pool = self._block_size, self._pool
        npool = len(pool)
        outputs: list[StepOutput] = []
        emit = outputs.append
        every = not finished_only
        done = False
        for req, (n, _) in zip(plan.requests, plan.batch, strict=True):
            c = req.num_computed_tokens = req.num_computed_tokens + n
            if c // bs > req.num_stored_blocks:
                self._store_computed(req)
            if c < req.num_tokens:  # non-final prefill chunk
                if every:
                    emit(StepOutput(req.request_id, [], False, None, req.num_cached_tokens,
                                    False, req))
                continue
            out = req.output_token_ids
            k = len(out)
            tok = pool[(req.token_seed + k) % npool]
            out.append(tok)
            req.num_tokens = c + 1  # c == num_tokens here
            first = not k  # a request has no first_token_time until it has a token
            if first:
                req.first_token_time = now
            if k + 1 < req.target_output_tokens:
                if every:
                    emit(StepOutput(req.request_id, [tok], False, None, req.num_cached_tokens,
                                    first, req))
                continue
            reason = FINISH_LENGTH if k + 1 >= req.max_tokens else FINISH_STOP
            self._finish(req, reason, now)
            done = True
            emit(StepOutput(req.request_id, [tok], True, reason, req.num_cached_tokens, first, req))
        if done:
            self._running = [r for r in self._running if r.status is _RUNNING]
        self._step_win.add(
            now, now - plan.started, plan.decode_tokens, plan.decode_tokens + plan.prefill_tokens
        )
        return outputs

    def _finish(self, req: EngineRequest, reason: str, now: float) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self._slotted -= self._takes_slot(req)
        self.cache.free(req.block_ids)
        req.block_ids = []
        del self._requests[req.request_id]

    def _store_computed(self, req: EngineRequest) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        bs, hashes = self._block_size, req.block_hashes
        first, full = req.num_stored_blocks, req.num_computed_tokens // bs
        if len(hashes) < full:  # output blocks are hashed lazily: here or at preemption
            req.hash_blocks(full, bs)
        parent = hashes[first - 1] if first else None
        tokens = req.known_tokens(first * bs, full * bs)
        self.cache.store(req.block_ids, first, hashes[first:full], parent, tokens)
        req.num_stored_blocks = full

    # ------------------------------------------------------------------ cache and stats

    def reset_cache(self) -> bool:
        """Drop the prefix cache (emits AllBlocksCleared); like vLLM, refused (False) while
        requests are running."""
        if self._running:
            return False
        self.cache.reset()
        return True

    def stats(self, now: float) -> EngineStats:
        """Load snapshot; O(waiting + running) for outstanding_tokens."""
        return engine_stats(
            self._step_win, self._admit_win, now, self._requests.values(),
            running=len(self._running), waiting=len(self.policy),
            free_blocks=self.cache.num_free, total_blocks=self.cache.num_blocks,
            block_size=self._block_size, preemptions=self._preemptions)
