"""The one interface every engine backend implements (``sim``, ``hf``, ``vllm``).

The worker service is a bus shell around an ``Engine``: it turns TokenizedRequests into
``EngineRequest``s, hands them to ``add``, and relays what ``run`` emits. Everything that
differs between backends (the clock, who detokenizes, how a step is run, what a cache
flush means) lives behind this protocol, so a new backend is one new module plus a line
in ``BACKENDS`` (``engine/registry.py``).

Times are readings of the engine's own clock (``now()``): model seconds for the sim,
monotonic seconds for real engines.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from prefixmesh.services.worker.engine.types import (
    EngineRequest,
    EngineStats,
    StepOutput,
)
from prefixmesh.services.worker.local.base import EngineView
from prefixmesh.shared.text.tokenizer import TextTokenizer
from prefixmesh.shared.wire import KvEvent, SamplingParams, TokenLogprob


class Emit(Protocol):
    """Receives each request's progress: ``text`` when the engine detokenizes itself,
    ``logprobs`` one entry per new token when the request asked for them."""

    def __call__(self, out: StepOutput, text: str = "",
                 logprobs: list[TokenLogprob] | None = None) -> Awaitable[None]: ...


# Receives the engine's KV cache events, in order (published to the scheduler).
PublishKv = Callable[[list[KvEvent]], Awaitable[None]]
# Told the duration of each engine step (seconds of the engine's clock), for metrics.
OnStep = Callable[[float], None]


class Engine(EngineView, Protocol):
    """An engine replica with its local policy (the ``EngineView`` part is what the local
    policies read)."""

    # The tokenizer of the served model (text prompts on the HTTP front); None: token ids
    # only.
    tokenizer: TextTokenizer | None
    # True when ``run`` emits text with the tokens (the shell then does not detokenize).
    detokenizes: bool

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks now."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests queued in the local policy."""
        ...

    def now(self) -> float:
        """The engine's clock (seconds)."""
        ...

    def add(self, req: EngineRequest, now: float, sampling: SamplingParams) -> None:
        """Queue a request in the local policy; ValueError when it cannot be run."""
        ...

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a waiting or running request and free its KV blocks; False if unknown."""
        ...

    def update_prediction(self, request_id: str, remaining_tokens: float) -> bool:
        """A refined remaining-length prediction for the local policy (TRAIL)."""
        ...

    def snapshot_events(self) -> list[KvEvent]:
        """The whole prefix cache as ``[AllBlocksCleared, BlockStored...]`` (a resync)."""
        ...

    def reset_cache(self) -> bool:
        """Drop the prefix cache; False when the engine cannot now (requests running, or
        the backend has no such operation)."""
        ...

    def stats(self, now: float) -> EngineStats:
        """A load snapshot for load reports."""
        ...

    def info(self) -> dict[str, Any]:
        """Backend-specific facts for ``/server_info`` (JSON-ready)."""
        ...

    async def run(self, emit: Emit, publish_kv: PublishKv, on_step: OnStep | None = None
                  ) -> None:
        """Run steps while there is work, forever (cancel to stop)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (threads, processes); after ``run`` is cancelled."""
        ...
