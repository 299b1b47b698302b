"""The ``sim`` backend in a live worker: ``SimEngine``'s steps paced on the wall clock.

``SimEngine`` (``sim.py``) is pure: it plans a step and finishes it at whatever clock
reading it is given, which is what the cluster simulator needs. A live worker instead runs
the steps back to back in real time: each lasts its modelled GPU time, times
``time_scale`` (``pacing.py``). This module adds that loop, the tokens' text (the sim's
outputs are real token ids of the served tokenizer) and, for requests that ask for them,
deterministic pseudo log-probabilities (``sim_logprobs.py``: shaped like a model's, meaning
nothing about the text).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.engine.base import Emit, OnStep, PublishKv
from prefixmesh.services.worker.engine.pacing import Pacer
from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import (
    EngineRequest,
    EngineStats,
    SimEngineConfig,
    StepOutput,
)
from prefixmesh.services.worker.local.base import LocalPolicy
from prefixmesh.services.worker.engine.sim_logprobs import scored_token, token_logprobs
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.text.tokenizer import TextTokenizer
from prefixmesh.shared.wire import KvEvent, SamplingParams, TokenLogprob

# Distinct word-like token ids the sim's outputs cycle through (readable text).
OUTPUT_POOL_SIZE = 256


@dataclass(slots=True)
class _Scored:
    """What a request asked for beyond tokens: log-probabilities, allowed tokens."""

    sampling: SamplingParams
    prompt: list[int]
    sample_key: str


class LiveSimEngine:
    """``SimEngine`` behind the worker's ``Engine`` interface (``engine/base.py``)."""

    detokenizes = False

    def __init__(self, cost: CostModel, policy: LocalPolicy, tok: TextTokenizer,
                 time_scale: float = 1.0) -> None:
        self.tokenizer: TextTokenizer | None = tok
        self.sim = SimEngine(cost, policy, SimEngineConfig(
            output_token_pool=tuple(tok.word_token_ids(OUTPUT_POOL_SIZE))))
        # The model clock: wall seconds / time_scale (pacing.py).
        self.pacer = Pacer(time_scale)
        self._wake = asyncio.Event()
        self._scored: dict[str, _Scored] = {}

    # ------------------------------------------------------------------ EngineView

    @property
    def block_size(self) -> int:
        return self.sim.block_size

    @property
    def num_blocks(self) -> int:
        return self.sim.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.sim.num_free_blocks

    @property
    def max_num_seqs(self) -> int:
        return self.sim.max_num_seqs

    @property
    def num_running(self) -> int:
        return self.sim.num_running

    @property
    def num_waiting(self) -> int:
        return self.sim.num_waiting

    def cached_prefix_tokens(self, block_hashes: list[int]) -> int:
        return self.sim.cached_prefix_tokens(block_hashes)

    # ------------------------------------------------------------------ requests

    def now(self) -> float:
        """Model seconds."""
        return self.pacer.now()

    def add(self, req: EngineRequest, now: float, sampling: SamplingParams) -> None:
        self.sim.add(req, now)
        if sampling.logprobs is not None or sampling.allowed_token_ids:
            self._scored[req.request_id] = _Scored(sampling, req.prompt_token_ids,
                                                   req.sample_key)
        self._wake.set()

    def abort(self, request_id: str, now: float) -> bool:
        self._scored.pop(request_id, None)
        ok = self.sim.abort(request_id, now)
        self._wake.set()
        return ok

    def update_prediction(self, request_id: str, remaining_tokens: float) -> bool:
        return self.sim.update_prediction(request_id, remaining_tokens)

    def snapshot_events(self) -> list[KvEvent]:
        return self.sim.snapshot_events()

    def reset_cache(self) -> bool:
        """Drop the prefix cache when idle; a flush starts a benchmark point, so the step
        lag is counted afresh."""
        ok = self.sim.reset_cache()
        if ok:
            self.pacer.reset_lag()
        self._wake.set()  # the idle loop publishes the AllBlocksCleared event
        return ok

    def stats(self, now: float) -> EngineStats:
        return self.sim.stats(now)

    def info(self) -> dict[str, Any]:
        """The sim clock and how late its steps ran since the last flush."""
        return {"time_scale": self.pacer.scale, "step_lag": self.pacer.lag.as_dict()}

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ running

    async def run(self, emit: Emit, publish_kv: PublishKv, on_step: OnStep | None = None
                  ) -> None:
        """Run steps back to back while there is work; each lasts its modelled GPU time
        (times ``time_scale`` in wall time).

        Steps are scheduled on an absolute timeline in model seconds (the next starts when
        the previous ends, or now if idle), so publishing overhead does not stretch
        simulated time; a wake-up later than planned does, and is counted as step lag.
        """
        pacer, sim = self.pacer, self.sim
        gpu_free_at = pacer.now()
        while True:
            start = max(pacer.now(), gpu_free_at)
            plan = sim.plan_step(start)
            if plan is None:
                await publish_kv(sim.take_kv_events())
                self._wake.clear()
                await self._wake.wait()
                gpu_free_at = pacer.now()
                continue
            gpu_free_at = start + plan.duration
            await asyncio.sleep(pacer.sleep_for(gpu_free_at))
            pacer.woke(gpu_free_at, plan.duration)
            outputs = sim.finish_step(plan, gpu_free_at)
            if on_step is not None:
                on_step(plan.duration)
            for out in outputs:
                scored = self._scored.get(out.request_id)
                if scored is None:
                    await emit(out)
                    continue
                if out.finished:
                    del self._scored[out.request_id]
                out, logprobs = self._score(scored, out)
                await emit(out, "", logprobs)
            await publish_kv(sim.take_kv_events())

    def _score(self, scored: _Scored, out: StepOutput
               ) -> tuple[StepOutput, list[TokenLogprob] | None]:
        """The step's tokens (the best allowed candidate when the request restricts them)
        and their pseudo log-probabilities (``sim_logprobs.py``)."""
        if not out.new_token_ids:
            return out, None
        s = scored.sampling
        k = s.logprobs or 0
        if s.allowed_token_ids:
            entries = [scored_token(scored.prompt, s.allowed_token_ids, k, self._token_text)
                       for _ in out.new_token_ids]
            out = msgspec.structs.replace(out, new_token_ids=[e.token_id for e in entries])
        else:
            index = out.request.num_output_tokens - len(out.new_token_ids)
            pool = self.sim.config.output_token_pool
            entries = [token_logprobs(scored.sample_key, index + i, t, pool, k,
                                      self._token_text)
                       for i, t in enumerate(out.new_token_ids)]
        return out, entries if s.logprobs is not None else None

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


async def open_engine(cfg: WorkerConfig, cost: CostModel, policy: LocalPolicy
                      ) -> LiveSimEngine:
    """The sim backend for a worker config (``engine/registry.py``)."""
    loop = asyncio.get_running_loop()
    tok = await loop.run_in_executor(None, TextTokenizer.load, cfg.tokenizer_path or None)
    return LiveSimEngine(cost, policy, tok, cfg.time_scale)


def missing_dependencies() -> str | None:
    """The sim needs nothing beyond the core install."""
    return None
