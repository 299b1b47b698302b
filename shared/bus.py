"""A small typed wrapper over nats-py: request/reply, publish, subscribe, queue groups.

Messages are msgspec Structs (``prefixmesh.shared.wire``); every call names the decoder of the
subject's union so malformed payloads are rejected at the boundary, not deep inside a
handler. Handlers run on nats-py's per-subscription task, one message at a time, which
keeps a subscriber's state updates ordered; a handler that wants concurrency spawns into a
``TaskSet`` it owns.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from prefixmesh.shared.subjects import Subjects
from prefixmesh.shared.wire import encode

log = logging.getLogger(__name__)

# The decoded message type: a decoder's type fixes what a handler receives or a request returns.
T = TypeVar("T")

# Reconnect forever, quickly: a NATS restart must heal without manual action.
RECONNECT_WAIT_S = 0.5
CONNECT_TIMEOUT_S = 2.0
# Bytes buffered while disconnected before publishes fail fast.
PENDING_BUFFER_BYTES = 16 * 1024 * 1024


class BusUnavailable(RuntimeError):
    """Nobody answered a request in time (no responders, timeout, or no connection)."""


class Bus:
    """One NATS connection plus the subject names of this cluster."""

    def __init__(self, nc: Client, subjects: Subjects, closing: list[bool] | None = None) -> None:
        self.nc = nc
        self.subjects = subjects
        # Shared with the connection callbacks: set once close() starts.
        self._closing = closing if closing is not None else []

    @classmethod
    async def connect(cls, url: str, subjects: Subjects, name: str) -> Bus:
        """Connect with reconnect-forever settings; fails if the first connect fails."""

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
        )
        return cls(nc, subjects, closing)

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    async def publish(self, subject: str, msg: msgspec.Struct) -> None:
        """Fire-and-forget publish of one message."""
        await self.nc.publish(subject, encode(msg))

    async def request(self, subject: str, msg: msgspec.Struct,
                      decoder: msgspec.msgpack.Decoder[T], timeout: float) -> T:
        """Send a request and decode the reply; raises ``BusUnavailable`` when unanswered."""
        if not self.nc.is_connected:
            raise BusUnavailable(f"not connected to NATS (request on {subject})")
        try:
            reply = await self.nc.request(subject, encode(msg), timeout=timeout)
        except NoRespondersError:
            raise BusUnavailable(f"no responders on {subject}") from None
        except NatsTimeoutError:
            raise BusUnavailable(f"timeout after {timeout}s on {subject}") from None
        return decoder.decode(reply.data)

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
            if m.reply:
                try:
                    await m.respond(encode(reply))
                except Exception as exc:  # connection lost mid-reply: the caller retries
                    log.warning("could not reply on %s: %s", m.subject, exc)

        return await self._subscribed(subject, queue, on_msg)

    async def subscribe_raw(self, subject: str, cb: Callable[[Msg], Awaitable[None]],
                            queue: str = "") -> Subscription:
        """Call ``cb`` with each raw message (for servers that reply later, e.g. in batches)."""
        return await self._subscribed(subject, queue, cb)

    async def _subscribed(self, subject: str, queue: str,
                          cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
        # The SUB travels on this connection's write buffer; a PING/PONG round trip makes
        # sure the server has it before we return, so a service that reports "ready" right
        # after subscribing never answers another client's request with "no responders".
        sub = await self.nc.subscribe(subject, queue=queue, cb=cb)
        await self.nc.flush()
        return sub

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
