"""Durable batch state on NATS JetStream: a KV bucket for records, an object store for files.

Layout (``<p>`` = the subject prefix, so test clusters never share buckets):

- object store ``<p>_batch_files``: file bytes by file id (uploads, outputs, errors);
- KV ``<p>_batch``:
  - ``file.<id>``: ``FileRecord``;
  - ``batch.<id>``: ``BatchRecord`` (status, counts, file ids);
  - ``line.<batch id>.<index>``: ``LineResult`` of one line, written with KV ``create``
    (fails when the key exists), so a line's result is recorded at most once whatever
    runner, restart or retry races to record it. This is the idempotency key a restart
    resumes from: lines with a result are never submitted again.

Both live in file storage on the NATS server, so they survive a restart of every
prefixmesh service (and of NATS itself, with its data directory).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import APIError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from prefixmesh.services.edge.batch_format import (
    BatchRecord,
    FileRecord,
    LineResult,
    decode_record,
    encode_record,
)

log = logging.getLogger(__name__)

# Seconds a listing watch waits for the server's "no more entries" marker.
LIST_TIMEOUT_S = 5.0
# Seconds the edge waits at start for JetStream to answer (a cluster electing its meta
# leader), and between two tries.
JETSTREAM_READY_S = 30.0
JETSTREAM_RETRY_S = 0.5


class BatchStore:
    """Files, batches and per-line results, durable in JetStream."""

    def __init__(self, js: JetStreamContext, bucket: str, kv: KeyValue,
                 files: ObjectStore) -> None:
        self.js = js
        self.bucket = bucket
        self.kv = kv
        self.files = files

    @classmethod
    async def open(cls, nc: Client, prefix: str, replicas: int = 1,
                   ready_timeout_s: float = JETSTREAM_READY_S) -> BatchStore:
        """Bind to (creating when missing, kept on ``replicas`` NATS nodes) the prefix's
        KV bucket and object store, waiting up to ``ready_timeout_s`` for JetStream: a
        clustered JetStream answers only once its nodes have elected a meta leader, which
        can take seconds after they start (or after one of them restarts)."""
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                return await cls._bind(nc, prefix, replicas)
            except (nats.errors.TimeoutError, APIError) as exc:
                # APIError covers "JetStream unavailable" and a create raced by another
                # edge creating the same bucket (the next lookup finds it).
                if time.monotonic() >= deadline:
                    raise
                log.info("JetStream not ready yet (%s); asking again", exc)
                await asyncio.sleep(JETSTREAM_RETRY_S)

    @classmethod
    async def _bind(cls, nc: Client, prefix: str, replicas: int) -> BatchStore:
        js = nc.jetstream()
        name = prefix.replace("-", "_")
        bucket = f"{name}_batch"
        try:
            kv = await js.key_value(bucket)
        except NotFoundError:
            kv = await js.create_key_value(bucket=bucket, history=1, storage=StorageType.FILE,
                                           replicas=replicas)
        try:
            obs = await js.object_store(f"{name}_batch_files")
        except NotFoundError:
            obs = await js.create_object_store(f"{name}_batch_files", storage=StorageType.FILE,
                                               replicas=replicas)
        return cls(js, bucket, kv, obs)

    # ------------------------------------------------------------------ files

    async def put_file(self, rec: FileRecord, data: bytes) -> None:
        """Store a file's bytes, then its record (a record always has its bytes)."""
        await self.files.put(rec.id, data)
        await self.kv.put(f"file.{rec.id}", encode_record(rec))

    async def get_file(self, file_id: str) -> FileRecord | None:
        return await self._get(f"file.{file_id}", FileRecord)

    async def file_content(self, file_id: str) -> bytes:
        res = await self.files.get(file_id)
        return res.data or b""

    # ------------------------------------------------------------------ batches

    async def put_batch(self, rec: BatchRecord) -> None:
        await self.kv.put(f"batch.{rec.id}", encode_record(rec))

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        return await self._get(f"batch.{batch_id}", BatchRecord)

    async def list_batches(self) -> list[BatchRecord]:
        """Every stored batch (for resuming, and GET /v1/batches), newest first."""
        recs = [decode_record(v, BatchRecord) for v in await self._scan("batch.*")]
        return sorted(recs, key=lambda r: (-r.created_at, r.id))

    # ------------------------------------------------------------------ line results

    async def record_line(self, batch_id: str, index: int, result: LineResult) -> bool:
        """Record a line's result once; False when one was already recorded."""
        try:
            await self.kv.create(f"line.{batch_id}.{index}", encode_record(result))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def line_results(self, batch_id: str) -> dict[int, LineResult]:
        """Every recorded result of a batch, by line index."""
        out: dict[int, LineResult] = {}
        for key, value in await self._scan_items(f"line.{batch_id}.*"):
            out[int(key.rsplit(".", 1)[1])] = decode_record(value, LineResult)
        return out

    # ------------------------------------------------------------------ helpers

    async def _get(self, key: str, typ: type[msgspec.Struct]):
        try:
            entry = await self.kv.get(key)
        except NotFoundError:
            return None
        return decode_record(entry.value, typ) if entry.value else None

    async def _scan(self, pattern: str) -> list[bytes]:
        return [v for _, v in await self._scan_items(pattern)]

    async def _scan_items(self, pattern: str) -> list[tuple[str, bytes]]:
        """Current values of keys matching ``pattern`` (a server-side subject filter).

        The number of keys comes from the stream first (a KV bucket is the stream
        ``KV_<bucket>`` over subjects ``$KV.<bucket>.<key>``), then a watch delivers their
        last values until that many have arrived. The watch's own "initial values done"
        marker is not used: nats-py can put it before the values when they reach the
        client before its consumer-info request returns, which made a listing come back
        empty under load.
        """
        info = await self.js.stream_info(f"KV_{self.bucket}",
                                         subjects_filter=f"$KV.{self.bucket}.{pattern}")
        expected = len(info.state.subjects or {})
        out: list[tuple[str, bytes]] = []
        if not expected:
            return out
        watcher = await self.kv.watch(pattern)
        try:
            seen = 0
            while seen < expected:
                entry = await watcher.updates(LIST_TIMEOUT_S)
                if entry is None:  # the marker: ignored, see above
                    continue
                seen += 1
                if entry.value and entry.operation is None:  # deletes have no value
                    out.append((entry.key, entry.value))
        finally:
            await watcher.stop()
        return out
