"""A lean HTTP/1.1 front for the edge's hot requests; aiohttp serves everything else.

aiohttp builds a request and a response object, walks the router and the middleware chain
and starts a task for every request; with this front in its place the edge's CPU per
one-token completion fell by about a quarter (docs/benchmarks.md, "A lean HTTP front").
The front parses just what the hot requests need (a POST of a JSON body with a
Content-Length to a route it was given) and answers them itself. The first request of a
connection that it does not take, for any reason (another route or method, HTTP/1.0,
chunked bodies, ``Expect``, an upgrade, a body over the limit, a header it cannot read, or
one its caller turns down: a streamed completion), hands the connection, with every byte
not yet consumed, to aiohttp's own protocol for the rest of its life. aiohttp then answers
it exactly as without the front, errors included: the front never answers a request it
does not fully understand.

Requests on a connection are answered one at a time and in order, as aiohttp does: a
pipelined request waits in the buffer (reading pauses above ``MAX_BUFFER``) until the
one before it has been written.
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import cast

from prometheus_client import Counter

log = logging.getLogger(__name__)

# (status, extra headers, JSON body) of an answered request.
Answer = tuple[int, dict[str, str], bytes]
# path, lower-cased headers, body -> the answer. Errors are the handler's to answer: an
# exception that escapes it becomes a bare 500 (and is logged), except ``Declined``.
FastHandler = Callable[[str, dict[str, str], bytes], Awaitable[Answer]]
# path, body -> whether the handler takes this request (else aiohttp gets the connection):
# a cheap look at the bytes, before the handler reads them.
Takes = Callable[[str, bytes], bool]


class Declined(Exception):
    """Raised by a handler, before it has done anything, for a request it turns down once
    it has read it: the request goes to aiohttp after all, with the connection."""

ANSWERED = Counter("prefixmesh_edge_front_requests_total",
                   "requests the lean HTTP front answered itself")
HANDOFFS = Counter("prefixmesh_edge_front_handoffs_total",
                   "connections the lean HTTP front handed to aiohttp (a request it does "
                   "not serve)")

# Longest header block the front reads (bytes, request line included); a longer one goes
# to aiohttp, which answers it with its own limits.
MAX_HEAD = 16 * 1024
# Bytes buffered behind a request in progress before the connection stops reading.
MAX_BUFFER = 256 * 1024
# Idle keep-alive connections are closed after this long (seconds; aiohttp's default).
KEEPALIVE_S = 75.0
_SWEEP_S = 15.0
# Headers whose presence means the request is not a plain body of known length.
_NOT_PLAIN = frozenset({"transfer-encoding", "expect", "upgrade"})
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}


class _Date:
    """The Date header's value, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = ""

    def __call__(self) -> str:
        now = int(time.time())
        if now != self._second:
            self._second, self._value = now, formatdate(now, usegmt=True)
        return self._value


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]] | None:
    """(method, path, lower-cased headers) of an HTTP/1.1 request's head (request line and
    header lines, without the blank line); None if it is anything the front does not
    serve: another HTTP version, a header without a name, folded lines, a repeated
    Content-Length."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] != "HTTP/1.1":
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():  # folded: leading white space
            return None
        name = name.lower()
        if name in headers:
            if name == "content-length":
                return None
            headers[name] += ", " + value.strip()
        else:
            headers[name] = value.strip()
    return parts[0], parts[1], headers


class Front:
    """Protocol factory of the edge's listening socket: POSTs to ``routes`` that ``takes``
    accepts go to ``handle``; the connection of any other request goes to ``fallback``
    (aiohttp's protocol factory, ``AppRunner.server``)."""

    def __init__(self, fallback: Callable[[], asyncio.Protocol], routes: frozenset[str],
                 handle: FastHandler, takes: Takes, max_body: int,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.fallback = fallback
        self.routes = routes
        self.handle = handle
        self.takes = takes
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.date = _Date()
        # Connections the front still serves (not handed to aiohttp).
        self.connections: set[_Connection] = set()
        # Requests answered here, connections handed to aiohttp (as the counters above).
        self.answered = 0
        self.handed_off = 0
        self._sweeper: asyncio.TimerHandle | None = None

    def __call__(self) -> _Connection:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)
        return _Connection(self)

    def _sweep(self) -> None:
        """Close keep-alive connections idle for ``keepalive_s``."""
        cutoff = time.monotonic() - self.keepalive_s
        for conn in list(self.connections):
            if conn.idle_since is not None and conn.idle_since < cutoff:
                conn.close()
        self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)

    def close(self) -> None:
        """Close every connection the front still serves (requests in flight are
        cancelled: call after the edge has drained)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self.connections):
            conn.close()


class _Connection(asyncio.Protocol):
    """One client connection while the front serves it."""

    def __init__(self, front: Front) -> None:
        self._front = front
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._task: asyncio.Task[None] | None = None
        self._paused = False
        # When the connection last read or wrote (None while a request is in progress).
        self.idle_since: float | None = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass
        self._front.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # eof_received is asyncio.Protocol's: the client's end closes the connection, and
    # aborts a request in progress (as aiohttp does).

    def connection_lost(self, exc: Exception | None) -> None:
        self._front.connections.discard(self)
        self._transport = None
        if self._task is not None:
            self._task.cancel()  # the client went away: its request is aborted

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._task is None:
            self.idle_since = time.monotonic()  # a request coming slowly is not idle
            self._next()
        elif len(self._buffer) > MAX_BUFFER and not self._paused:
            self._paused = True
            assert self._transport is not None
            self._transport.pause_reading()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _next(self) -> None:
        """Start the next buffered request, if it is complete: answer it here or hand the
        connection to aiohttp."""
        buf = self._buffer
        end = buf.find(b"\r\n\r\n", 0, MAX_HEAD)
        if end < 0:
            if len(buf) >= MAX_HEAD:
                self._hand_off()
            return
        front = self._front
        parsed = parse_head(bytes(buf[:end]))
        if parsed is None:
            return self._hand_off()
        method, path, headers = parsed
        length = headers.get("content-length", "")
        if (method != "POST" or path not in front.routes or not length.isdigit()
                or not length.isascii() or int(length) > front.max_body
                or not _NOT_PLAIN.isdisjoint(headers)):
            return self._hand_off()
        start = end + 4
        stop = start + int(length)
        if len(buf) < stop:
            return  # the body is still coming
        body = bytes(buf[start:stop])
        if not front.takes(path, body):
            return self._hand_off()
        head = bytes(buf[:start])
        del buf[:stop]
        keep_alive = "close" not in headers.get("connection", "").lower()
        self.idle_since = None
        self._task = asyncio.get_running_loop().create_task(
            self._answer(head, path, headers, body, keep_alive))

    async def _answer(self, head: bytes, path: str, headers: dict[str, str], body: bytes,
                      keep_alive: bool) -> None:
        front = self._front
        try:
            status, extra, payload = await front.handle(path, headers, body)
        except asyncio.CancelledError:
            raise
        except Declined:
            self._task = None
            self._buffer[:0] = head + body  # aiohttp reads the request from its start
            if self._transport is not None:
                self._hand_off()
            return
        except Exception:
            log.exception("unhandled error on %s", path)
            status, extra, payload = 500, {}, b'{"error":{"message":"internal error"}}'
        self._task = None
        front.answered += 1
        ANSWERED.inc()
        transport = self._transport
        if transport is None:
            return
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}",
                 "Content-Type: application/json",
                 f"Content-Length: {len(payload)}",
                 f"Date: {front.date()}"]
        lines.extend(f"{k}: {v}" for k, v in extra.items())
        if not keep_alive:
            lines.append("Connection: close")
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        if not keep_alive:
            transport.close()
            return
        self.idle_since = time.monotonic()
        if self._paused:
            self._paused = False
            transport.resume_reading()
        if self._buffer:
            self._next()

    def _hand_off(self) -> None:
        """aiohttp's protocol takes the connection, and the bytes not consumed yet."""
        transport = self._transport
        assert transport is not None and self._task is None
        self._front.connections.discard(self)
        self._front.handed_off += 1
        HANDOFFS.inc()
        proto = self._front.fallback()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if self._paused:
            self._paused = False
            transport.resume_reading()
        if self._buffer:
            data, self._buffer = bytes(self._buffer), bytearray()
            proto.data_received(data)
