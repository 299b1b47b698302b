"""Test helpers: run a service in-process with its real lifecycle."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from prefixmesh.shared.runtime.lifecycle import Service, run_service

START_TIMEOUT_S = 30.0
# Set by ``pytest --require-extras`` (tests/conftest.py; ``make test`` passes it).
REQUIRE_EXTRAS_ENV = "PREFIXMESH_REQUIRE_EXTRAS"


def need(extra: str, *modules: str) -> None:
    """Skip the calling test module when a module of an optional extra is missing; under
    ``--require-extras`` (where every extra is installed) fail it instead."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    why = f"{', '.join(missing)} not installed (pip install '.[{extra}]')"
    if os.environ.get(REQUIRE_EXTRAS_ENV):
        raise ImportError(f"--require-extras: {why}")
    pytest.skip(why, allow_module_level=True)


@asynccontextmanager
async def running(service: Service, drain_timeout_s: float = 5.0) -> AsyncIterator[Service]:
    """Start ``service`` as ``python -m`` would, yield it ready, then shut it down in order."""
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(run_service(service, stop, drain_timeout_s, ready=ready.set))
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=START_TIMEOUT_S,
                                 return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        waiter.cancel()
        task.result()  # raises the start failure
        raise RuntimeError(f"{service.name} stopped during start")
    if waiter not in done:
        waiter.cancel()
        stop.set()
        await task
        raise TimeoutError(f"{service.name} not ready in {START_TIMEOUT_S}s")
    try:
        yield service
    finally:
        stop.set()
        await task


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.05) -> None:
    """Wait until ``predicate()`` is true; fail the test on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)
