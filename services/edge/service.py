"""The edge service: HTTP API + the mesh client, with an ordered shutdown."""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import AsyncExitStack

from aiohttp import web

from services.edge.app import build_app
from services.edge.config import EdgeConfig
from services.edge.pipeline import MeshClient, MeshTimeouts
from shared.bus import Bus
from shared.messages import STREAM_EVENT
from shared.subjects import Subjects

log = logging.getLogger(__name__)

# How often drain() checks whether in-flight requests have finished (seconds).
DRAIN_POLL_S = 0.05


class EdgeService:
    """HTTP in, NATS out. ``port`` holds the bound port once started."""

    name = "edge"

    def __init__(self, cfg: EdgeConfig) -> None:
        self.cfg = cfg
        self.edge_id = cfg.edge_id or uuid.uuid4().hex[:12]
        self.port = cfg.port
        self.mesh: MeshClient | None = None
        self._site: web.TCPSite | None = None
        self._inbox = None

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
                                request_s=self.cfg.request_timeout_s)
        self.mesh = MeshClient(bus, self.edge_id, timeouts, self.cfg.predict)
        self._inbox = await bus.subscribe(bus.subjects.stream_inbox(self.edge_id), STREAM_EVENT,
                                          self.mesh.streams.on_event)
        app = build_app(self.cfg, self.mesh)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        self._site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
        await self._site.start()
        if runner.addresses:
            self.port = runner.addresses[0][1]
        log.info("edge %s listening on %s", self.edge_id, self.url)
        print(f"prefixmesh edge listening on {self.url}", flush=True)

    async def stop_intake(self) -> None:
        if self._site is not None:
            # Stop accepting connections; requests already in flight keep their streams.
            await self._site.stop()
            self._site = None

    async def drain(self) -> None:
        while self.mesh is not None and len(self.mesh.streams):
            await asyncio.sleep(DRAIN_POLL_S)
