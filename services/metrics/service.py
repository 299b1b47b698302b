"""Metrics service: assembles the cluster view from the bus (load reports, completions,
scheduler summaries, batch progress) and serves it as Prometheus ``/metrics``, JSON
``/cluster`` and a live dashboard page (``/``, plain HTML and a small script, no build).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram

from prefixmesh.services.metrics.cluster import ClusterView
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.runtime.config import PORT, CommonConfig, option
from prefixmesh.shared.runtime.lifecycle import TaskSet
from prefixmesh.shared.runtime.metrics import (
    LATENCY_BUCKETS_S,
    health_handler,
    metrics_handler,
)
from prefixmesh.shared.subjects import Subjects
from prefixmesh.shared.wire import (
    BUS_EVENT,
    BatchProgressEvent,
    LoadReportEvent,
    RequestDoneBatch,
    RequestDoneEvent,
    SchedulerStatsEvent,
    done_records,
)

# The dashboard's files (dashboard.html, dashboard.js, dashboard.css).
STATIC_DIR = Path(__file__).with_name("static")

WORKER_RUNNING = Gauge("prefixmesh_worker_running_requests", "running requests", ["worker"])
WORKER_WAITING = Gauge("prefixmesh_worker_waiting_requests", "queued requests", ["worker"])
WORKER_KV_USAGE = Gauge("prefixmesh_worker_kv_usage_ratio", "used KV blocks / total", ["worker"])
WORKER_HIT = Gauge("prefixmesh_worker_cache_hit_ratio", "cached / prompt tokens", ["worker"])
WORKER_DECODE = Gauge("prefixmesh_worker_decode_share_ratio", "decode share of tokens", ["worker"])
WORKER_STEP = Gauge("prefixmesh_worker_avg_step_seconds",
                    "mean engine step duration over the last report window", ["worker"])
WORKER_QUEUE = Gauge("prefixmesh_worker_avg_queue_seconds",
                     "mean queueing time over the last report window", ["worker"])
WORKER_GAUGES = (WORKER_RUNNING, WORKER_WAITING, WORKER_KV_USAGE, WORKER_HIT, WORKER_DECODE,
                 WORKER_STEP, WORKER_QUEUE)
DONE = Counter("prefixmesh_cluster_requests_completed_total", "completed requests", ["worker"])
PROMPT_TOKENS = Counter("prefixmesh_cluster_prompt_tokens_total", "prompt tokens", ["worker"])
CACHED_TOKENS = Counter("prefixmesh_cluster_cached_tokens_total", "cached prompt tokens",
                        ["worker"])
CLUSTER_LATENCY = Histogram("prefixmesh_cluster_request_latency_seconds",
                            "worker-side latency of completed requests", ["tenant"],
                            buckets=LATENCY_BUCKETS_S)
CLUSTER_TTFT = Histogram("prefixmesh_cluster_ttft_seconds",
                         "worker-side time to first token of completed requests", ["tenant"],
                         buckets=LATENCY_BUCKETS_S)
# Tenant label of completions that carry none.
DEFAULT_TENANT_LABEL = "default"

VIEW = web.AppKey("view", ClusterView)


@dataclass(frozen=True)
class MetricsConfig(CommonConfig):
    host: str = option("127.0.0.1", "address of the metrics HTTP server")
    port: int = option(9100, "port of /, /cluster, /metrics and /health (0 = any free port)",
                       bounds=PORT)
    sample_interval_s: float = option(1.0, "period of the dashboard's history points (seconds)")


# The service's routes (each handler names its own); build_app adds them.
ROUTES = web.RouteTableDef()
ROUTES.get("/metrics")(metrics_handler)
ROUTES.get("/health")(health_handler)
ROUTES.static("/static/", STATIC_DIR)


@ROUTES.get("/cluster")
async def cluster_handler(request: web.Request) -> web.Response:
    return web.json_response(request.app[VIEW].snapshot(time.monotonic()),
                             headers={"Cache-Control": "no-store"})


@ROUTES.get("/")
@ROUTES.get("/dashboard")
async def dashboard_handler(_request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "dashboard.html")


def build_app(view: ClusterView) -> web.Application:
    """The metrics service's aiohttp application."""
    app = web.Application()
    app[VIEW] = view
    app.add_routes(ROUTES)
    return app


class MetricsService:
    name = "metrics"

    def __init__(self, cfg: MetricsConfig) -> None:
        self.cfg = cfg
        self.view = ClusterView()
        self.port = cfg.port
        self._subs: list = []
        self._worker_series: dict[str, tuple[Counter, Counter, Counter]] = {}
        self._tenant_series: dict[str, tuple[Histogram, Histogram]] = {}

    async def _on_event(self, ev: object) -> None:
        now = time.monotonic()
        if isinstance(ev, LoadReportEvent):
            self.view.on_load(ev, now)
            w = ev.worker_id
            WORKER_RUNNING.labels(w).set(ev.running)
            WORKER_WAITING.labels(w).set(ev.waiting)
            used = ev.total_blocks - ev.free_blocks
            WORKER_KV_USAGE.labels(w).set(used / ev.total_blocks if ev.total_blocks else 0.0)
            WORKER_HIT.labels(w).set(ev.hit_ratio)
            WORKER_DECODE.labels(w).set(ev.decode_share)
            WORKER_STEP.labels(w).set(ev.avg_step_s)
            WORKER_QUEUE.labels(w).set(ev.avg_queue_s)
        elif isinstance(ev, (RequestDoneEvent, RequestDoneBatch)):
            for done in done_records(ev):
                self._on_done(done, now)
        elif isinstance(ev, SchedulerStatsEvent):
            self.view.on_scheduler(ev, now)
        elif isinstance(ev, BatchProgressEvent):
            self.view.on_batch(ev)

    def _on_done(self, ev: RequestDoneEvent, now: float) -> None:
        self.view.on_done(ev, now)
        # The labelled series, looked up once per worker and tenant (a labels() call is a
        # locked lookup, and there are five per completion).
        w = ev.worker_id
        counters = self._worker_series.get(w)
        if counters is None:
            counters = self._worker_series[w] = (DONE.labels(w), PROMPT_TOKENS.labels(w),
                                                 CACHED_TOKENS.labels(w))
        done, prompt, cached = counters
        done.inc()
        prompt.inc(ev.prompt_tokens)
        cached.inc(ev.cached_tokens)
        tenant = ev.tenant or DEFAULT_TENANT_LABEL
        histograms = self._tenant_series.get(tenant)
        if histograms is None:
            histograms = self._tenant_series[tenant] = (CLUSTER_LATENCY.labels(tenant),
                                                        CLUSTER_TTFT.labels(tenant))
        latency, ttft = histograms
        latency.observe(ev.latency_s)
        ttft.observe(ev.ttft_s)

    async def _sample_loop(self) -> None:
        """History points for the dashboard; workers gone silent leave the view and gauges."""
        while True:
            await asyncio.sleep(self.cfg.sample_interval_s)
            now = time.monotonic()
            for w in self.view.forget_silent(now):
                for gauge in WORKER_GAUGES:
                    gauge.remove(w)
            self.view.sample(now, time.time())

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        bus = await Bus.connect(self.cfg.nats_url, Subjects(self.cfg.subject_prefix), "metrics")
        stack.push_async_callback(bus.close)
        s = bus.subjects
        for subject in (s.load_all, s.done, s.batch_progress, s.sched_stats):
            self._subs.append(await bus.subscribe(subject, BUS_EVENT, self._on_event))
        runner = web.AppRunner(build_app(self.view), access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, self.cfg.host, self.cfg.port).start()
        if runner.addresses:
            self.port = runner.addresses[0][1]
        tasks = await stack.enter_async_context(TaskSet(on_crash=lambda _e: stop.set()))
        tasks.spawn(self._sample_loop(), "metrics-sample")

    async def stop_intake(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()

    async def drain(self) -> None:
        return None
