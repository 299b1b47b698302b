"""shared/runtime/lifecycle.py: a TaskSet ends every task it owns, even one that lost a
cancel (as a loop around a redis-py call can, when the cancel lands inside the call)."""

from __future__ import annotations

import asyncio

from prefixmesh.shared.runtime.lifecycle import TaskSet


async def test_aclose_ends_a_task_that_swallowed_its_first_cancel() -> None:
    cancels = 0

    async def loop_that_loses_a_cancel() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise
                # The first cancel is lost, as inside a library call that catches it.

    async def quiet() -> None:
        await asyncio.sleep(3600)

    tasks = TaskSet()
    stubborn = tasks.spawn(loop_that_loses_a_cancel(), "stubborn")
    plain = tasks.spawn(quiet(), "plain")
    await asyncio.sleep(0)  # both running, in their sleeps
    await asyncio.wait_for(tasks.aclose(), timeout=10)
    assert stubborn.cancelled() and plain.cancelled()
    assert cancels == 2
    assert len(tasks) == 0


async def test_a_crashed_task_is_reported_and_aclose_still_returns() -> None:
    crashes: list[BaseException] = []

    async def crash() -> None:
        raise ValueError("boom")

    tasks = TaskSet(on_crash=crashes.append)
    task = tasks.spawn(crash(), "crash")
    await asyncio.wait({task})
    await asyncio.sleep(0)  # the done callback
    assert [type(e) for e in crashes] == [ValueError]
    await asyncio.wait_for(tasks.aclose(), timeout=10)
    assert len(tasks) == 0
