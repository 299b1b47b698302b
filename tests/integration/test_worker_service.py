"""A worker (simulated GPU) on a real NATS server: submit, stream, abort, KV events, load."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.wire import (
    BUS_EVENT,
    STREAM_EVENT,
    SUBMIT_REPLY,
    AbortRequest,
    BlockStored,
    GenerateChunkEvent,
    KvEventBatch,
    LoadReportEvent,
    RequestDoneBatch,
    RequestDoneEvent,
    ResyncRequest,
    SamplingParams,
    StreamBatch,
    SubmitBatch,
    TokenizedRequest,
    encode,
    submit_replies,
)
from tests.helpers import eventually, running


class Recorder:
    """Collects decoded messages per subject."""

    def __init__(self) -> None:
        self.items: list = []

    async def __call__(self, msg) -> None:
        self.items.append(msg)

    def of(self, kind):
        return [m for m in self.items if isinstance(m, kind)]


@pytest.fixture
async def harness(bus: Bus, nats_server: str, prefix: str):
    """A worker ``w0`` in-process, and what it publishes: events (KV, load, completion
    records) and the streams of requests answered to inbox ``t``."""
    events, streams = Recorder(), Recorder()
    s = bus.subjects
    for subject in (s.kv_all, s.load_all, s.done):
        await bus.subscribe(subject, BUS_EVENT, events)
    await bus.subscribe(s.stream_inbox("t"), STREAM_EVENT, streams)
    cfg = WorkerConfig(nats_url=nats_server, subject_prefix=prefix, worker_id="w0",
                       load_interval_s=0.05, local_policy="fcfs")
    async with running(WorkerService(cfg)) as worker:
        yield bus, worker, events, streams


def _req(bus: Bus, rid: str, tokens: list[int], max_tokens: int = 5) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, token_ids=tokens, reply_to=bus.subjects.stream_reply(
        "t", rid), sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def test_submit_streams_tokens_and_reports(harness) -> None:
    bus, worker, events, streams = harness
    await eventually(lambda: events.of(LoadReportEvent))
    report = events.of(LoadReportEvent)[0]
    assert report.worker_id == "w0" and report.total_blocks > 0
    # Its engine instance, named in reports and KV batches alike (restart detection).
    assert report.engine_id and report.engine_id == worker.engine_id
    prompt = list(range(200, 264))
    ack = await bus.request(bus.subjects.worker_submit("w0"), _req(bus, "a", prompt),
                            SUBMIT_REPLY, 5)
    assert ack.accepted
    await eventually(lambda: streams.of(RequestDoneEvent))
    chunks = streams.of(GenerateChunkEvent)
    assert sum(len(c.token_ids) for c in chunks) == 5
    assert "".join(c.text for c in chunks).strip()
    done = streams.of(RequestDoneEvent)[0]
    assert (done.completion_tokens, done.prompt_tokens, done.finish_reason) == (5, 64, "length")
    await eventually(lambda: events.of(RequestDoneEvent) and events.of(KvEventBatch))
    stored = [e for b in events.of(KvEventBatch) for e in b.events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) >= 4  # 64 prompt tokens = 4 full blocks
    seqs = [b.seq for b in events.of(KvEventBatch)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert {b.engine_id for b in events.of(KvEventBatch)} == {report.engine_id}

    # Same prompt again: served from the prefix cache.
    streams.items.clear()
    await bus.request(bus.subjects.worker_submit("w0"), _req(bus, "b", prompt), SUBMIT_REPLY, 5)
    await eventually(lambda: streams.of(RequestDoneEvent))
    assert streams.of(RequestDoneEvent)[0].cached_tokens >= 48


async def test_abort_stops_a_request_and_resync_resends_the_cache(harness) -> None:
    bus, worker, events, streams = harness
    await bus.request(bus.subjects.worker_submit("w0"),
                      _req(bus, "long", list(range(300, 300 + 64)), max_tokens=2000),
                      SUBMIT_REPLY, 5)
    await eventually(lambda: streams.of(GenerateChunkEvent))
    await bus.publish(bus.subjects.worker_abort("w0"), AbortRequest(request_id="long"))
    await eventually(lambda: not worker.live)
    assert worker.engine.num_running == 0
    # An aborted stream gets nothing more: not even before the stream of a request sent
    # after the abort (one worker, one connection, one inbox: delivered in order).
    await bus.request(bus.subjects.worker_submit("w0"), _req(bus, "after", [7] * 32),
                      SUBMIT_REPLY, 5)
    await eventually(lambda: streams.of(RequestDoneEvent))
    assert [d.request_id for d in streams.of(RequestDoneEvent)] == ["after"]
    assert {c.request_id for c in streams.of(GenerateChunkEvent)} == {"long", "after"}
    before = len(events.of(KvEventBatch))
    await bus.publish(bus.subjects.worker_resync("w0"), ResyncRequest(worker_id="w0"))
    await eventually(lambda: len(events.of(KvEventBatch)) > before)
    snap = events.of(KvEventBatch)[-1]
    assert type(snap.events[0]).__name__ == "AllBlocksCleared"
    assert any(isinstance(e, BlockStored) for e in snap.events)


async def test_bad_submissions_are_refused_not_dropped(harness) -> None:
    bus, worker, events, streams = harness
    ack = await bus.request(bus.subjects.worker_submit("w0"), _req(bus, "empty", []),
                            SUBMIT_REPLY, 5)
    assert not ack.accepted and ack.error.code == "bad_request"
    raw = await bus.nc.request(bus.subjects.worker_submit("w0"), b"junk", timeout=5)
    assert not SUBMIT_REPLY.decode(raw.data).accepted


async def test_an_edge_that_reads_it_gets_the_last_chunk_inside_the_done_event(harness) -> None:
    """``done_carries_last``: the last chunk rides in the done event (a one-token request is
    one message); the tokens and text are those of separate chunks. Without the flag (an
    edge from before it), every chunk comes on its own and the done event holds none."""
    bus, worker, events, streams = harness
    s = bus.subjects
    for rid, fold in (("sep", False), ("fold", True)):
        req = _req(bus, rid, list(range(400, 420)), max_tokens=1)
        req.sampling.temperature = 0.0  # greedy: both get the same token
        req.done_carries_last = fold
        await bus.request(s.worker_submit("w0"), req, SUBMIT_REPLY, 5)
        await eventually(lambda rid=rid: [d for d in streams.of(RequestDoneEvent)
                                          if d.request_id == rid])
    sep = [m for m in streams.items if m.request_id == "sep"]
    fold = [m for m in streams.items if m.request_id == "fold"]
    assert [type(m) for m in sep] == [GenerateChunkEvent, RequestDoneEvent]
    assert sep[1].last is None
    assert [type(m) for m in fold] == [RequestDoneEvent]
    last = fold[0].last
    assert last is not None and (len(last.token_ids), last.index) == (1, 0) and last.text
    assert last.text == sep[0].text
    # The completion record on ``done`` carries no chunk.
    await eventually(lambda: {d.request_id for d in _records(events)} >= {"sep", "fold"})
    assert all(d.last is None for d in _records(events))


async def test_a_submit_batch_is_answered_request_by_request_in_order(harness) -> None:
    """The scheduler's share of a placement (``SubmitBatch``): each request is queued or
    refused on its own, the answers come back in one ``SubmitReplies``, in order."""
    bus, worker, events, streams = harness
    late = _req(bus, "late", list(range(600, 620)), max_tokens=1)
    late.deadline = time.time() - 1  # refused: its deadline has passed
    batch = SubmitBatch(requests=[_req(bus, "b1", list(range(500, 520)), max_tokens=1), late,
                                  _req(bus, "b2", list(range(700, 720)), max_tokens=1)])
    answer = await bus.nc.request(bus.subjects.worker_submit("w0"), encode(batch), timeout=5)
    replies = submit_replies(answer.data)
    assert [(r.request_id, r.accepted, r.worker_id) for r in replies] == [
        ("b1", True, "w0"), ("late", False, "w0"), ("b2", True, "w0")]
    assert replies[1].error.code == "timeout" and replies[1].error.retriable
    await eventually(lambda: {e.request_id for e in streams.of(RequestDoneEvent)} >= {
        "b1", "b2"})


async def test_events_ready_together_are_each_published_once_and_in_order(harness) -> None:
    """Stream events of one edge's requests that a step made go to its batch subject
    together (``StreamBatch``), the records of requests that end in one step on ``done``
    (``RequestDoneBatch``): each request's stream is whole and in order, and no record is
    lost or repeated."""
    bus, worker, events, streams = harness
    rids = [f"r{i}" for i in range(6)]
    for rid in rids:  # one burst: the engine takes them into the same steps
        req = _req(bus, rid, list(range(600, 620)), max_tokens=3)
        req.stream_batch_to = bus.subjects.stream_batch("t")
        await bus.publish(bus.subjects.worker_submit("w0"), req)
    await eventually(lambda: len(_records(events)) >= len(rids))
    await eventually(lambda: not worker.live)
    assert sorted(d.request_id for d in _records(events)) == rids
    await eventually(lambda: len(_stream(streams, RequestDoneEvent)) >= len(rids))
    for rid in rids:
        own = [e for e in _stream(streams, object) if e.request_id == rid]
        assert [type(e) for e in own] == [GenerateChunkEvent] * 3 + [RequestDoneEvent]
        assert [e.index for e in own[:3]] == [0, 1, 2]
    assert streams.of(StreamBatch)  # six requests in the same steps: batched


def _stream(streams: Recorder, kind) -> list:
    """Stream events of ``kind`` received, batched or not, in arrival order."""
    out = []
    for m in streams.items:
        out.extend(m.events if isinstance(m, StreamBatch) else [m])
    return [e for e in out if isinstance(e, kind)]


def _records(events: Recorder) -> list[RequestDoneEvent]:
    """Every completion record seen on ``done``, batched or not."""
    out = events.of(RequestDoneEvent)
    for batch in events.of(RequestDoneBatch):
        out.extend(batch.events)
    return out


async def test_a_request_sent_by_an_edge_records_its_path_delay(harness) -> None:
    """``worker_arrival_delay_seconds``: from the edge's ``created`` time to the arrival,
    observed once per request that names one."""
    bus, worker, _events, _streams = harness

    def delays() -> tuple[float, float]:
        labels = {"worker": "w0"}
        return (REGISTRY.get_sample_value("prefixmesh_worker_arrival_delay_seconds_count",
                                          labels) or 0.0,
                REGISTRY.get_sample_value("prefixmesh_worker_arrival_delay_seconds_sum",
                                          labels) or 0.0)

    count0, sum0 = delays()
    unnamed = _req(bus, "untimed", list(range(300, 316)), max_tokens=1)
    assert (await bus.request(bus.subjects.worker_submit("w0"), unnamed, SUBMIT_REPLY,
                              5)).accepted
    assert delays()[0] == count0  # no created time: nothing to measure
    timed = _req(bus, "timed", list(range(400, 416)), max_tokens=1)
    timed.created = time.time() - 0.25  # sent a quarter second ago
    assert (await bus.request(bus.subjects.worker_submit("w0"), timed, SUBMIT_REPLY,
                              5)).accepted
    count1, sum1 = delays()
    assert count1 == count0 + 1
    assert 0.25 <= sum1 - sum0 < 5.0
