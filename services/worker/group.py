"""Several sim engines in one worker process (``--worker-ids w0,w1,...``).

A simulated GPU costs the process little but its interpreter costs ~60 MB, so a fleet of
dozens of sim workers on a small machine runs several engines per process. Each engine is
a whole ``WorkerService``: its own worker id, subjects, NATS connection, KV sequence
numbers, load reports and drain; only the event loop, the process and its ``/metrics``
port (the first engine's; every series is labelled by worker) are shared. To the
scheduler and the edges they are indistinguishable from one worker per process.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import AsyncExitStack

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.service import WorkerService


def group_ids(text: str) -> list[str]:
    """The ids of ``--worker-ids`` (comma-separated; duplicates refused)."""
    ids = [w.strip() for w in text.split(",") if w.strip()]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"--worker-ids repeats an id: {text!r}")
    return ids


class WorkerGroup:
    """One ``WorkerService`` per id, started, stopped and drained together."""

    name = "worker-group"

    def __init__(self, cfg: WorkerConfig) -> None:
        if cfg.backend != "sim":
            raise SystemExit("--worker-ids runs sim engines only (a real engine wants a "
                             "process, and a GPU, of its own)")
        if not cfg.mesh or cfg.http_port:
            raise SystemExit("--worker-ids serves the mesh only (no --http / --no-mesh)")
        ids = group_ids(cfg.worker_ids)
        self.members = [
            WorkerService(dataclasses.replace(cfg, worker_id=w, worker_ids="",
                                              metrics_port=cfg.metrics_port if i == 0 else 0))
            for i, w in enumerate(ids)]

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        """Start every engine in turn; each registers its own cleanups on ``stack``."""
        for m in self.members:
            await m.start(stack, stop)

    async def stop_intake(self) -> None:
        """Every engine stops taking submits."""
        for m in self.members:
            await m.stop_intake()

    async def drain(self) -> None:
        """Return once every engine has finished its requests."""
        await asyncio.gather(*(m.drain() for m in self.members))
