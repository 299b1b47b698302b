"""loadgen/stalls.py: what it writes down of a service's stalls, and how it sums them."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

from prefixmesh.loadgen.stalls import Recorder, summarize, timed


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
