"""Micro-batched request/reply: concurrent requests on one subject answered in batches.

``Bus.serve`` answers one message at a time (nats-py runs a subscription's callback
sequentially), which suits cheap handlers. A model forward pass costs about the same for
one prompt as for 32, so ``BatchServer`` queues decoded requests as they arrive and one
loop hands them to the handler in batches: whatever arrived while the previous batch was
being computed, up to ``max_batch``; an idle server waits at most ``max_wait_s`` after a
batch's first request for more to join it. Replies go back to each request's inbox.

A payload that does not decode is answered at once with ``on_malformed(reason)``; a
handler that raises answers its whole batch the same way, and the server goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from prefixmesh.shared.bus import Bus
from prefixmesh.shared.runtime.lifecycle import TaskSet
from prefixmesh.shared.wire import encode

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=msgspec.Struct)
Rep = TypeVar("Rep", bound=msgspec.Struct)

BatchHandler = Callable[[list[Req]], Awaitable[list[Rep]]]


class BatchServer(Generic[Req, Rep]):
    """Serves one subject in micro-batches; owns its subscription and its batching loop."""

    def __init__(self, bus: Bus, subject: str, decoder: msgspec.msgpack.Decoder,
                 handler: BatchHandler, on_malformed: Callable[[str], Rep], queue: str = "",
                 max_batch: int = 32, max_wait_s: float = 0.002) -> None:
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError("need max_batch >= 1 and max_wait_s >= 0")
        self.bus, self.subject, self.decoder = bus, subject, decoder
        self.handler, self.on_malformed, self.queue = handler, on_malformed, queue
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self._pending: asyncio.Queue[tuple[Req, Msg]] = asyncio.Queue()
        self._busy = False
        self._sub: Subscription | None = None
        self.batches = 0  # batches handled since start
        self.requests = 0  # requests answered through the handler

    async def start(self, tasks: TaskSet) -> None:
        """Spawn the batching loop into ``tasks`` and subscribe."""
        tasks.spawn(self._loop(), f"batch-server-{self.subject}")
        self._sub = await self.bus.subscribe_raw(self.subject, self._on_msg, self.queue)

    async def stop_intake(self) -> None:
        """Unsubscribe; requests already queued are still answered."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def drain(self, poll_s: float = 0.005) -> None:
        """Return once every queued request has been answered."""
        while self._busy or not self._pending.empty():
            await asyncio.sleep(poll_s)

    async def _on_msg(self, m: Msg) -> None:
        try:
            req = self.decoder.decode(m.data)
        except msgspec.DecodeError as exc:
            await self._respond(m, self.on_malformed(f"malformed request: {exc}"))
            return
        self._pending.put_nowait((req, m))

    async def _collect(self) -> list[tuple[Req, Msg]]:
        """The next batch: wait for one request, take all queued ones, then wait up to
        ``max_wait_s`` (from the first's arrival here) for more, up to ``max_batch``."""
        batch = [await self._pending.get()]
        self._busy = True
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch:
            if not self._pending.empty():
                batch.append(self._pending.get_nowait())
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._pending.get(), left))
            except TimeoutError:
                break
        return batch

    async def _loop(self) -> None:
        while True:
            batch = await self._collect()
            try:
                try:
                    replies = await self.handler([req for req, _ in batch])
                    if len(replies) != len(batch):
                        raise RuntimeError(f"{len(replies)} replies for {len(batch)} requests")
                except Exception as exc:
                    log.exception("batch handler failed on %s", self.subject)
                    replies = [self.on_malformed(f"internal error: {type(exc).__name__}")
                               ] * len(batch)
                self.batches += 1
                self.requests += len(batch)
                for (_, m), reply in zip(batch, replies, strict=True):
                    await self._respond(m, reply)
            finally:
                self._busy = False

    async def _respond(self, m: Msg, reply: Rep) -> None:
        if not m.reply:
            return
        try:
            await m.respond(encode(reply))
        except Exception as exc:  # connection lost mid-reply: the caller retries
            log.warning("could not reply on %s: %s", self.subject, exc)
