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
from prefixmesh.services.worker.engine.sim_logprobs import scored_token, token_logprobs
from prefixmesh.services.worker.engine.types import (
    EngineRequest,
    SimEngineConfig,
    StepOutput,
)
from prefixmesh.services.worker.local.base import LocalPolicy
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.text.tokenizer import TextTokenizer
from prefixmesh.shared.wire import SamplingParams, TokenLogprob

# Distinct word-like token ids the sim's outputs cycle through (readable text).
OUTPUT_POOL_SIZE = 256


@dataclass(slots=True)
class _Scored:
    """What a request asked for beyond tokens: log-probabilities, allowed tokens."""

    sampling: SamplingParams
    prompt: list[int]
    sample_key: str


class LiveSimEngine(SimEngine):
    """``SimEngine`` behind the worker's ``Engine`` interface (``engine/base.py``): the
    same engine, driven by its own paced step loop."""

    detokenizes = False

    def __init__(self, cost: CostModel, policy: LocalPolicy, tok: TextTokenizer,
                 time_scale: float = 1.0, num_blocks: int | None = None) -> None:
        super().__init__(cost, policy, SimEngineConfig(
            num_blocks=num_blocks, output_token_pool=tuple(tok.word_token_ids(OUTPUT_POOL_SIZE))))
        self.tokenizer: TextTokenizer | None = tok  # Engine's: Optional for other backends
        self._tok = tok
        # The model clock: wall seconds / time_scale (pacing.py).
        self.pacer = Pacer(time_scale)
        self._wake = asyncio.Event()
        self._scored: dict[str, _Scored] = {}

    def now(self) -> float:
        """Model seconds."""
        return self.pacer.now()

    def add(self, req: EngineRequest, now: float, sampling: SamplingParams | None = None
            ) -> None:
        super().add(req, now)
        if sampling is not None and (sampling.logprobs is not None
                                     or sampling.allowed_token_ids):
            self._scored[req.request_id] = _Scored(sampling, req.prompt_token_ids,
                                                   req.sample_key)
        self._wake.set()

    def abort(self, request_id: str, now: float) -> bool:
        self._scored.pop(request_id, None)
        ok = super().abort(request_id, now)
        self._wake.set()
        return ok

    def reset_cache(self) -> bool:
        """Drop the prefix cache when idle; a flush starts a benchmark point, so the step
        lag is counted afresh."""
        ok = super().reset_cache()
        if ok:
            self.pacer.reset_lag()
        self._wake.set()  # the idle loop publishes the AllBlocksCleared event
        return ok

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
        pacer = self.pacer
        gpu_free_at = pacer.now()
        while True:
            start = max(pacer.now(), gpu_free_at)
            plan = self.plan_step(start)
            if plan is None:
                await publish_kv(self.take_kv_events())
                self._wake.clear()
                await self._wake.wait()
                gpu_free_at = pacer.now()
                continue
            gpu_free_at = start + plan.duration
            await asyncio.sleep(pacer.sleep_for(gpu_free_at))
            pacer.woke(gpu_free_at, plan.duration)
            outputs = self.finish_step(plan, gpu_free_at)
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
            await publish_kv(self.take_kv_events())

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
            pool = self.config.output_token_pool
            entries = [token_logprobs(scored.sample_key, index + i, t, pool, k,
                                      self._token_text)
                       for i, t in enumerate(out.new_token_ids)]
        return out, entries if s.logprobs is not None else None

    def _token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)


async def open_engine(cfg: WorkerConfig, cost: CostModel, policy: LocalPolicy
                      ) -> LiveSimEngine:
    """The sim backend for a worker config (``engine/registry.py``)."""
    loop = asyncio.get_running_loop()
    tok = await loop.run_in_executor(None, TextTokenizer.load, cfg.tokenizer_path or None)
    if cfg.sim_kv_blocks < 0:
        raise SystemExit("--sim-kv-blocks must be at least 0 (0: the profile's pool)")
    return LiveSimEngine(cost, policy, tok, cfg.time_scale, cfg.sim_kv_blocks or None)


def missing_dependencies() -> str | None:
    """The sim needs nothing beyond the core install."""
    return None
