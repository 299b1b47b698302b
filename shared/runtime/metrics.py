"""Prometheus helpers: shared bucket layouts and a tiny aiohttp /metrics endpoint.

Metric objects are defined at module scope in each service (prometheus-client's default
registry), named ``prefixmesh_<service>_<what>_<unit>`` in base units.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack
from itertools import accumulate

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

# Seconds, from sub-millisecond decisions to minute-long requests.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# Seconds of a scheduler's decision: tens of microseconds, milliseconds when it stalls
# (bounds past 10 ms so that the slow-decisions alert's p99 > 10 ms can show).
DECISION_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
                      0.025, 0.1, 1.0)


class LoopHistogram:
    """A histogram observed from one event loop's thread only, for a per-decision hot
    path: ``observe`` is a bisect and two additions (prometheus-client's ``Histogram``
    takes a lock and walks every bucket, several times as long). Exported as the same
    ``_bucket`` / ``_count`` / ``_sum`` series by a collector on ``registry``; a scrape
    served on the same loop sees consistent counts."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket le=b holds value <= b
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        les = [floatToGoString(b) for b in self.bounds] + [floatToGoString(math.inf)]
        yield HistogramMetricFamily(self.name, self.documentation,
                                    buckets=list(zip(les, accumulate(self.counts))),
                                    sum_value=self.sum)


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
