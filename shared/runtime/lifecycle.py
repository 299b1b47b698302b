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
# Collections of the middle generation between two full ones in a started service
# (``settle_gc``; CPython's default is 10).
FULL_GC_AFTER = 100

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


def settle_gc() -> None:
    """Once a service has started: everything built so far (modules, classes, config, a
    loaded tokenizer or model) lives as long as the process, so it is frozen out of the
    collector's sight and a full collection scans only what was made since (tens of
    milliseconds less per such stall of the event loop). Full collections then come at
    most once every ``FULL_GC_AFTER`` collections of the middle generation: CPython runs
    one after 10 of those once the objects promoted since the last full one exceed a
    quarter of those it kept, and after the freeze that is a few hundred, so it ran at
    every tenth, several times a second in a busy scheduler, each walking every container
    built since (its LRU orders and load window: milliseconds). Both measured in
    docs/benchmarks.md."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_GC_AFTER)


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
        await run_service(make_service(), stop, drain_timeout_s, ready=settle_gc)

    try:
        run(_amain())
    except KeyboardInterrupt:
        sys.exit(130)
