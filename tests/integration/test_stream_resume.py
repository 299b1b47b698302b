"""Streams survive lost events: a worker resends on ResumeRequest, the edge asks for it."""

from __future__ import annotations

import asyncio

import pytest

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.wire import (
    STREAM_EVENT,
    SUBMIT_REPLY,
    GenerateChunkEvent,
    GenerateDoneEvent,
    GenerateRequest,
    ResumeRequest,
    SamplingParams,
)
from prefixmesh.shared.subjects import Subjects
from tests.helpers import eventually, running

pytestmark = pytest.mark.integration


async def test_a_worker_resends_a_stream_nobody_heard(nats_server: str, prefix: str) -> None:
    bus = await Bus.connect(nats_server, Subjects(prefix), "resume-test")
    worker = WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix,
                                        worker_id="wr", load_interval_s=0.05))
    events: list = []

    async def on_event(ev: object) -> None:
        events.append(ev)

    try:
        async with running(worker):
            submit = bus.subjects.worker_submit("wr")
            # The stream goes to an inbox nobody has subscribed to yet: all of it is lost.
            req = GenerateRequest(request_id="r1", token_ids=list(range(200, 280)),
                                  sampling=SamplingParams(max_tokens=12, ignore_eos=True),
                                  reply_to=bus.subjects.stream_reply("late", "r1"))
            assert (await bus.request(submit, req, SUBMIT_REPLY, 5)).accepted
            await eventually(lambda: worker.finished.get("r1") is not None, timeout=10)
            await bus.subscribe(bus.subjects.stream_inbox("late"), STREAM_EVENT, on_event)

            ack = await bus.request(submit, ResumeRequest(request_id="r1", from_index=5),
                                    SUBMIT_REPLY, 5)
            assert ack.accepted
            await eventually(lambda: any(isinstance(e, GenerateDoneEvent) for e in events))
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
    finally:
        await bus.close()
        await asyncio.sleep(0)


async def test_the_edge_recovers_events_it_missed_mid_stream(nats_server: str, prefix: str
                                                             ) -> None:
    """The edge's inbox is gone for a while mid-stream (as in a reconnect window): the next
    chunk shows a gap, the edge asks the worker to resend, and the caller gets every token
    exactly once, in order, then the done event."""
    from prefixmesh.services.edge.pipeline import MeshClient, MeshTimeouts

    bus = await Bus.connect(nats_server, Subjects(prefix), "edge-resume-test")
    worker = WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix,
                                        worker_id="wg", load_interval_s=0.05))
    mesh = MeshClient(bus, "eg", MeshTimeouts(worker_silence_s=0), predict=False)
    inbox = bus.subjects.stream_inbox("eg")
    try:
        async with running(worker):
            sub = await bus.subscribe(inbox, STREAM_EVENT, mesh.streams.on_event)
            sampling = SamplingParams(max_tokens=60, temperature=1.0, top_p=1.0, seed=None, stop=[],
                                ignore_eos=True)
            got: list[int] = []
            done = []
            async for ev in mesh.generate("g1", list(range(300, 364)), sampling, tenant="",
                                          worker_id="wg"):
                if isinstance(ev, GenerateDoneEvent):
                    done.append(ev)
                    continue
                assert ev.index == len(got)  # in order, nothing twice
                got.extend(ev.token_ids)
                if sub is not None and len(got) >= 5:
                    await sub.unsubscribe()  # events published now reach nobody
                    await asyncio.sleep(0.4)
                    await bus.subscribe(inbox, STREAM_EVENT, mesh.streams.on_event)
                    sub = None
            assert len(got) == 60 and len(done) == 1 and done[0].completion_tokens == 60
            assert mesh.resumes >= 1
    finally:
        await bus.close()


async def test_after_a_reconnect_the_edge_fetches_a_lost_ending(nats_server: str, prefix: str
                                                                ) -> None:
    """Everything after the first chunk, done event included, was published while the edge
    was not subscribed. Nothing more arrives, so no gap shows; the edge's reconnect (its
    client's reconnect count) is what makes it ask the worker, which resends the rest."""
    from prefixmesh.services.edge.pipeline import MeshClient, MeshTimeouts

    bus = await Bus.connect(nats_server, Subjects(prefix), "edge-reconnect-test")
    worker = WorkerService(WorkerConfig(nats_url=nats_server, subject_prefix=prefix,
                                        worker_id="wh", load_interval_s=0.05))
    mesh = MeshClient(bus, "eh", MeshTimeouts(worker_silence_s=0, request_s=30), predict=False)
    inbox = bus.subjects.stream_inbox("eh")
    try:
        async with running(worker):
            sub = await bus.subscribe(inbox, STREAM_EVENT, mesh.streams.on_event)
            sampling = SamplingParams(max_tokens=20, temperature=1.0, top_p=1.0, seed=None, stop=[],
                                ignore_eos=True)
            got: list[int] = []
            done = []
            async for ev in mesh.generate("h1", list(range(400, 464)), sampling, tenant="",
                                          worker_id="wh"):
                if isinstance(ev, GenerateDoneEvent):
                    done.append(ev)
                    continue
                assert ev.index == len(got)
                got.extend(ev.token_ids)
                if sub is not None:
                    await sub.unsubscribe()
                    await eventually(lambda: worker.finished.get("h1") is not None)
                    await bus.subscribe(inbox, STREAM_EVENT, mesh.streams.on_event)
                    sub = None
                    bus.nc.stats["reconnects"] += 1  # as the client counts a reconnect
            assert len(got) == 20 and len(done) == 1 and done[0].completion_tokens == 20
            assert mesh.resumes == 1
    finally:
        await bus.close()
