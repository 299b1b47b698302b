"""Streams survive lost events: a worker resends on ResumeRequest, the edge asks for it."""

from __future__ import annotations

import pytest

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.wire import (
    STREAM_EVENT,
    SUBMIT_REPLY,
    GenerateChunkEvent,
    RequestDoneEvent,
    ResumeRequest,
    SamplingParams,
    TokenizedRequest,
)
from tests.helpers import eventually, running


def _worker(nats_server: str, prefix: str, worker_id: str) -> WorkerService:
    return WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix,
                                      worker_id=worker_id, load_interval_s=0.05))


async def test_a_worker_resends_a_stream_nobody_heard(bus: Bus, nats_server: str,
                                                      prefix: str) -> None:
    worker = _worker(nats_server, prefix, "wr")
    events: list = []

    async def on_event(ev: object) -> None:
        events.append(ev)

    async with running(worker):
        submit = bus.subjects.worker_submit("wr")
        # The stream goes to an inbox nobody has subscribed to yet: all of it is lost.
        req = TokenizedRequest(request_id="r1", token_ids=list(range(200, 280)),
                               sampling=SamplingParams(max_tokens=12, ignore_eos=True),
                               reply_to=bus.subjects.stream_reply("late", "r1"))
        assert (await bus.request(submit, req, SUBMIT_REPLY, 5)).accepted
        await eventually(lambda: worker.finished.get("r1") is not None, timeout=10)
        await bus.subscribe(bus.subjects.stream_inbox("late"), STREAM_EVENT, on_event)

        ack = await bus.request(submit, ResumeRequest(request_id="r1", from_index=5),
                                SUBMIT_REPLY, 5)
        assert ack.accepted
        await eventually(lambda: any(isinstance(e, RequestDoneEvent) for e in events))
        chunks = [e for e in events if isinstance(e, GenerateChunkEvent)]
        done = events[-1]
        assert done.completion_tokens == 12 and done.finish_reason == "length"
        # Everything from token 5 on (from the chunk boundary at or before it).
        assert chunks and chunks[0].index <= 5
        assert chunks[0].index + len(chunks[0].token_ids) == 12

        unknown = await bus.request(submit, ResumeRequest(request_id="nope"),
                                    SUBMIT_REPLY, 5)
        assert not unknown.accepted and unknown.error.code == "not_found"
        assert unknown.error.retriable


async def _stream_through_an_outage(bus: Bus, worker: WorkerService, rid: str, prompt: list[int],
                                    max_tokens: int, timeouts, after_tokens: int, outage,
                                    reconnect: bool = False):
    """The edge's side of one request (its ``MeshClient``) to ``worker``: once
    ``after_tokens`` tokens came, the edge's inbox is unsubscribed, ``outage()`` awaited
    (events published meanwhile reach nobody) and the inbox subscribed again (then, with
    ``reconnect``, the bus client counts a reconnect, as after one). Returns the
    tokens the caller got (checked to come in order, none twice), its done events and the
    MeshClient."""
    from prefixmesh.services.edge.pipeline import MeshClient

    mesh = MeshClient(bus, "e" + rid, timeouts, predict=False)
    inbox = bus.subjects.stream_inbox("e" + rid)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=None,
                              stop=[], ignore_eos=True)
    got: list[int] = []
    done: list[RequestDoneEvent] = []
    sub = await bus.subscribe(inbox, STREAM_EVENT, mesh.streams.on_event)
    async for ev in mesh.generate(rid, prompt, sampling, tenant="", worker_id=worker.worker_id):
        if isinstance(ev, RequestDoneEvent):
            done.append(ev)
            continue
        assert ev.index == len(got)  # in order, nothing twice
        got.extend(ev.token_ids)
        if sub is not None and len(got) >= after_tokens:
            await sub.unsubscribe()
            await outage()
            await bus.subscribe(inbox, STREAM_EVENT, mesh.streams.on_event)
            sub = None
            if reconnect:
                bus.nc.stats["reconnects"] += 1
    return got, done, mesh


async def test_the_edge_recovers_events_it_missed_mid_stream(bus: Bus, nats_server: str,
                                                             prefix: str) -> None:
    """The edge's inbox is gone for a while mid-stream (as in a reconnect window): the next
    chunk shows a gap, the edge asks the worker to resend, and the caller gets every token
    exactly once, in order, then the done event."""
    from prefixmesh.services.edge.pipeline import MeshTimeouts

    worker = _worker(nats_server, prefix, "wg")

    async def outage() -> None:  # the worker streams on (10 tokens) to nobody
        def streamed_on() -> bool:
            req = worker.engine.get("g1")
            return req is None or req.num_output_tokens >= 15
        await eventually(streamed_on)

    async with running(worker):
        got, done, mesh = await _stream_through_an_outage(
            bus, worker, "g1", list(range(300, 364)), 60, MeshTimeouts(worker_silence_s=0),
            5, outage)
    assert len(got) == 60 and len(done) == 1 and done[0].completion_tokens == 60
    assert mesh.resumes >= 1


async def test_after_a_reconnect_the_edge_fetches_a_lost_ending(bus: Bus, nats_server: str,
                                                                prefix: str) -> None:
    """Everything after the first chunk, done event included, was published while the edge
    was not subscribed. Nothing more arrives, so no gap shows; the edge's reconnect (its
    client's reconnect count) is what makes it ask the worker, which resends the rest."""
    from prefixmesh.services.edge.pipeline import MeshTimeouts

    worker = _worker(nats_server, prefix, "wh")

    async def outage() -> None:  # the whole rest of the stream
        await eventually(lambda: worker.finished.get("h1") is not None)

    async with running(worker):
        got, done, mesh = await _stream_through_an_outage(
            bus, worker, "h1", list(range(400, 464)), 20,
            MeshTimeouts(worker_silence_s=0, request_s=30), 1, outage, reconnect=True)
    assert len(got) == 20 and len(done) == 1 and done[0].completion_tokens == 20
    assert mesh.resumes == 1


@pytest.mark.parametrize("resent", [True, False])
async def test_a_chunk_lost_right_before_the_done_event_is_fetched(bus: Bus,
                                                                   resent: bool) -> None:
    """A worker (scripted here, on the real bus) whose second chunk never reaches the edge
    and whose done event, carrying the last chunk, does: the edge asks for the rest and
    hands the caller every token before the done event, none short. A worker that
    accepts the resume but never resends: the request fails as lost (retriable) within a
    tick, neither hanging nor ending short as if whole."""
    from prefixmesh.services.edge.pipeline import MeshClient, MeshTimeouts, WorkerLost
    from prefixmesh.shared.wire import WORKER_REQUEST, SubmitReply, encode

    resumes: list[int] = []

    def chunk(index: int, n: int) -> GenerateChunkEvent:
        return GenerateChunkEvent(request_id="q1", index=index,
                                  token_ids=list(range(index, index + n)), text="x" * n)

    def done(last: GenerateChunkEvent | None) -> RequestDoneEvent:
        return RequestDoneEvent(request_id="q1", worker_id="wq", completion_tokens=9,
                                last=last)

    async def worker(msg) -> None:
        req = WORKER_REQUEST.decode(msg.data)
        await msg.respond(encode(SubmitReply(request_id=req.request_id, worker_id="wq")))
        if isinstance(req, TokenizedRequest):
            reply_to = req.reply_to
            streams[req.request_id] = reply_to
            await bus.publish(reply_to, chunk(0, 3))
            # chunk(3, 3) is lost on the way; the done event carries chunk(6, 3).
            await bus.publish(reply_to, done(chunk(6, 3)))
        elif isinstance(req, ResumeRequest):
            resumes.append(req.from_index)
            reply_to = streams[req.request_id]
            if not resent:
                return
            await bus.publish(reply_to, chunk(req.from_index, 9 - req.from_index))
            await bus.publish(reply_to, done(None))

    streams: dict[str, str] = {}
    await bus.subscribe_raw(bus.subjects.worker_submit("wq"), worker)
    mesh = MeshClient(bus, "eq", MeshTimeouts(worker_silence_s=0, request_s=10), predict=False)
    await bus.subscribe(bus.subjects.stream_inbox("eq"), STREAM_EVENT, mesh.streams.on_event)
    got: list[int] = []
    finals: list[RequestDoneEvent] = []

    async def consume() -> None:
        async for ev in mesh.generate("q1", list(range(50)), SamplingParams(max_tokens=9),
                                      tenant="", worker_id="wq"):
            if isinstance(ev, RequestDoneEvent):
                finals.append(ev)
            else:
                assert ev.index == len(got)  # in order, nothing twice
                got.extend(ev.token_ids)

    if resent:
        await consume()
        assert got == list(range(9)) and len(finals) == 1 and finals[0].completion_tokens == 9
    else:  # a retriable error, never a short completion that looks whole
        with pytest.raises(WorkerLost):
            await consume()
        assert got == [0, 1, 2] and not finals
    assert resumes == [3]
