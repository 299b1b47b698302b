"""Resending a request's stream after the bus lost part of it.

NATS delivers at most once: a chunk or done event published while its edge is not
subscribed (the edge is still reconnecting after a NATS restart, say) is gone. So a worker
keeps, per request it streams over NATS, a compact ``StreamJournal`` of what the stream
carried, and for ``FINISHED_TTL_S`` after the request ended. An edge that may have missed
events sends a ``ResumeRequest`` naming the first output token it lacks; the worker answers
with one chunk carrying everything from there on, and the done event if there is one. The
edge drops what it already had by token index.

Pure bookkeeping, no I/O: the worker service publishes what ``replay`` returns.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import OrderedDict

from prefixmesh.shared.wire import GenerateChunkEvent, RequestDoneEvent, TokenLogprob

# Finished requests' journals are kept this long (seconds) for a late resume...
FINISHED_TTL_S = 30.0
# ... and at most this many of them.
FINISHED_MAX = 4096


class StreamJournal:
    """What one request's stream has carried: tokens, chunk boundaries and their text."""

    __slots__ = ("reply_to", "tokens", "logprobs", "chunks", "cached_tokens", "done")

    def __init__(self, reply_to: str) -> None:
        self.reply_to = reply_to
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        # Per chunk: (index of its first token, its text).
        self.chunks: list[tuple[int, str]] = []
        self.cached_tokens = 0
        self.done: RequestDoneEvent | None = None

    def record(self, event: GenerateChunkEvent | RequestDoneEvent) -> None:
        if isinstance(event, RequestDoneEvent):
            self.done = event
            return
        self.chunks.append((event.index, event.text))
        self.tokens.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.cached_tokens = event.cached_tokens

    def replay(self, request_id: str, from_index: int
               ) -> list[GenerateChunkEvent | RequestDoneEvent]:
        """Events that bring a stream that holds output tokens ``[0, from_index)`` up to
        date. The edge only ever holds whole chunks, so ``from_index`` is a chunk boundary;
        anything else is served from the boundary before it (the edge drops the overlap)."""
        events: list[GenerateChunkEvent | RequestDoneEvent] = []
        start = bisect_right(self.chunks, from_index, key=lambda chunk: chunk[0]) - 1
        if start >= 0 and from_index < len(self.tokens):
            index = self.chunks[start][0]
            events.append(GenerateChunkEvent(
                request_id=request_id, token_ids=self.tokens[index:],
                text="".join(text for _, text in self.chunks[start:]), index=index,
                logprobs=self.logprobs[index:] if self.logprobs else [],
                cached_tokens=self.cached_tokens))
        if self.done is not None:
            events.append(self.done)
        return events


class FinishedJournals:
    """Journals of recently finished requests, bounded in age and number."""

    def __init__(self, ttl_s: float = FINISHED_TTL_S, max_entries: int = FINISHED_MAX) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, StreamJournal]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, journal: StreamJournal, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._entries[request_id] = (now + self.ttl_s, journal)
        self._entries.move_to_end(request_id)
        self.expire(now)

    def get(self, request_id: str) -> StreamJournal | None:
        entry = self._entries.get(request_id)
        return entry[1] if entry is not None else None

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        entries = self._entries
        while entries:
            rid, (until, _) = next(iter(entries.items()))
            if until > now and len(entries) <= self.max_entries:
                break
            del entries[rid]
