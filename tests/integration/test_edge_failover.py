"""A worker killed mid-request: the edge fails its requests over (docs/design.md section 12).

Two sim workers run as processes (so they can be SIGKILLed); the scheduler and the edge run
in-process. Non-streamed requests complete on the surviving worker; a stream that already
sent tokens ends with an explicit error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import aiohttp
import pytest

from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.service import EdgeService
from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve
from prefixmesh.shared.runtime.servers import ManagedProcess, child_env
from prefixmesh.shared.wire import BUS_EVENT, LoadReportEvent
from tests.helpers import eventually, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LOAD_INTERVAL_S = 0.1
# Long enough that the request is still running when its worker is killed (sim decode
# steps take tens of milliseconds).
MAX_TOKENS = 400


class LoadWatch:
    """The latest load report of every worker, as seen by the test."""

    def __init__(self) -> None:
        self.last: dict[str, LoadReportEvent] = {}

    async def on_event(self, event: object) -> None:
        if isinstance(event, LoadReportEvent):
            self.last[event.worker_id] = event

    def busy(self, since: float) -> list[str]:
        """Workers whose reports from ``since`` (unix seconds) on show work: an older report
        may still count the routability probe's request."""
        return [w for w, r in self.last.items() if r.ts >= since and r.running + r.waiting > 0]


@pytest.fixture
async def mesh(bus: Bus, nats_server: str, redis_server: str, prefix: str, tmp_path):
    """Two sim workers as processes (killable), the scheduler and the edge in-process."""
    workers = {}
    for wid in ("wa", "wb"):
        env = child_env(PM_NATS_URL=nats_server, PM_SUBJECT_PREFIX=prefix, PM_WORKER_ID=wid,
                        PM_LOAD_INTERVAL_S=str(LOAD_INTERVAL_S), PM_METRICS_PORT="0",
                        PM_LOG_LEVEL="WARNING")
        workers[wid] = ManagedProcess(wid, [sys.executable, "-m", "prefixmesh.services.worker"],
                                      env=env,
                                      log_path=tmp_path / f"{wid}.log").start()
    watch = LoadWatch()
    await bus.subscribe(bus.subjects.load_all, BUS_EVENT, watch.on_event)
    sched = SchedulerService(SchedulerConfig(
        nats_url=nats_server, redis_url=redis_server, subject_prefix=prefix, redis_prefix=prefix,
        load_interval_s=LOAD_INTERVAL_S, persist_interval_s=0.5))
    edge_cfg = EdgeConfig(nats_url=nats_server, subject_prefix=prefix, port=0, models=MODEL,
                          batch=False, worker_silence_s=4 * LOAD_INTERVAL_S,
                          request_timeout_s=60)
    try:
        await eventually(lambda: set(watch.last) == {"wa", "wb"}, timeout=30)
        async with running(sched), running(EdgeService(edge_cfg)) as edge, \
                aiohttp.ClientSession() as session:
            await _until_routable(session, edge.url)
            yield edge, session, workers, watch
    finally:
        for p in workers.values():
            p.stop()


async def _until_routable(session: aiohttp.ClientSession, url: str) -> None:
    """Wait until the scheduler has heard from the workers (a tiny request succeeds)."""
    deadline = time.monotonic() + 30
    while True:
        body = {**_body(False, 99), "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status == 200:
                return
            assert time.monotonic() < deadline, await r.text()
        await asyncio.sleep(0.2)


def _body(stream: bool, seed: int) -> dict:
    return {"model": MODEL, "prompt": [100 + seed + i for i in range(48)],
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}


async def _kill_busy(workers: dict[str, ManagedProcess], watch: LoadWatch, sent: float
                     ) -> str:
    """SIGKILL the worker running the request sent at ``sent`` (unix seconds) once it has
    been running a moment."""
    await eventually(lambda: len(watch.busy(sent)) == 1, timeout=10)
    victim = watch.busy(sent)[0]
    await asyncio.sleep(0.5)  # let it stream some tokens first
    workers[victim].signal(signal.SIGKILL)
    return victim


async def test_non_streamed_request_completes_on_another_worker(mesh) -> None:
    edge, session, workers, watch = mesh
    sent = time.time()
    post = asyncio.ensure_future(session.post(edge.url + "/v1/completions",
                                              json=_body(False, 0)))
    victim = await _kill_busy(workers, watch, sent)
    async with await post as r:
        body = await r.json()
    assert r.status == 200, body
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["choices"][0]["finish_reason"] == "length"
    assert edge.mesh.failovers >= 1
    survivor = ({"wa", "wb"} - {victim}).pop()
    assert workers[survivor].alive()


async def test_stream_with_tokens_sent_ends_with_error_event(mesh) -> None:
    edge, session, workers, watch = mesh
    events: list[str] = []
    sent = time.time()
    async with session.post(edge.url + "/v1/completions", json=_body(True, 1)) as r:
        assert r.status == 200
        killer = asyncio.ensure_future(_kill_busy(workers, watch, sent))
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
        await killer
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    texts = [p for p in payloads if "choices" in p]
    errors = [p["error"] for p in payloads if "error" in p]
    assert texts, "tokens were streamed before the kill"
    assert len(errors) == 1 and errors[0]["code"] == "worker_lost", payloads[-3:]
    assert errors[0]["type"] == "service_unavailable"
    assert "error" in payloads[-1]  # nothing after the error but [DONE]


async def test_new_requests_avoid_the_dead_worker(mesh) -> None:
    edge, session, workers, _watch = mesh
    workers["wa"].signal(signal.SIGKILL)
    # Right after the kill the scheduler may still route to wa: the edge must fail over.
    for seed in range(4):
        body = {**_body(False, 10 + seed), "max_tokens": 8}
        async with session.post(edge.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
