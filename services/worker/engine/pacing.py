"""Real-time pacing of the simulated GPU, optionally slowed by a time scale (pure logic).

The sim engine is clock-agnostic; the worker drives it on a *model clock*:
``model seconds = wall seconds / scale``. With ``scale`` K > 1 every modelled step lasts K
times its modelled duration in wall time, so a machine too small to drive a cluster in real
time can drive it K times slower. Everything the engine measures (queue, TTFT, step times in
its load reports) stays in model seconds, as on the modelled hardware; a client that offers
rate r / K and divides its latencies by K sees the figures of rate r at full speed, except
that the overheads outside the engine (HTTP, routers, the bus) shrink K times too.

``Pacer`` also keeps the *step lag*: how much later than planned each step's sleep ended
(wall seconds). A CPU-starved worker wakes late, and since the next step starts when the
previous one really ended, the lag stretches the simulated GPU's time: ``lag_ratio`` (lag
over the planned wall time of the steps) is the fraction by which it ran slower than the
model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class StepLag:
    """Lateness of the steps since the last reset (wall seconds)."""

    steps: int = 0
    planned_s: float = 0.0  # wall time the steps should have taken
    lag_s: float = 0.0  # total lateness of their ends
    max_lag_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """JSON shape served by the worker's ``/server_info`` (``step_lag``)."""
        return {"steps": self.steps, "planned_s": self.planned_s, "lag_s": self.lag_s,
                "max_lag_s": self.max_lag_s,
                "lag_ratio": self.lag_s / self.planned_s if self.planned_s > 0 else 0.0}


class Pacer:
    """The engine's model clock and the wall-time sleeps of its steps."""

    def __init__(self, scale: float = 1.0,
                 wall: Callable[[], float] = time.monotonic) -> None:
        if not scale > 0:
            raise ValueError("time scale must be positive")
        self.scale = scale
        self.wall = wall
        self.lag = StepLag()

    def now(self) -> float:
        """Model seconds (monotonic)."""
        return self.wall() / self.scale

    def sleep_for(self, model_deadline: float) -> float:
        """Wall seconds to sleep until the model clock reads ``model_deadline`` (>= 0)."""
        return max(model_deadline * self.scale - self.wall(), 0.0)

    def woke(self, model_deadline: float, model_duration: float) -> None:
        """Record a step, planned to last ``model_duration`` and end at ``model_deadline``,
        whose sleep has just ended."""
        late = max(self.wall() - model_deadline * self.scale, 0.0)
        lag = self.lag
        lag.steps += 1
        lag.planned_s += model_duration * self.scale
        lag.lag_s += late
        if late > lag.max_lag_s:
            lag.max_lag_s = late

    def reset_lag(self) -> None:
        """Start counting step lag afresh (e.g. at the start of a benchmark point)."""
        self.lag = StepLag()
