"""Arrival processes: send times (seconds from start, non-decreasing) for a request stream.

- ``poisson``: exponential gaps at a rate.
- ``azure``: the Azure LLM inference trace (2023, one hour; ``code`` 8,819 requests,
  ``conv`` 19,366) replayed: its timestamps relative to a starting row, times a scale.
- ``bursts``: groups of requests arriving together, the groups themselves Poisson.
- ``arrival_times``: one of them by name, at a given mean rate (the CLI's ``--arrivals``).
"""

from __future__ import annotations

import datetime as dt
import functools
import random
from pathlib import Path

from prefixmesh.loadgen.data import data_dir, data_file

AZURE_KINDS = ("code", "conv")
ARRIVAL_SPECS = ("poisson", "azure-code", "azure-conv", "burst")
# Requests per burst and the window a burst spreads over, by default.
DEFAULT_BURST_SIZE = 16
DEFAULT_BURST_WIDTH_S = 0.5
# The trace's timestamps have 7 fractional digits: 100 ns ticks.
TICKS_PER_S = 10_000_000


def poisson(rate: float, count: int, seed: int = 0) -> list[float]:
    """``count`` arrival times of a Poisson process at ``rate`` requests per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def azure_timestamps(kind: str) -> list[float]:
    """The trace's request times in seconds since its first request (sorted)."""
    return list(_trace(kind))


def _trace(kind: str) -> tuple[float, ...]:
    if kind not in AZURE_KINDS:
        raise ValueError(f"azure trace kind must be one of {AZURE_KINDS}, got {kind!r}")
    return _azure(data_dir(), kind)


@functools.cache
def _azure(folder: Path, kind: str) -> tuple[float, ...]:
    path = data_file("azure", f"AzureLLMInferenceTrace_{kind}.csv")
    # "TIMESTAMP,ContextTokens,GeneratedTokens"; stamps like 2023-11-16 18:17:03.9799600
    # (7 fractional digits, which datetime.fromisoformat does not take); no final newline.
    lines = path.read_text(encoding="utf-8").splitlines()
    ticks: list[int] = []  # integer 100 ns ticks: exact, whatever the epoch
    for line in lines[1:]:
        if not line.strip():
            continue
        day, clock = line.split(",", 1)[0].split(" ")
        hh, mm, ss = clock.split(":")
        whole, _, frac = ss.partition(".")
        seconds = (dt.date.fromisoformat(day).toordinal() * 86400 + int(hh) * 3600
                   + int(mm) * 60 + int(whole))
        ticks.append(seconds * TICKS_PER_S + int((frac + "0" * 7)[:7]))
    if not ticks:
        raise ValueError(f"no rows in {path}")
    ticks.sort()
    first = ticks[0]
    return tuple((t - first) / TICKS_PER_S for t in ticks)


def azure(kind: str, count: int, time_scale: float = 1.0, start: int = 0) -> list[float]:
    """``count`` arrival times replaying the Azure ``kind`` trace from row ``start``.

    Times are the trace's, relative to row ``start``, multiplied by ``time_scale`` (2.0 is
    half the trace's rate, 0.5 twice it). Past the trace's end it wraps around to its
    first row, one mean gap after the last.
    """
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    trace = _trace(kind)
    n = len(trace)
    if not 0 <= start < n:
        raise ValueError(f"start must be in [0, {n})")
    # One lap of the trace: its span plus a mean gap, so a wrap keeps the average rate.
    lap = trace[-1] + (trace[-1] / (n - 1) if n > 1 else 1.0)
    origin = trace[start]
    out = []
    for i in range(count):
        laps, row = divmod(start + i, n)
        out.append((trace[row] + laps * lap - origin) * time_scale)
    return out


def azure_rate(kind: str) -> float:
    """Mean request rate of the trace (requests per second over its span)."""
    trace = _trace(kind)
    return (len(trace) - 1) / trace[-1]


def bursts(rate: float, count: int, seed: int = 0, size: int = DEFAULT_BURST_SIZE,
           width_s: float = DEFAULT_BURST_WIDTH_S) -> list[float]:
    """``count`` arrivals in bursts of ``size`` requests, at a mean ``rate`` per second.

    Burst starts are a Poisson process at ``rate / size``; a burst's requests arrive
    uniformly within ``width_s`` seconds of its start (0: all at once).
    """
    if rate <= 0 or size < 1 or width_s < 0:
        raise ValueError("rate must be positive, size >= 1 and width_s >= 0")
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while len(out) < count:
        t += rng.expovariate(rate / size)
        n = min(size, count - len(out))
        out.extend(sorted(t + rng.uniform(0.0, width_s) for _ in range(n)))
    # Bursts may overlap when width_s exceeds a gap: keep times non-decreasing.
    out.sort()
    return out


def arrival_times(spec: str, rate: float | None, count: int, seed: int = 0) -> list[float]:
    """Arrival times by name: ``poisson`` | ``azure-code`` | ``azure-conv`` | ``burst``.

    ``rate`` is the mean requests per second; for the Azure traces it sets the time scale
    (trace rate / rate), and None or 0 replays the trace at its own pace. ``burst`` may
    name its size, ``burst:32``. For the traces, ``seed`` picks the starting row.
    """
    name, _, arg = spec.partition(":")
    if name == "poisson":
        return poisson(_need_rate(rate, spec), count, seed)
    if name == "burst":
        size = int(arg) if arg else DEFAULT_BURST_SIZE
        return bursts(_need_rate(rate, spec), count, seed, size=size)
    if name in ("azure-code", "azure-conv"):
        kind = name.removeprefix("azure-")
        scale = azure_rate(kind) / rate if rate else 1.0
        start = random.Random(seed).randrange(len(_trace(kind))) if seed else 0
        return azure(kind, count, time_scale=scale, start=start)
    raise ValueError(f"unknown arrival process {spec!r}; one of {', '.join(ARRIVAL_SPECS)}")


def _need_rate(rate: float | None, spec: str) -> float:
    if rate is None or rate <= 0:
        raise ValueError(f"arrival process {spec!r} needs a positive rate")
    return rate
