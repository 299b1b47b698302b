"""Token streams at the edge: events from the edge's inbox to the queue of their request."""

from __future__ import annotations

import asyncio
from collections import deque

from prefixmesh.shared.wire import RequestDoneEvent, StreamBatch, StreamEvent, StreamMessage


class EventQueue:
    """One request's stream events, in arrival order. ``get`` waits with a timer, not a
    task (``asyncio.wait_for`` makes one per call on Python 3.11, per event here)."""

    __slots__ = ("_events", "_waiter")

    def __init__(self) -> None:
        self._events: deque[StreamEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, event: StreamEvent) -> None:
        self._events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout: float) -> StreamEvent | None:
        """The next event, or None when none came within ``timeout`` seconds."""
        if not self._events:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._events.popleft() if self._events else None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class StreamDispatcher:
    """Routes stream events from the edge inbox to the queue of their request."""

    def __init__(self) -> None:
        self._queues: dict[str, EventQueue] = {}

    def open(self, request_id: str) -> EventQueue:
        q = EventQueue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._queues)

    async def on_event(self, msg: StreamMessage) -> None:
        if isinstance(msg, StreamBatch):  # events of several requests, in order
            for event in msg.events:
                self._put(event)
        else:
            self._put(msg)

    def _put(self, event: StreamEvent) -> None:
        q = self._queues.get(event.request_id)
        if q is not None:  # late events of an aborted/finished request are dropped
            if isinstance(event, RequestDoneEvent) and event.last is not None:
                q.put_nowait(event.last)  # the last chunk, carried by the done event
            q.put_nowait(event)
