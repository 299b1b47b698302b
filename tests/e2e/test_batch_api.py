"""The Batch API end to end on a mesh of sim workers, driven by the official openai client:
upload, create, progress, results; cancel; a restart of every service mid-batch."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from prefixmesh.services.up import LocalMesh, MeshOptions
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve
from prefixmesh.shared.wire import BUS_EVENT, LoadReportEvent, done_records
from tests.helpers import eventually, mesh_options

pytestmark = pytest.mark.timeout(240)

DOCS = [" ".join(f"Document {d}, paragraph {i}: batches that share a document are planned "
                 f"as one prefix group." for i in range(25)) for d in range(4)]


def batch_jsonl(n_per_doc: int, max_tokens: int, chat: bool = False) -> bytes:
    """Lines sharing four documents (n_per_doc questions each), OpenAI's batch format."""
    rows = []
    for q in range(n_per_doc):
        for d, doc in enumerate(DOCS):
            cid = f"doc{d}-q{q}"
            if chat:
                body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                        "messages": [{"role": "system", "content": doc},
                                     {"role": "user", "content": f"Question {q}?"}]}
                url = "/v1/chat/completions"
            else:
                body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                        "prompt": f"{doc}\n\nQuestion {q}: what is planned?"}
                url = "/v1/completions"
            rows.append({"custom_id": cid, "method": "POST", "url": url, "body": body})
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


# The mesh of every test here: batch lines planned in prefix groups on the workers.
BATCH_MESH = {"local_policy": "batch_groups",
              "extra_env": {"PM_BATCH_INFLIGHT_PER_WORKER": "6"}}
WORKERS = 2


@pytest.fixture(scope="module")
def mesh_config() -> dict:
    return BATCH_MESH


class DoneCounter:
    """Counts the workers' completion records per request id (runs of each line), and keeps
    their load reports."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.runs: Counter[str] = Counter()
        self.loads: list[LoadReportEvent] = []

    async def on_event(self, ev: object) -> None:
        for done in done_records(ev):  # one record, or one engine step's batch of them
            if done.request_id.startswith("batch_"):
                self.runs[done.request_id] += 1
        if isinstance(ev, LoadReportEvent):
            self.loads.append(ev)

    async def settled(self) -> None:
        """Wait until every worker has reported itself idle twice since this call: a run it
        had going has ended, and its completion record (published before the later report,
        on the same connection) has been counted."""
        mark = len(self.loads)

        def idle_twice() -> bool:
            idle = Counter(r.worker_id for r in self.loads[mark:] if r.running + r.waiting == 0)
            return len(idle) == WORKERS and min(idle.values()) >= 2

        await eventually(idle_twice, timeout=30)

    async def flushed(self) -> None:
        """Wait until the server has handed this client everything published before now
        (a round trip to it: what stopped services sent is all counted then)."""
        await self.bus.nc.flush(timeout=10)


async def watch_done(connect_bus, prefix: str) -> DoneCounter:
    bus = await connect_bus(prefix, "test-done")
    counter = DoneCounter(bus)
    await bus.subscribe(bus.subjects.done, BUS_EVENT, counter.on_event)
    await bus.subscribe(bus.subjects.load_all, BUS_EVENT, counter.on_event)
    return counter


async def wait_for(client: AsyncOpenAI, bid: str, pred, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        b = await client.batches.retrieve(bid)
        if pred(b):
            return b
        assert time.monotonic() < deadline, f"batch stuck: {b.status} {b.request_counts}"
        await asyncio.sleep(0.2)


async def results(client: AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line.strip()]


def client_for(mesh: LocalMesh) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_batch_runs_every_line_once(mesh: LocalMesh, connect_bus) -> None:
    done = await watch_done(connect_bus, mesh.opts.subject_prefix)
    client = client_for(mesh)
    try:
        f = await client.files.create(file=("in.jsonl", batch_jsonl(6, 4)), purpose="batch")
        assert f.object == "file" and f.purpose == "batch" and f.bytes > 0
        assert (await client.files.retrieve(f.id)).id == f.id
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                        completion_window="24h", metadata={"job": "e2e"})
        assert b.status in ("validating", "in_progress") and b.metadata == {"job": "e2e"}
        b = await wait_for(client, b.id, lambda x: x.status == "completed")
        assert b.request_counts.total == 24 and b.request_counts.completed == 24
        assert b.request_counts.failed == 0 and b.error_file_id is None
        assert b.completed_at and b.in_progress_at and b.finalizing_at
        rows = await results(client, b.output_file_id)
        assert sorted(r["custom_id"] for r in rows) == sorted(
            f"doc{d}-q{q}" for d in range(4) for q in range(6))
        for r in rows:
            assert r["error"] is None and r["response"]["status_code"] == 200
            body = r["response"]["body"]
            assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
        # Lines sharing a document reuse its KV: most prompt tokens were cached.
        prompt = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in rows)
        cached = sum(r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
                     for r in rows)
        assert cached > 0.5 * prompt
        await done.settled()
        assert len(done.runs) == 24 and set(done.runs.values()) == {1}
        listed = await client.batches.list(limit=5)
        assert b.id in [x.id for x in listed.data]
        # Progress reaches the metrics service's cluster view (and the edge's /metrics).
        async with aiohttp.ClientSession() as http:
            async with http.get(mesh.metrics_url + "/cluster") as r:
                view = await r.json()
            async with http.get(mesh.url + "/metrics") as r:
                edge_metrics = await r.text()
        (row,) = [x for x in view["batches"] if x["id"] == b.id]
        assert row == {"id": b.id, "status": "completed", "total": 24, "completed": 24,
                       "failed": 0}
        assert 'prefixmesh_batch_lines_total{outcome="completed"}' in edge_metrics
    finally:
        await client.close()


async def test_chat_batch_and_bad_lines(mesh: LocalMesh) -> None:
    client = client_for(mesh)
    try:
        f = await client.files.create(file=("chat.jsonl", batch_jsonl(2, 3, chat=True)),
                                      purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        b = await wait_for(client, b.id, lambda x: x.status == "completed")
        rows = await results(client, b.output_file_id)
        assert len(rows) == 8
        assert rows[0]["response"]["body"]["object"] == "chat.completion"
        # A line whose body is invalid lands in the error file; the rest still run.
        bad = batch_jsonl(1, 3) + json.dumps({"custom_id": "bad", "method": "POST",
                                              "url": "/v1/completions",
                                              "body": {"model": "nope", "prompt": "x"}}).encode()
        f = await client.files.create(file=("bad.jsonl", bad), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                        completion_window="24h")
        b = await wait_for(client, b.id, lambda x: x.status == "completed")
        assert (b.request_counts.completed, b.request_counts.failed) == (4, 1)
        (err,) = await results(client, b.error_file_id)
        assert err["custom_id"] == "bad" and err["response"]["status_code"] in (400, 404)
        assert err["error"]["message"]
        # A malformed file fails validation with line-level errors.
        f = await client.files.create(file=("broken.jsonl", b'{"custom_id": 1}\n'),
                                      purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                        completion_window="24h")
        b = await wait_for(client, b.id, lambda x: x.status == "failed")
        assert b.errors.data[0].line == 1
        with pytest.raises(BadRequestError):
            await client.batches.create(input_file_id="file-missing",
                                        endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(NotFoundError):
            await client.batches.retrieve("batch_missing")
    finally:
        await client.close()


async def test_cancel_stops_the_batch(mesh: LocalMesh) -> None:
    client = client_for(mesh)
    try:
        f = await client.files.create(file=("big.jsonl", batch_jsonl(40, 48)), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                        completion_window="24h")
        await wait_for(client, b.id, lambda x: x.request_counts.completed >= 4)
        c = await client.batches.cancel(b.id)
        assert c.status in ("cancelling", "cancelled")
        b = await wait_for(client, b.id, lambda x: x.status == "cancelled", timeout=30)
        assert b.cancelled_at and b.cancelling_at
        assert 4 <= b.request_counts.completed < b.request_counts.total == 160
        rows = await results(client, b.output_file_id)
        assert len(rows) == b.request_counts.completed
        assert len({r["custom_id"] for r in rows}) == len(rows)
        # A cancelled batch stays cancelled.
        assert (await client.batches.cancel(b.id)).status == "cancelled"
    finally:
        await client.close()


async def test_restart_of_every_service_mid_batch(nats_server: str, redis_server: str,
                                                  prefix: str, tmp_path: Path,
                                                  connect_bus) -> None:
    done = await watch_done(connect_bus, prefix)
    total = 4 * 30

    def options(logs: Path) -> MeshOptions:
        return mesh_options(nats_server, redis_server, logs, subject_prefix=prefix,
                            **BATCH_MESH)

    with LocalMesh(options(tmp_path / "a")) as m:
        client = client_for(m)
        f = await client.files.create(file=("in.jsonl", batch_jsonl(30, 32)),
                                      purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                        completion_window="24h")
        await wait_for(client, b.id, lambda x: x.request_counts.completed >= 10)
        await client.close()
    # Every service stopped (edge first: it drained its in-flight lines).
    await done.flushed()
    before = sum(done.runs.values())
    assert 10 <= before < total
    with LocalMesh(options(tmp_path / "b")) as m:
        client = client_for(m)
        b = await client.batches.retrieve(b.id)  # resumed on start (may be done already)
        assert b.status in ("in_progress", "finalizing", "completed")
        assert b.request_counts.completed >= before
        b = await wait_for(client, b.id, lambda x: x.status == "completed")
        assert b.request_counts.completed == total and b.request_counts.failed == 0
        rows = await results(client, b.output_file_id)
        await client.close()
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == total and len(set(ids)) == total
    await done.flushed()
    # No line ran twice: one completion record per line, across both meshes.
    assert len(done.runs) == total and set(done.runs.values()) == {1}
