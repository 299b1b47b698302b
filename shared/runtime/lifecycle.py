"""Service lifecycle: start, run until a signal, shut down in a written-down order.

Shutdown order (every service):
  1. a signal (SIGINT/SIGTERM) sets the stop event;
  2. ``stop_intake()``: stop taking new work (unsubscribe, stop listening);
  3. ``drain()``: finish in-flight work, bounded by ``drain_timeout_s``;
  4. the exit stack unwinds in reverse order of ``start()``: background tasks are
     cancelled, then clients (NATS, Redis) are closed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from typing import Any, Protocol

log = logging.getLogger(__name__)

# How long ``TaskSet.aclose`` waits for cancelled tasks before cancelling again.
CANCEL_RETRY_S = 0.5


class Service(Protocol):
    """What ``run_service`` needs from a service."""

    name: str

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        """Build parts, connect, subscribe; register cleanups on ``stack``. Setting ``stop``
        (e.g. when a background task crashes) shuts the service down."""

    async def stop_intake(self) -> None:
        """Stop accepting new work."""

    async def drain(self) -> None:
        """Return when in-flight work has finished."""


class TaskSet:
    """Owner of background tasks: spawned tasks are cancelled and awaited on ``aclose``.

    A task that crashes is logged and, if ``on_crash`` is set, reported (a service sets
    its stop event there so a dead background loop never goes unnoticed).
    """

    def __init__(self, on_crash: Callable[[BaseException], None] | None = None) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._on_crash = on_crash

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task %s crashed", task.get_name(), exc_info=exc)
            if self._on_crash is not None:
                self._on_crash(exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait_idle(self) -> None:
        """Wait until every task has finished on its own."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def aclose(self) -> None:
        """Cancel every task and wait until all have ended. A cancel can be lost inside a
        library call (a loop cancelled inside a redis-py call while Redis restarted went
        on to its next round), so a task still running ``CANCEL_RETRY_S`` later
        is cancelled again, until it ends."""
        pending = set(self._tasks)
        while pending:
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=CANCEL_RETRY_S)
        self._tasks.clear()

    async def __aenter__(self) -> TaskSet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def run_service(service: Service, stop: asyncio.Event, drain_timeout_s: float,
                      ready: Callable[[], None] | None = None) -> None:
    """Run ``service`` until ``stop`` is set, then shut it down in order."""
    async with AsyncExitStack() as stack:
        await service.start(stack, stop)
        log.info("%s ready", service.name)
        if ready is not None:
            ready()
        await stop.wait()
        log.info("%s stopping", service.name)
        await service.stop_intake()
        try:
            await asyncio.wait_for(service.drain(), drain_timeout_s)
        except TimeoutError:
            log.warning("%s: drain timed out after %.1fs", service.name, drain_timeout_s)
    log.info("%s stopped", service.name)


def install_signal_handlers(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` (once; a second signal is ignored while draining)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


def main(make_service: Callable[[], Service], drain_timeout_s: float) -> None:
    """Process entry point: uvloop, signals, run until stopped."""
    run: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a core dependency
        pass

    async def _amain() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        # Once started, everything built so far (modules, classes, config, a loaded tokenizer
        # or model) lives as long as the process: frozen out of the collector's sight, a
        # full collection scans only what was made since (tens of milliseconds less per
        # such stall of the event loop; measured in docs/benchmarks.md).
        await run_service(make_service(), stop, drain_timeout_s, ready=gc.freeze)

    try:
        run(_amain())
    except KeyboardInterrupt:
        sys.exit(130)
