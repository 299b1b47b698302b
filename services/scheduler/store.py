"""Write-behind persistence of the global policy to Redis: incremental, sliced, pipelined.

Routing never waits on this. A flush takes what changed since the last one from the
policy in O(1) (``take_changes``), then encodes it a slice at a time, yielding to the event
loop between slices, and writes it in pipelines:

- ``<base>:nodes``: a hash, tree node id -> node record (changed nodes written, pruned
  ones deleted);
- ``<base>:log``: a hash, segment number -> window-log segment (entries and completions
  added since the previous flush), with ``<base>:logidx``, a sorted set of segment numbers
  scored by their newest time, so segments older than the window are deleted;
- ``<base>:meta``: the small rest (workers, replica sets or outstanding requests),
  written last, so its presence means a flush completed.

The first flush after activation, after any failure, and after Redis comes back empty
(``meta`` gone) rewrites everything (``all_state``), still a slice at a time. Records are
written a slice at a time, so the stored state may mix moments; the loaders keep what is
consistent (``PrefixTree.load_records``) and the next flush heals the rest.

Times are stored in a wall-clock epoch (``offset`` = wall - monotonic, fixed per store), so
a standby on another host maps them onto its own monotonic clock.

A flush writes its commands as RESP it packs itself (``RespBatch``) on one of the client's
pooled connections: every argument is bytes, an int or a str already, so packing is a few
byte-string formats, where redis-py's pipeline encodes and checks each argument in Python
(docs/benchmarks.md, "The scheduler's write-behind, measured alone").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from prefixmesh.services.scheduler.policies.base import GlobalPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """How finely a flush is cut (each slice runs without yielding to routing)."""

    # Tree nodes encoded per slice, and blocks (hashes) per slice, whichever comes first.
    slice_nodes: int = 128
    slice_blocks: int = 8_192
    # Window-log items per segment (one segment is one slice).
    slice_log: int = 512
    # Bytes queued before they are sent (and the replies read) in one write.
    pipeline_bytes: int = 64 << 10


@dataclass(slots=True)
class FlushStats:
    """What one flush wrote (for logs, metrics and tests)."""

    full: bool = False
    nodes: int = 0
    gone: int = 0
    segments: int = 0
    expired: int = 0
    bytes: int = 0
    slices: int = 0


def _arg(a: bytes | str | int | float) -> bytes:
    if isinstance(a, bytes):
        return a
    if isinstance(a, str):
        return a.encode()
    return repr(a).encode()  # int or float, as redis-py writes them


class RespBatch:
    """Commands packed as RESP here, sent in one write and their replies read in order
    on a connection of ``client``'s pool (what a non-transactional pipeline does, without
    redis-py's per-argument packing). An error reply raises ``ResponseError`` once all
    replies are read; a connection error drops the connection."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.parts: list[bytes] = []
        self.commands = 0
        self.bytes = 0

    def command(self, *args: bytes | str | int | float) -> None:
        parts = self.parts
        parts.append(b"*%d\r\n" % len(args))
        for a in args:
            b = _arg(a)
            parts.append(b"$%d\r\n" % len(b))
            parts.append(b)
            parts.append(b"\r\n")
            self.bytes += len(b)
        self.commands += 1

    def hset(self, key: bytes, mapping: dict[int, bytes]) -> None:
        """``HSET key field value ...`` of int fields and bytes values (the node records:
        the hot case, packed without a call per argument)."""
        parts = self.parts
        parts.append(b"*%d\r\n$4\r\nHSET\r\n$%d\r\n%s\r\n"
                     % (2 + 2 * len(mapping), len(key), key))
        n = len(key)
        for field, value in mapping.items():
            f = b"%d" % field
            parts.append(b"$%d\r\n%s\r\n$%d\r\n" % (len(f), f, len(value)))
            parts.append(value)
            parts.append(b"\r\n")
            n += len(f) + len(value)
        self.bytes += n
        self.commands += 1

    def hdel(self, key: bytes, fields: list[int]) -> None:
        """``HDEL key field ...`` of int fields (pruned node ids: about one a decision)."""
        digits = [b"%d" % f for f in fields]
        self.parts.append(b"*%d\r\n$4\r\nHDEL\r\n$%d\r\n%s\r\n"
                          % (2 + len(digits), len(key), key))
        self.parts.extend(b"$%d\r\n%s\r\n" % (len(d), d) for d in digits)
        self.bytes += len(key) + sum(map(len, digits))
        self.commands += 1

    async def send(self) -> None:
        """Write what is queued and read every reply; the batch is empty after."""
        if not self.commands:
            return
        data, count = b"".join(self.parts), self.commands
        self.parts, self.commands, self.bytes = [], 0, 0
        pool = self.client.connection_pool
        conn = await pool.get_connection()
        error: ResponseError | None = None
        try:
            await conn.send_packed_command(data)
            for _ in range(count):
                try:
                    await conn.read_response()
                except ResponseError as exc:  # the other replies are still to be read
                    error = error or exc
        except BaseException:
            await conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            await pool.release(conn)
        if error is not None:
            raise error


class StateStore:
    """One policy's state under ``base`` in Redis."""

    def __init__(self, client: aioredis.Redis, base: str,
                 limits: StoreLimits = StoreLimits(),
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.client = client
        # The policy's clock and the shared epoch (tests pass virtual ones).
        self.clock = clock
        self.wall = wall
        self.limits = limits
        self.meta_key = f"{base}:meta"
        self.nodes_key = f"{base}:nodes"
        self.log_key = f"{base}:log"
        self.logidx_key = f"{base}:logidx"
        self.offset = wall() - clock()
        self._full = True
        self._next_seg = 0
        self.last = FlushStats()

    def need_full(self) -> None:
        """Make the next flush rewrite everything."""
        self._full = True

    # ------------------------------------------------------------------ load

    async def load(self, policy: GlobalPolicy) -> bool:
        """Replace the policy's state by the stored one; False when nothing is stored."""
        c = self.client
        async with c.pipeline(transaction=True) as pipe:
            pipe.get(self.meta_key)
            pipe.hvals(self.nodes_key)
            pipe.hgetall(self.log_key)
            meta, nodes, segs = await pipe.execute()
        if not meta:
            return False
        ordered = [segs[k] for k in sorted(segs, key=int)]
        self._next_seg = (int(max(segs, key=int)) + 1) if segs else 0
        now = self.clock()
        policy.state.load_persisted(meta, nodes, ordered, now - self.wall(), now)
        self._full = True  # the loaders may have dropped records: write a clean copy
        return True

    # ------------------------------------------------------------------ flush

    async def flush(self, policy: GlobalPolicy) -> FlushStats:
        """Write what changed (everything when a full rewrite is due). On failure the next
        flush is a full one, so nothing taken from the policy is ever lost."""
        try:
            return await self._flush(policy)
        except BaseException:
            self._full = True
            raise

    async def _flush(self, policy: GlobalPolicy) -> FlushStats:
        c = self.client
        full = self._full
        if not full and not await c.exists(self.meta_key):
            full = True  # Redis came back empty (or someone wiped it): rewrite everything
        stats = FlushStats(full=full)
        if full:
            # Fails fast while Redis is down, before any encoding work.
            await c.unlink(self.nodes_key, self.log_key, self.logidx_key)
            policy.state.track_changes()  # changes from now on go to the next flush
            changes = policy.state.all_state()
            self._full = False
        else:
            changes = policy.state.take_changes()
        lim = self.limits
        offset = self.offset
        out = RespBatch(c)
        nodes_key = self.nodes_key.encode()

        async def send() -> None:
            stats.bytes += out.bytes
            await out.send()

        # Tree nodes, a slice at a time; one HSET for what is sent at once.
        batch: dict[int, bytes] = {}  # node id -> record
        queued = sliced = blocks = 0
        for node in changes.nodes:
            rec = policy.state.encode_node(node, offset)
            if rec is not None:
                batch[node.nid] = rec
                queued += len(rec)
                sliced += 1
                blocks += len(node.hashes)
            if sliced >= lim.slice_nodes or blocks >= lim.slice_blocks:
                stats.slices += 1
                sliced = blocks = 0
                if queued >= lim.pipeline_bytes:
                    out.hset(nodes_key, batch)
                    stats.nodes += len(batch)
                    batch, queued = {}, 0
                    await send()
                await asyncio.sleep(0)  # let routing run
        if batch:
            out.hset(nodes_key, batch)
            stats.nodes += len(batch)
        gone = changes.gone
        for i in range(0, len(gone), 4096):
            out.hdel(nodes_key, gone[i : i + 4096])
        stats.gone = len(gone)
        # Window log: one segment per slice.
        items = changes.log
        for i in range(0, len(items), lim.slice_log):
            blob, newest = policy.state.encode_log(items[i : i + lim.slice_log], offset)
            seg = self._next_seg
            self._next_seg += 1
            out.command(b"HSET", self.log_key, seg, blob)
            out.command(b"ZADD", self.logidx_key, newest, seg)
            stats.segments += 1
            stats.slices += 1
            if out.bytes >= lim.pipeline_bytes:
                await send()
            await asyncio.sleep(0)
        await send()
        # Expire segments older than the window, then the meta record (last: a complete
        # flush is one whose meta is there).
        window = policy.state.log_window_s
        if window > 0:
            cut = self.clock() + self.offset - window
            old = await c.zrangebyscore(self.logidx_key, "-inf", f"({cut}")
            if old:
                out.command(b"HDEL", self.log_key, *old)
                out.command(b"ZREM", self.logidx_key, *old)
                stats.expired = len(old)
        meta = policy.state.encode_meta(offset)
        out.command(b"SET", self.meta_key, meta)
        await send()
        self.last = stats
        return stats
