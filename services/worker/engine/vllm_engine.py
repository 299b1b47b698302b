"""The ``vllm`` backend: vLLM's AsyncLLM in the worker process (docs/design.md section 7).

prefixmesh's local policy keeps the waiting queue: requests reach vLLM only while vLLM's
own queue is short (``engine_waiting_max`` requests admitted but not yet producing output,
which bounds vLLM's waiting queue), so our order governs and vLLM batches what we hand it.
Prefix caching is on and vLLM's KV events are published on a private ipc:// endpoint that
``KvBridge`` reads and translates to prefixmesh block hashes; the translator's view of the
cache also answers the local policy's ``cached_prefix_tokens`` probes.

Sampling options go to vLLM as they are (``allowed_token_ids`` included), and the
log-probabilities vLLM returns per token (its dict of token id -> ``Logprob``, the sampled
token among them) come back as ``TokenLogprob`` entries (``_logprob_entries``). vLLM reports
at most ``max_logprobs`` tokens a position: a ``logprob_token_ids`` token (``/v1/score``'s
candidates) outside them is missing from the entry.

One streaming task per admitted request iterates ``AsyncLLM.generate`` (delta outputs);
abort cancels that task, which makes vLLM abort the request (its documented disconnect path,
stable across versions). Capacity figures come from a stat logger vLLM calls after every
engine step. vLLM, torch and pyzmq are imported inside functions: this module imports
without them, and ``--backend vllm`` fails at start with a clear message where they are
missing. Verified against vLLM's source (AsyncLLM.generate/abort, StatLoggerBase,
KVEventsConfig) but not run here: see tests/gpu/test_vllm_backend.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.engine.base import Emit, OnStep, PublishKv
from prefixmesh.services.worker.engine.queued import QueuedEngine
from prefixmesh.services.worker.engine.types import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineRequest,
    EngineStats,
    RequestStatus,
    StepOutput,
)
from prefixmesh.services.worker.engine.vllm_events import BlockTranslator
from prefixmesh.services.worker.engine.window import SlidingSums, engine_stats
from prefixmesh.services.worker.kv_bridge import DEFAULT_TOPIC, KvBridge, KvBridgeConfig
from prefixmesh.services.worker.local.base import LocalPolicy
from prefixmesh.shared.blocks import BLOCK_SIZE
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.wire import KvEvent, SamplingParams, TokenLogprob, TopLogprob

log = logging.getLogger(__name__)

# Engine outputs further apart than this (seconds) are not one busy stretch: the interval
# is not counted as a step time.
BUSY_GAP_S = 1.0
DEFAULT_STATS_WINDOW_S = 5.0



class VllmUnavailable(RuntimeError):
    """vLLM (or pyzmq) cannot be imported here."""


def missing_dependencies() -> str | None:
    """Why ``--backend vllm`` cannot run here (None: vllm and pyzmq are installed)."""
    missing = [m for m in ("vllm", "zmq") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"--backend vllm needs {' and '.join(missing)} (pip install 'prefixmesh[gpu]' on "
            "a CUDA machine, or use deploy/Dockerfile.vllm); use --backend sim without a GPU")


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """What the worker asks of vLLM. Defaults are vLLM's own unless noted."""

    # Hugging Face model id or local path.
    model: str
    # Requests admitted to vLLM that have produced no output yet (waiting or prefilling
    # there) at most; beyond it requests wait in our local policy.
    engine_waiting_max: int = 4
    max_num_seqs: int = 256
    # Tokens per step; also the token budget offered to the local policy per admission.
    max_num_batched_tokens: int = 8192
    # None = the model's context length.
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    # vLLM's KV block size; 16 matches prefixmesh blocks (any size works, see vllm_events).
    block_size: int = BLOCK_SIZE
    enforce_eager: bool = False
    # Log-probabilities vLLM computes per position at most (vLLM's own default, 20: the
    # edge's ``logprobs`` limit); a request asking for any candidate's asks for this many.
    max_logprobs: int = 20
    # KV-event endpoints; "" = ipc:// sockets in a private temp dir.
    kv_endpoint: str = ""
    kv_replay_endpoint: str = ""
    kv_topic: str = DEFAULT_TOPIC
    stats_window_s: float = DEFAULT_STATS_WINDOW_S


class _StepStats:
    """vLLM's scheduler and iteration stats, kept by the stat logger vLLM calls each step."""

    def __init__(self, window_s: float) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0  # fraction of KV blocks in use, [0, 1]
        # Per engine output: (seconds since the previous one, decode tokens, all tokens).
        self.steps = SlidingSums(window_s)
        self._last = 0.0

    def record(self, sched: Any, it: Any) -> None:
        now = time.monotonic()
        if sched is not None:
            self.running, self.waiting = sched.num_running_reqs, sched.num_waiting_reqs
            usage = getattr(sched, "kv_cache_usage", None)  # gpu_cache_usage before v0.10
            self.kv_usage = usage if usage is not None else getattr(sched, "gpu_cache_usage", 0.0)
        if it is not None:
            gen, prompt = it.num_generation_tokens, it.num_prompt_tokens
            gap = now - self._last
            self.steps.add(now, gap if gap < BUSY_GAP_S else 0.0, gen, gen + prompt)
            self._last = now


def _stat_logger_factory(sink: _StepStats) -> Callable[..., Any]:
    """A vLLM StatLoggerFactory feeding ``sink`` (the class is the factory)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PrefixmeshStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        # vLLM has called this positionally (v0.9) and by keyword with mm_cache_stats and
        # engine_idx added (v0.11+); later arguments are accepted and ignored.
        def record(self, scheduler_stats: Any = None, iteration_stats: Any = None,
                   *_args: Any, **_kwargs: Any) -> None:
            sink.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return PrefixmeshStatLogger


def _logprob_entries(tokens: list[int], positions: Sequence[Any], s: SamplingParams
                     ) -> list[TokenLogprob]:
    """Our entries from vLLM's per-position dicts (token id -> ``Logprob``: ``logprob``,
    ``rank`` from 1, ``decoded_token``), which hold the sampled token and the most likely
    ones: ``top`` is the ``s.logprobs`` most likely, then ``s.logprob_token_ids`` found."""
    out = []
    for token, lps in zip(tokens, positions, strict=True):
        by_rank = sorted(lps.items(), key=lambda kv: -kv[1].logprob)
        top = [(t, lp) for t, lp in by_rank[:s.logprobs or 0]]
        listed = {t for t, _ in top}
        top += [(t, lps[t]) for t in s.logprob_token_ids if t in lps and t not in listed]
        own = lps[token]  # vLLM always reports the sampled token
        out.append(TokenLogprob(token, own.decoded_token or "", own.logprob,
                                [TopLogprob(t, lp.decoded_token or "", lp.logprob)
                                 for t, lp in top]))
    return out


def _finish_reason(reason: str | None) -> str:
    return {"length": FINISH_LENGTH, "abort": FINISH_ABORT}.get(reason or "", FINISH_STOP)


class VllmEngine(QueuedEngine):
    """vLLM behind the worker's ``Engine`` interface (``base.py``); vLLM detokenizes."""

    tokenizer = None
    detokenizes = True

    def __init__(self, cfg: VllmEngineConfig, policy: LocalPolicy) -> None:
        super().__init__(policy)
        self.cfg = cfg
        self.translator = BlockTranslator(BLOCK_SIZE)
        self._stats = _StepStats(cfg.stats_window_s)
        # First admissions: (prompt tokens, cached tokens, seconds queued here).
        self._admit_win = SlidingSums(cfg.stats_window_s)
        self._tasks: dict[str, asyncio.Task] = {}  # streaming tasks of admitted requests
        self._unstarted = 0  # admitted, no output yet
        self._llm: Any = None
        self._tmpdir = ""
        self._vllm_blocks = 0
        self._vllm_block_size = cfg.block_size
        self._bridge_cfg: KvBridgeConfig | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Load the model (minutes; blocks). vLLM's own API server builds AsyncLLM on the
        event-loop thread too; the worker is not serving yet while this runs."""
        if why := missing_dependencies():
            raise VllmUnavailable(why)
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.cfg
        endpoint, replay = cfg.kv_endpoint, cfg.kv_replay_endpoint
        if not endpoint:
            self._tmpdir = tempfile.mkdtemp(prefix="pm-kv-")
            endpoint = f"ipc://{self._tmpdir}/events"
            replay = replay or f"ipc://{self._tmpdir}/replay"
        # vLLM binds ipc:// and wildcard tcp endpoints; we connect to the same address.
        self._bridge_cfg = KvBridgeConfig(endpoint.replace("*", "127.0.0.1"),
                                          replay.replace("*", "127.0.0.1"), cfg.kv_topic)
        args = AsyncEngineArgs(
            model=cfg.model, enable_prefix_caching=True, block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager, disable_log_stats=False,
            max_logprobs=cfg.max_logprobs,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                replay_endpoint=replay or None, topic=cfg.kv_topic))
        self._llm = AsyncLLM.from_engine_args(
            args, stat_loggers=[_stat_logger_factory(self._stats)])
        cache = self._llm.vllm_config.cache_config
        self._vllm_blocks = cache.num_gpu_blocks or 0
        self._vllm_block_size = cache.block_size or cfg.block_size

    def close(self) -> None:
        """Shut vLLM down (its engine process) and remove the ipc sockets."""
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ requests

    def add(self, req: EngineRequest, now: float, sampling: SamplingParams) -> None:
        """Queue a request in the local policy; raises ValueError on bad parameters."""
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VllmSamplingParams

        self._check_new(req)
        try:
            sp = VllmSamplingParams(
                n=1, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, seed=sampling.seed, stop=list(sampling.stop) or None,
                ignore_eos=sampling.ignore_eos, logprobs=self._vllm_logprobs(sampling),
                allowed_token_ids=list(sampling.allowed_token_ids) or None,
                presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty,
                output_kind=RequestOutputKind.DELTA)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"request {req.request_id!r}: {exc}") from exc
        self.translator.note_request(req.tenant, req.prompt_token_ids)
        self._queue(req, now, (sp, sampling))

    def _vllm_logprobs(self, s: SamplingParams) -> int | None:
        """vLLM's ``logprobs`` for a request: its own ``logprobs``, or all vLLM reports when
        it wants particular tokens' (vLLM cannot report a token by id)."""
        if s.logprob_token_ids:
            return self.cfg.max_logprobs
        return None if s.logprobs is None else min(s.logprobs, self.cfg.max_logprobs)

    def _abort_running(self, req: EngineRequest) -> None:
        if (task := self._tasks.get(req.request_id)) is not None:
            task.cancel()  # generate() aborts the request in vLLM when cancelled

    def snapshot_events(self) -> list[KvEvent]:
        """The whole cache as prefixmesh events (a resync for the scheduler)."""
        return self.translator.snapshot_events()

    def reset_cache(self) -> bool:
        """Not offered on this backend (vLLM's cache is flushed by restarting it)."""
        return False

    def info(self) -> dict[str, Any]:
        return {"vllm_block_size": self._vllm_block_size, "vllm_blocks": self._vllm_blocks}

    # ------------------------------------------------------------------ EngineView

    @property
    def num_blocks(self) -> int:
        """vLLM's KV pool in prefixmesh blocks."""
        return self._vllm_blocks * self._vllm_block_size // BLOCK_SIZE

    @property
    def num_free_blocks(self) -> int:
        """Blocks vLLM does not use (from its last reported KV usage)."""
        return int(self.num_blocks * (1.0 - self._stats.kv_usage))

    @property
    def max_num_seqs(self) -> int:
        return self.cfg.max_num_seqs

    @property
    def num_running(self) -> int:
        """Requests handed to vLLM and not finished."""
        return len(self._tasks)

    def cached_prefix_tokens(self, hashes: Sequence[int]) -> int:
        """Tokens of the longest prefix vLLM caches, as its KV events told us."""
        return self.translator.cached_prefix_tokens(hashes)

    def stats(self, now: float) -> EngineStats:
        """Load snapshot for load reports."""
        return engine_stats(
            self._stats.steps, self._admit_win, now, self._requests.values(),
            running=len(self._tasks), waiting=len(self.policy) + self._stats.waiting,
            free_blocks=self.num_free_blocks, total_blocks=self.num_blocks,
            block_size=BLOCK_SIZE)

    # ------------------------------------------------------------------ running

    async def run(self, emit: Emit, publish_kv: PublishKv, on_step: OnStep | None = None
                  ) -> None:
        """The engine loop: bridge KV events, admit in policy order, stream outputs
        (vLLM steps in its own process: ``on_step`` is not called)."""
        assert self._llm is not None and self._bridge_cfg is not None, "start() first"
        bridge = KvBridge(self._bridge_cfg, self.translator, publish_kv)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(bridge.run(), name="vllm-kv-bridge")
            while True:
                await self._wake.wait()
                self._wake.clear()
                self._admit(tg, emit)

    def _admit(self, tg: asyncio.TaskGroup, emit: Emit) -> None:
        room = min(self.cfg.max_num_seqs - len(self._tasks),
                   self.cfg.engine_waiting_max - self._unstarted)
        if room <= 0 or not len(self.policy):
            return
        now = time.monotonic()
        for req in self.policy.select(now, room, self.cfg.max_num_batched_tokens, self):
            req.status, req.first_scheduled = RequestStatus.RUNNING, now
            self._unstarted += 1
            sp, sampling = self._sampling.pop(req.request_id)
            self._tasks[req.request_id] = tg.create_task(
                self._stream(req, sp, sampling, emit), name=f"vllm-{req.request_id}")

    def _prompt(self, req: EngineRequest) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
        if req.tenant:  # vLLM hashes the salt into the first block: tenants share nothing
            prompt["cache_salt"] = req.tenant
        return prompt

    async def _stream(self, req: EngineRequest, sp: Any, sampling: SamplingParams,
                      emit: Emit) -> None:
        """Run one request in vLLM, emitting each delta; never raises but CancelledError."""
        rid, started = req.request_id, False
        try:
            async for out in self._llm.generate(self._prompt(req), sp, rid):
                comp = out.outputs[0] if out.outputs else None
                new = list(comp.token_ids) if comp is not None else []
                now = time.monotonic()
                first = bool(new) and not started
                if first:
                    started = True
                    self._on_first_output(req, out, now)
                req.output_token_ids.extend(new)
                reason = None
                if out.finished:
                    reason = _finish_reason(comp.finish_reason if comp is not None else None)
                    self._finish(req, reason, now)
                logprobs = (_logprob_entries(new, comp.logprobs, sampling)
                            if comp is not None and comp.logprobs and new else None)
                await emit(StepOutput(rid, new, out.finished, reason,
                                      max(req.num_cached_tokens, 0), first, req),
                           comp.text if comp is not None else "", logprobs)
                if out.finished:
                    return
            raise RuntimeError("vLLM ended the stream without a finished output")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("vllm request %s failed", rid)
            self._finish(req, FINISH_ERROR, time.monotonic())
            await emit(StepOutput(rid, [], True, FINISH_ERROR, max(req.num_cached_tokens, 0),
                                  False, req), "")
        finally:
            self._tasks.pop(rid, None)
            if not started:
                self._unstarted -= 1
            self._wake.set()

    def _on_first_output(self, req: EngineRequest, out: Any, now: float) -> None:
        req.first_token_time = now
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = max(getattr(out, "num_cached_tokens", 0) or 0, 0)
        self._admit_win.add(now, req.num_prompt_tokens, req.num_cached_tokens, req.queue_s or 0.0)
        self._unstarted -= 1
        self._wake.set()

    def _finish(self, req: EngineRequest, reason: str, now: float) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.finish_time = reason, now
        self._requests.pop(req.request_id, None)


async def open_engine(cfg: WorkerConfig, cost: CostModel, policy: LocalPolicy) -> VllmEngine:
    """The vllm backend for a worker config (``engine/registry.py``); loading the model
    takes minutes and blocks, as in vLLM's own server."""
    del cost
    served = cfg.served_model()
    engine = VllmEngine(VllmEngineConfig(model=served.name,
                                         max_model_len=served.context_length), policy)
    try:
        engine.start()
    except VllmUnavailable as exc:
        engine.close()
        raise SystemExit(str(exc)) from exc
    return engine
