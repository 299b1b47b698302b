"""loadgen/stalls.py: what it writes down of a service's stalls, and how it sums them."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

from prefixmesh.loadgen.stalls import Recorder, monitor, summarize, timed


def _events(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_timed_calls_are_written_when_they_last_long_enough() -> None:
    out = io.StringIO()
    rec = Recorder(out, min_ms=5.0)
    quick = timed(rec, "quick", lambda: None)
    slow = timed(rec, "slow", lambda: time.sleep(0.01))
    quick()
    slow()
    assert [e["what"] for e in _events(out)] == ["slow"]
    assert _events(out)[0]["ms"] >= 10.0


def test_an_async_call_is_timed_to_its_end() -> None:
    out = io.StringIO()

    async def waits() -> str:
        await asyncio.sleep(0.01)
        return "done"

    assert asyncio.run(timed(Recorder(out, min_ms=5.0), "waits", waits)()) == "done"
    assert [e["what"] for e in _events(out)] == ["waits"]


def test_summarize_folds_the_events_of_a_window_by_kind(tmp_path: Path) -> None:
    path = tmp_path / "stalls.jsonl"
    lines = [{"t": 1.0, "what": "gc2", "ms": 50.0}, {"t": 2.0, "what": "gc2", "ms": 10.0},
             {"t": 2.5, "what": "loop_lag", "ms": 3.0}, {"t": 9.0, "what": "gc2", "ms": 99.0}]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert summarize(path, 0.0, 5.0) == {
        "gc2": {"count": 2, "max_ms": 50.0, "total_ms": 60.0},
        "loop_lag": {"count": 1, "max_ms": 3.0, "total_ms": 3.0}}


def test_a_loop_lag_says_whether_the_thread_ran_or_waited() -> None:
    """A lag of the loop's own work carries its CPU time; one in which the thread did not
    run (here it sleeps, as a process waiting for a core would not run) carries little."""
    out = io.StringIO()

    async def stall() -> None:
        task = asyncio.create_task(monitor(Recorder(out, min_ms=5.0)))
        await asyncio.sleep(0.005)  # the monitor is asleep in its 1 ms wait
        spin_until = time.thread_time() + 0.02
        while time.thread_time() < spin_until:  # 20 ms of this thread's CPU
            pass
        await asyncio.sleep(0.005)
        time.sleep(0.02)  # 20 ms off the CPU
        await asyncio.sleep(0.005)
        task.cancel()

    asyncio.run(stall())
    lags = _events(out)  # a loaded machine may add lags of its own
    assert {e["what"] for e in lags} == {"loop_lag"}
    assert any(e["ms"] >= 15.0 and e["cpu_ms"] >= 20.0 for e in lags)  # the spin
    assert any(e["ms"] >= 15.0 and e["cpu_ms"] < 10.0 for e in lags)  # the sleep


def test_summarize_adds_up_the_cpu_run_in_loop_lags(tmp_path: Path) -> None:
    path = tmp_path / "stalls.jsonl"
    lines = [{"t": 1.0, "what": "client_loop_lag", "ms": 4.0, "cpu_ms": 0.3},
             {"t": 2.0, "what": "client_loop_lag", "ms": 2.0, "cpu_ms": 3.1}]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert summarize(path) == {
        "client_loop_lag": {"count": 2, "max_ms": 4.0, "total_ms": 6.0, "cpu_ms": 3.4}}
