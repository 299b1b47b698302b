"""Metrics service: listens to load reports and completions, serves /metrics and /cluster."""

from __future__ import annotations

import time
import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import Counter, Gauge

from services.metrics.cluster import ClusterView
from shared.bus import Bus
from shared.config import CommonConfig, option
from shared.messages import BUS_EVENT, BatchProgressEvent, LoadReportEvent, RequestDoneEvent
from shared.metrics import health_handler, metrics_handler
from shared.subjects import Subjects

WORKER_RUNNING = Gauge("prefixmesh_worker_running_requests", "running requests", ["worker"])
WORKER_WAITING = Gauge("prefixmesh_worker_waiting_requests", "queued requests", ["worker"])
WORKER_KV_USAGE = Gauge("prefixmesh_worker_kv_usage_ratio", "used KV blocks / total", ["worker"])
WORKER_HIT = Gauge("prefixmesh_worker_cache_hit_ratio", "cached / prompt tokens", ["worker"])
WORKER_DECODE = Gauge("prefixmesh_worker_decode_share_ratio", "decode share of tokens", ["worker"])
DONE = Counter("prefixmesh_cluster_requests_completed_total", "completed requests", ["worker"])
PROMPT_TOKENS = Counter("prefixmesh_cluster_prompt_tokens_total", "prompt tokens", ["worker"])
CACHED_TOKENS = Counter("prefixmesh_cluster_cached_tokens_total", "cached prompt tokens",
                        ["worker"])

VIEW = web.AppKey("view", ClusterView)


@dataclass(frozen=True)
class MetricsConfig(CommonConfig):
    host: str = option("127.0.0.1", "address of the metrics HTTP server")
    port: int = option(9100, "port of /metrics, /cluster and /health (0 = any free port)")


async def cluster_handler(request: web.Request) -> web.Response:
    return web.json_response(request.app[VIEW].snapshot(time.monotonic()))


class MetricsService:
    name = "metrics"

    def __init__(self, cfg: MetricsConfig) -> None:
        self.cfg = cfg
        self.view = ClusterView()
        self.port = cfg.port
        self._subs: list = []

    async def _on_event(self, ev: object) -> None:
        if isinstance(ev, LoadReportEvent):
            self.view.on_load(ev, time.monotonic())
            w = ev.worker_id
            WORKER_RUNNING.labels(w).set(ev.running)
            WORKER_WAITING.labels(w).set(ev.waiting)
            used = ev.total_blocks - ev.free_blocks
            WORKER_KV_USAGE.labels(w).set(used / ev.total_blocks if ev.total_blocks else 0.0)
            WORKER_HIT.labels(w).set(ev.hit_ratio)
            WORKER_DECODE.labels(w).set(ev.decode_share)
        elif isinstance(ev, RequestDoneEvent):
            self.view.on_done(ev)
            DONE.labels(ev.worker_id).inc()
            PROMPT_TOKENS.labels(ev.worker_id).inc(ev.prompt_tokens)
            CACHED_TOKENS.labels(ev.worker_id).inc(ev.cached_tokens)
        elif isinstance(ev, BatchProgressEvent):
            self.view.on_batch(ev)

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        bus = await Bus.connect(self.cfg.nats_url, Subjects(self.cfg.subject_prefix), "metrics")
        stack.push_async_callback(bus.close)
        for subject in (bus.subjects.load_all, bus.subjects.done, bus.subjects.batch_progress):
            self._subs.append(await bus.subscribe(subject, BUS_EVENT, self._on_event))
        app = web.Application()
        app[VIEW] = self.view
        app.router.add_get("/metrics", metrics_handler)
        app.router.add_get("/cluster", cluster_handler)
        app.router.add_get("/health", health_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, self.cfg.host, self.cfg.port).start()
        if runner.addresses:
            self.port = runner.addresses[0][1]

    async def stop_intake(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()

    async def drain(self) -> None:
        return None
