"""CPU time of processes from ``/proc`` (Linux), for benchmarks that report CPU per request:
a figure that other load on a shared machine does not inflate the way it does latency."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when it is gone or unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """CPU seconds each named group of processes (and this one, ``client``) used between
    ``__init__`` and ``read``."""

    def __init__(self, pids: Mapping[str, Iterable[int]]) -> None:
        self.pids = {name: list(ps) for name, ps in pids.items()}
        self._start = self._now()

    def _now(self) -> dict[str, float]:
        out = {name: sum(cpu_seconds(p) for p in ps) for name, ps in self.pids.items()}
        out["client"] = own_cpu_seconds()
        return out

    def read(self) -> dict[str, float]:
        """CPU seconds per group since the meter started."""
        now = self._now()
        return {name: now[name] - self._start[name] for name in now}
