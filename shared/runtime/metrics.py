"""Prometheus helpers: shared bucket layouts and a tiny aiohttp /metrics endpoint.

Metric objects are defined at module scope in each service (prometheus-client's default
registry), named ``prefixmesh_<service>_<what>_<unit>`` in base units.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

# Seconds, from sub-millisecond decisions to minute-long requests.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


async def metrics_handler(_request: web.Request) -> web.Response:
    """aiohttp handler serving the default registry in Prometheus text format."""
    body = generate_latest(REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def health_handler(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def serve_metrics(stack: AsyncExitStack, port: int, host: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` and ``/health`` on ``port`` until the stack unwinds (0 = off)."""
    if not port:
        return
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/health", health_handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, host, port).start()
