"""What stalls a service's event loop, written down while it runs.

``python loadgen/stalls.py --out FILE [--time MODULE:QUALNAME ...] -- MODULE [ARGS]`` runs
``python -m MODULE ARGS`` (a service: ``prefixmesh.services.scheduler``) and appends one
JSON line to FILE per event of at least ``--min-ms``:

- ``{"what": "gc2", ...}``: a garbage collection of that generation (``gc.callbacks``);
- ``{"what": "loop_lag", ..., "cpu_ms": C}``: a 1 ms sleep of a monitor task that ended
  this much late, with the CPU time the thread ran from the sleep's start to its end: a
  lag of the loop's own work has ``cpu_ms`` about ``ms`` + 1 or more, one spent waiting
  for a core (another process had it) much less;
- ``{"what": QUALNAME, ...}``: a call of a timed function or method (sync or async: for an
  async one, the time includes its awaits).

Each line also has ``t`` (unix seconds at the end) and ``ms``. A ``--time`` target that
does not exist in the code run is skipped with a note on stderr, so the same command
times an older checkout too (run as a file path, this script imports the service from
whatever ``prefixmesh`` comes first on PYTHONPATH). ``summarize`` folds a file into
count, max and total per kind. Diagnostics, not a benchmark: the timing costs a little.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import importlib
import inspect
import json
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

# Seconds the loop monitor sleeps between looks.
MONITOR_SLEEP_S = 0.001
# Shorter events are not written (default of --min-ms).
MIN_MS = 1.0


class Recorder:
    """Appends events of at least ``min_ms`` to an open file."""

    def __init__(self, out: IO[str], min_ms: float) -> None:
        self.out, self.min_ms = out, min_ms

    def record(self, what: str, seconds: float, cpu_s: float | None = None) -> None:
        ms = seconds * 1e3
        if ms >= self.min_ms:
            ev: dict[str, object] = {"t": time.time(), "what": what, "ms": round(ms, 3)}
            if cpu_s is not None:
                ev["cpu_ms"] = round(cpu_s * 1e3, 3)
            # A line at a time, each one write: two processes appending to one file
            # (--stalls: the scheduler and the client) interleave whole lines.
            self.out.write(json.dumps(ev) + "\n")
            self.out.flush()


def timed(rec: Recorder, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with each call's wall time recorded under ``name``."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                rec.record(name, time.perf_counter() - t0)
        return timed_async

    @functools.wraps(fn)
    def timed_sync(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.record(name, time.perf_counter() - t0)
    return timed_sync


def install_timing(rec: Recorder, target: str) -> None:
    """Wrap ``MODULE:QUALNAME`` (a function or a class's method) in place."""
    module_name, _, qualname = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)
    except (ImportError, AttributeError) as exc:
        print(f"stalls: not timing {target}: {exc}", file=sys.stderr)
        return
    setattr(owner, attr, timed(rec, qualname, fn))


def install_gc(rec: Recorder) -> None:
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            rec.record(f"gc{info['generation']}", time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)


async def monitor(rec: Recorder, what: str = "loop_lag") -> None:
    """Record how late 1 ms sleeps end, and the thread's CPU time meanwhile, as long as the
    loop runs."""
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        await asyncio.sleep(MONITOR_SLEEP_S)
        rec.record(what, time.perf_counter() - t0 - MONITOR_SLEEP_S, time.thread_time() - c0)


def install_monitor(rec: Recorder) -> None:
    """Start ``monitor`` beside every service that ``lifecycle.run_service`` runs."""
    from prefixmesh.shared.runtime import lifecycle

    run_service = lifecycle.run_service

    async def run_with_monitor(*args: Any, **kwargs: Any) -> None:
        task = asyncio.create_task(monitor(rec), name="stalls-monitor")
        try:
            await run_service(*args, **kwargs)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    lifecycle.run_service = run_with_monitor


def summarize(path: Path, t_from: float = 0.0, t_to: float = float("inf")
              ) -> dict[str, dict[str, float]]:
    """Per kind of event in a stalls file that ended within [t_from, t_to]: count, longest
    and total milliseconds (and, for loop lags, the total CPU the thread ran in them)."""
    out: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        if not t_from <= ev["t"] <= t_to:
            continue
        s = out.setdefault(ev["what"], {"count": 0, "max_ms": 0.0, "total_ms": 0.0})
        s["count"] += 1
        s["max_ms"] = max(s["max_ms"], ev["ms"])
        s["total_ms"] = round(s["total_ms"] + ev["ms"], 3)
        if "cpu_ms" in ev:
            s["cpu_ms"] = round(s.get("cpu_ms", 0.0) + ev["cpu_ms"], 3)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: stalls.py --out FILE [--time MODULE:QUALNAME ...] -- MODULE "
                         "[ARGS]")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="stalls.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON lines appended here")
    p.add_argument("--time", action="append", default=[], metavar="MODULE:QUALNAME",
                   help="a function or method whose calls are timed (repeatable)")
    p.add_argument("--min-ms", type=float, default=MIN_MS, help="shorter events are not written")
    args = p.parse_args(argv[:split])
    module, *rest = argv[split + 1:]
    out = args.out.open("a")
    rec = Recorder(out, args.min_ms)
    install_gc(rec)
    install_monitor(rec)
    for target in args.time:
        install_timing(rec, target)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # Run as a file, this folder leads sys.path: its modules must not shadow anyone's.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    main()
