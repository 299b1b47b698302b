"""A small typed wrapper over nats-py: request/reply, publish, subscribe, queue groups.

Messages are msgspec Structs (``prefixmesh.shared.wire``); every call names the decoder of the
subject's union so malformed payloads are rejected at the boundary, not deep inside a
handler. Handlers run on nats-py's per-subscription task, one message at a time, which
keeps a subscriber's state updates ordered; a handler that wants concurrency spawns into a
``TaskSet`` it owns. A request server working through a backlog lets its answers go out
every ``ANSWER_HOLD_S`` of handling (``_answer_each``).

Requests share one wildcard reply subscription per connection (as nats-py's own requests
do), but each waits on a plain future with a timer: no task per request (``asyncio.wait_for``
makes one on Python 3.11) and no random bytes from the OS per request. ``RequestBatcher``
goes further for a subject that takes batches: while its earlier batches are unanswered,
new requests wait and go together in the next message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from prefixmesh.shared.subjects import Subjects
from prefixmesh.shared.wire import encode

log = logging.getLogger(__name__)

# A request server handling a backlog lets the answers it wrote go out at least this often
# (seconds of handling; ``_answer_each``).
ANSWER_HOLD_S = 0.001

# The decoded message type: a decoder's type fixes what a handler receives or a request returns.
T = TypeVar("T")
# A batcher's item and answer types.
Q = TypeVar("Q")
R = TypeVar("R")
# Called with a request's reply (None: it timed out); what it returns is awaited (for a
# timeout, in a task of the bus's own).
OnReply = Callable[["Msg | None"], "Awaitable[None] | None"]

# Reconnect forever, quickly: a NATS restart must heal without manual action.
RECONNECT_WAIT_S = 0.5
CONNECT_TIMEOUT_S = 2.0
# Bytes buffered while disconnected before publishes fail fast.
PENDING_BUFFER_BYTES = 16 * 1024 * 1024
# The status header of the server's answer to a request nobody subscribes to.
STATUS_HEADER = "Status"
NO_RESPONDERS = "503"


class BusUnavailable(RuntimeError):
    """Nobody answered a request in time (no responders, timeout, or no connection)."""


class Bus:
    """One NATS connection plus the subject names of this cluster."""

    def __init__(self, nc: Client, subjects: Subjects, closing: list[bool] | None = None) -> None:
        self.nc = nc
        self.subjects = subjects
        # Shared with the connection callbacks: set once close() starts.
        self._closing = closing if closing is not None else []
        # Requests awaiting their reply: token -> what to call with the reply (None when
        # the request timed out; what it returns is awaited), and the timer that gives up
        # on it.
        self._waiting: dict[str, tuple[OnReply, asyncio.TimerHandle]] = {}
        # What callbacks returned for timeouts, running (held here: a task the loop alone
        # refers to may be collected before it ends).
        self._expiring: set[asyncio.Future[None]] = set()
        self._tokens = itertools.count()
        # "<inbox>." : replies arrive on <inbox>.<token>; subscribed at the first request.
        self._reply_prefix = ""
        self._reply_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, url: str, subjects: Subjects, name: str, echo: bool = True) -> Bus:
        """Connect with reconnect-forever settings; fails if the first connect fails.

        ``echo=False``: the server never delivers this connection's own messages back to
        it (a scheduler replica publishes its decisions for the others, not for itself)."""

        closing: list[bool] = []

        async def on_error(exc: Exception) -> None:
            if not closing:
                log.warning("nats: %s", exc)

        async def on_disconnect() -> None:
            if not closing:
                log.warning("nats: disconnected")

        async def on_reconnect() -> None:
            log.info("nats: reconnected")

        nc = await nats.connect(
            servers=[u.strip() for u in url.split(",") if u.strip()],
            name=name,
            connect_timeout=CONNECT_TIMEOUT_S,
            reconnect_time_wait=RECONNECT_WAIT_S,
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            pending_size=PENDING_BUFFER_BYTES,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            no_echo=not echo,
        )
        return cls(nc, subjects, closing)

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    async def publish(self, subject: str, msg: msgspec.Struct) -> None:
        """Fire-and-forget publish of one message."""
        await self.nc.publish(subject, encode(msg))

    async def request(self, subject: str, msg: msgspec.Struct | Callable[[str], bytes],
                      decoder: msgspec.msgpack.Decoder[T], timeout: float) -> T:
        """Send a request and decode the reply; raises ``BusUnavailable`` when unanswered.
        ``msg`` may be a function of the reply subject that returns the payload (a request
        that names where a third party is to answer it)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Msg | None] = loop.create_future()

        def on_reply(m: Msg | None) -> None:
            if not answer.done():  # the caller may have been cancelled meanwhile
                answer.set_result(m)

        payload = encode(msg) if isinstance(msg, msgspec.Struct) else msg
        token = await self.send_request(subject, payload, timeout, on_reply)
        try:
            reply = await answer
        finally:
            self.forget(token)
        return decoder.decode(reply_data(reply, subject, timeout))

    async def send_request(self, subject: str, payload: bytes | Callable[[str], bytes],
                           timeout: float, on_reply: OnReply) -> str:
        """Publish a request; ``on_reply`` is called once, with the reply (an awaitable it
        returns is awaited) or with None after ``timeout`` seconds. ``payload`` may be a
        function of the reply subject. Returns the request's token (for ``forget``)."""
        if not self.nc.is_connected:
            raise BusUnavailable(f"not connected to NATS (request on {subject})")
        prefix = self._reply_prefix or await self._reply_inbox()
        token = format(next(self._tokens), "x")
        timer = asyncio.get_running_loop().call_later(timeout, self._expire, token)
        self._waiting[token] = (on_reply, timer)
        try:
            reply = prefix + token
            data = payload if isinstance(payload, bytes) else payload(reply)
            await self.nc.publish(subject, data, reply=reply)
        except BaseException:
            self.forget(token)
            raise
        return token

    def forget(self, token: str) -> None:
        """Stop waiting for the reply to ``token`` (the caller went away)."""
        waiting = self._waiting.pop(token, None)
        if waiting is not None:
            waiting[1].cancel()

    def _expire(self, token: str) -> None:
        waiting = self._waiting.pop(token, None)
        if waiting is not None and (pending := waiting[0](None)) is not None:
            task = asyncio.ensure_future(pending)
            self._expiring.add(task)
            task.add_done_callback(self._expiring.discard)

    async def _on_reply(self, m: Msg) -> None:
        waiting = self._waiting.pop(m.subject[len(self._reply_prefix):], None)
        if waiting is not None:  # else a late reply to a request that timed out
            waiting[1].cancel()
            pending = waiting[0](m)
            if pending is not None:
                await pending

    async def _reply_inbox(self) -> str:
        async with self._reply_lock:
            if not self._reply_prefix:
                prefix = self.nc.new_inbox() + "."
                await self._subscribed(prefix + "*", "", self._on_reply)
                self._reply_prefix = prefix
        return self._reply_prefix

    async def subscribe(self, subject: str, decoder: msgspec.msgpack.Decoder[T],
                        handler: Callable[[T], Awaitable[None]],
                        queue: str = "") -> Subscription:
        """Call ``handler`` with each decoded message; malformed ones are logged and dropped."""

        async def on_msg(m: Msg) -> None:
            try:
                decoded = decoder.decode(m.data)
            except msgspec.DecodeError as exc:
                log.warning("dropping malformed message on %s: %s", m.subject, exc)
                return
            try:
                await handler(decoded)
            except Exception:
                log.exception("handler failed on %s", m.subject)

        return await self._subscribed(subject, queue, on_msg)

    async def serve(self, subject: str, decoder: msgspec.msgpack.Decoder[T],
                    handler: Callable[[T], Awaitable[msgspec.Struct]],
                    on_malformed: Callable[[str], msgspec.Struct],
                    queue: str = "") -> Subscription:
        """Answer requests on ``subject``: decode, call ``handler``, reply with its Struct.

        A payload that does not decode gets ``on_malformed(reason)`` as its reply, so the
        caller sees an error at once instead of a timeout.
        """

        async def on_msg(m: Msg) -> None:
            target = m.reply
            try:
                decoded = decoder.decode(m.data)
            except msgspec.DecodeError as exc:
                reply = on_malformed(f"malformed request: {exc}")
            else:
                try:
                    reply = await handler(decoded)
                except Exception as exc:
                    log.exception("request handler failed on %s", m.subject)
                    reply = on_malformed(f"internal error: {type(exc).__name__}")
            if target:
                try:
                    await self.nc.publish(target, encode(reply))
                except Exception as exc:  # connection lost mid-reply: the caller retries
                    log.warning("could not reply on %s: %s", m.subject, exc)

        return await self._subscribed(subject, queue, on_msg, answers=True)

    async def subscribe_raw(self, subject: str, cb: Callable[[Msg], Awaitable[None]],
                            queue: str = "") -> Subscription:
        """Call ``cb`` with each raw message (for servers that reply later, e.g. in batches)."""
        return await self._subscribed(subject, queue, cb, answers=True)

    async def _subscribed(self, subject: str, queue: str,
                          cb: Callable[[Msg], Awaitable[None]],
                          answers: bool = False) -> Subscription:
        # The SUB travels on this connection's write buffer; a PING/PONG round trip makes
        # sure the server has it before we return, so a service that reports "ready" right
        # after subscribing never answers another client's request with "no responders".
        subs: list[Subscription] = []
        if answers:
            cb = _answer_each(cb, subs)
        sub = await self.nc.subscribe(subject, queue=queue, cb=cb)
        subs.append(sub)
        await self.nc.flush()
        return sub

    def batcher(self, subject: str, pack: Callable[[list[Q]], msgspec.Struct],
                unpack: Callable[[bytes], list[R]], timeout: float,
                limits: BatchLimits | None = None) -> RequestBatcher[Q, R]:
        """A ``RequestBatcher`` for ``subject`` on this connection."""
        return RequestBatcher(self, subject, pack, unpack, timeout, limits or BatchLimits())

    async def close(self) -> None:
        """Drain subscriptions and flush pending publishes, then close."""
        if self.nc.is_closed:
            return
        self._closing.append(True)
        try:
            await self.nc.drain()
        except Exception as exc:
            log.debug("drain failed (%s); closing", exc)
            try:
                await self.nc.close()
            except Exception as exc2:  # NATS gone (e.g. "handler is closed"): nothing to flush
                log.debug("close failed (%s); connection abandoned", exc2)


def _answer_each(cb: Callable[[Msg], Awaitable[None]], subs: list[Subscription]
                 ) -> Callable[[Msg], Awaitable[None]]:
    """``cb`` for ``subs[0]`` (appended once subscribed), a subscription that answers its
    requests, letting the answers written so far go out once handling a backlog has held
    them ``ANSWER_HOLD_S``.

    nats-py hands a subscription's queued messages to its callback one after another
    without returning to the event loop, and a publish only queues its bytes for the
    connection's flusher task, which runs when the loop next turns: the answer to the
    first of N queued requests would wait until the N-th was handled. Turning the loop
    after every answer would cost a write per answer where a burst of cheap requests now
    shares one; after each ``ANSWER_HOLD_S`` of handling, none waits longer than that."""
    since = 0.0  # when handling began without a turn of the loop (0: not in a backlog)

    async def each(m: Msg) -> None:
        nonlocal since
        began = since or time.perf_counter()
        await cb(m)
        since = 0.0
        if not (subs and subs[0].pending_msgs):
            return  # nothing queued: the subscription's task waits, the loop turns
        if time.perf_counter() - began >= ANSWER_HOLD_S:
            await asyncio.sleep(0)
        else:
            since = began

    return each


def reply_data(reply: Msg | None, subject: str, timeout: float) -> bytes:
    """The payload of a request's reply; ``BusUnavailable`` for a timeout (None) or the
    server's no-responders status."""
    if reply is None:
        raise BusUnavailable(f"timeout after {timeout}s on {subject}")
    if reply.headers and reply.headers.get(STATUS_HEADER) == NO_RESPONDERS:
        raise BusUnavailable(f"no responders on {subject}")
    return reply.data


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """How a ``RequestBatcher`` cuts batches."""

    # Requests in one message at most.
    max_batch: int = 64
    # Batches awaiting their reply at once; requests made meanwhile wait for the next. A
    # request waits only when this many are out: below, what one loop turn produced goes
    # at once (a closed loop of callers batches itself: the answers of one batch wake
    # their callers in one turn, and their next requests leave together).
    max_inflight: int = 16


@dataclass(slots=True)
class _Pending(Generic[Q, R]):
    item: Q
    answer: asyncio.Future[R]


class RequestBatcher(Generic[Q, R]):
    """Request/reply for many small requests to one subject, batched while busy.

    A request made while fewer than ``max_inflight`` batches are unanswered goes out at the
    end of the current loop turn, with every other request made in that turn; otherwise
    it waits until a batch is answered and goes with the next (``max_batch`` requests a
    message at most). No request waits for another: an idle caller's requests go one a
    message, a busy one's as many per message as its loop turns make. ``pack`` makes one
    message of a list of requests (a single request may go as itself), ``unpack`` the
    list of answers, in order, of a reply's bytes (what it raises makes the reply no
    answer: each request of the batch gets ``BusUnavailable``). One owned task sends; use
    the batcher as an async context manager.
    """

    def __init__(self, bus: Bus, subject: str, pack: Callable[[list[Q]], msgspec.Struct],
                 unpack: Callable[[bytes], list[R]], timeout: float,
                 limits: BatchLimits) -> None:
        if limits.max_batch < 1 or limits.max_inflight < 1:
            raise ValueError(f"a batch holds a request at least, and a batch at least is "
                             f"in flight: {limits}")
        self.bus, self.subject, self.timeout, self.limits = bus, subject, timeout, limits
        self._pack, self._unpack = pack, unpack
        self._queue: list[_Pending[Q, R]] = []
        self._inflight = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0  # messages sent (for tests and benchmarks)

    async def request(self, item: Q) -> R:
        """The answer to ``item``; ``BusUnavailable`` when its batch went unanswered."""
        if self._task is None:
            raise RuntimeError("RequestBatcher used outside its async with block")
        entry: _Pending[Q, R] = _Pending(item, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        if self._inflight < self.limits.max_inflight:
            self._wake.set()
        return await entry.answer

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and self._inflight < self.limits.max_inflight:
                cut = self.limits.max_batch
                batch = [e for e in self._queue[:cut] if not e.answer.done()]
                del self._queue[:cut]
                if batch:
                    await self._send(batch)

    async def _send(self, batch: list[_Pending[Q, R]]) -> None:
        def on_reply(m: Msg | None) -> None:
            self._inflight -= 1
            self._wake.set()
            try:
                data = reply_data(m, self.subject, self.timeout)
                try:
                    answers = self._unpack(data)
                except Exception as exc:  # a malformed answer is no answer
                    raise BusUnavailable(f"malformed answer on {self.subject}: {exc}") from exc
                if len(answers) != len(batch):
                    raise BusUnavailable(f"{len(answers)} answers to {len(batch)} requests "
                                         f"on {self.subject}")
            except BusUnavailable as exc:  # timeout, no responders, a malformed answer
                for e in batch:
                    if not e.answer.done():
                        e.answer.set_exception(exc)
                return
            for e, a in zip(batch, answers):
                if not e.answer.done():
                    e.answer.set_result(a)

        self._inflight += 1
        self.batches += 1
        try:
            await self.bus.send_request(self.subject, encode(self._pack([e.item for e in batch])),
                                        self.timeout, on_reply)
        except Exception as exc:  # not connected: fail this batch, not the sender
            self._inflight -= 1
            for e in batch:
                if not e.answer.done():
                    e.answer.set_exception(exc)

    async def __aenter__(self) -> RequestBatcher[Q, R]:
        self._task = asyncio.create_task(self._run(), name=f"batcher-{self.subject}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for e in self._queue:
            e.answer.cancel()
        self._queue.clear()
