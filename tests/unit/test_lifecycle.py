"""shared/runtime/lifecycle.py: a TaskSet ends every task it owns, even one that lost a
cancel (as a loop around a redis-py call can, when the cancel lands inside the call); a
started service's garbage collector settles (frozen start-up, rare full collections)."""

from __future__ import annotations

import asyncio
import gc

from prefixmesh.shared.runtime.lifecycle import FULL_GC_AFTER, TaskSet, settle_gc


def _collections_while_keeping(objects: int) -> list[int]:
    """The generations the collector ran while ``objects`` small lists were made and
    kept (each survives, so each collection promotes)."""
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        kept = [[i] for i in range(objects)]
    finally:
        gc.callbacks.remove(record)
    del kept
    return seen


def test_settle_gc_freezes_start_up_and_spaces_full_collections() -> None:
    saved = gc.get_threshold()
    try:
        gc.collect()
        gc.freeze()
        before = _collections_while_keeping(300_000)
        gc.unfreeze()
        gc.collect()
        settle_gc()
        assert gc.get_freeze_count() > 0  # what was there is out of the collector's sight
        after = _collections_while_keeping(300_000)
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)
    # With CPython's rule, a freeze leaves so little in the oldest generation that every
    # tenth middle collection is a full one; settled, at most one in FULL_GC_AFTER.
    assert before.count(1) >= 20 and before.count(2) >= before.count(1) // 10 - 1
    assert after.count(1) >= 20
    assert after.count(2) <= after.count(1) // FULL_GC_AFTER + 1


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
