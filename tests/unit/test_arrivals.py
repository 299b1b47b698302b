"""Arrival processes: Poisson, Azure trace replay, bursts, and the name dispatcher."""

from __future__ import annotations

from decimal import Decimal

import pytest

from prefixmesh.loadgen.arrivals import (
    arrival_times,
    azure,
    azure_rate,
    azure_timestamps,
    bursts,
    poisson,
)
from prefixmesh.loadgen.data import ENV_VAR, DataMissing, data_file


def _first_rows(kind: str, n: int) -> list[Decimal]:
    """The trace's first ``n`` timestamps as exact seconds of the day, parsed independently."""
    with open(data_file("azure", f"AzureLLMInferenceTrace_{kind}.csv")) as f:
        next(f)
        out = []
        for _ in range(n):
            clock = next(f).split(",")[0].split(" ")[1]
            h, m, s = clock.split(":")
            out.append(Decimal(h) * 3600 + Decimal(m) * 60 + Decimal(s))
    return out


def test_poisson_mean_rate_and_seed() -> None:
    times = poisson(5.0, 20_000, seed=1)
    assert times == poisson(5.0, 20_000, seed=1) != poisson(5.0, 20_000, seed=2)
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert len(times) / times[-1] == pytest.approx(5.0, rel=0.03)
    with pytest.raises(ValueError):
        poisson(0, 3)


@pytest.mark.parametrize("kind", ["code", "conv"])
def test_azure_replays_relative_times_scaled(kind: str) -> None:
    rows = _first_rows(kind, 50)
    start = 7
    got = azure(kind, 40, time_scale=2.5, start=start)
    want = [float((rows[start + i] - rows[start]) * Decimal("2.5")) for i in range(40)]
    assert got == pytest.approx(want, abs=1e-9)
    assert azure(kind, 5) == pytest.approx([float(r - rows[0]) for r in rows[:5]], abs=1e-9)


def test_azure_trace_shape_and_wrap() -> None:
    trace = azure_timestamps("code")
    assert len(trace) == 8_819 and trace[0] == 0.0
    assert all(b >= a for a, b in zip(trace, trace[1:]))
    assert 3_000 < trace[-1] < 3_700  # one hour
    times = azure("code", len(trace) + 10)
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert times[len(trace)] > times[len(trace) - 1]  # wrapped, one mean gap later


def test_arrival_times_dispatch() -> None:
    n = len(azure_timestamps("conv"))
    times = arrival_times("azure-conv", 20.0, n, seed=0)
    assert (n - 1) / times[-1] == pytest.approx(20.0)  # scaled to the asked mean rate
    native = arrival_times("azure-conv", None, 10)
    assert native == azure("conv", 10)
    assert azure_rate("conv") == pytest.approx((n - 1) / azure_timestamps("conv")[-1])
    assert arrival_times("poisson", 4.0, 100, seed=3) == poisson(4.0, 100, seed=3)
    assert arrival_times("burst:4", 4.0, 100, seed=3) == bursts(4.0, 100, seed=3, size=4)
    assert arrival_times("azure-code", 1.0, 5, seed=9)[0] == 0.0
    with pytest.raises(ValueError, match="unknown arrival"):
        arrival_times("uniform", 1.0, 5)
    with pytest.raises(ValueError, match="positive rate"):
        arrival_times("poisson", None, 5)


def test_bursts_come_in_groups_at_the_mean_rate() -> None:
    times = bursts(10.0, 16_000, seed=0, size=16, width_s=0.0)
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert len(set(times)) == 1_000  # bursts of 16 identical times
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.1)


def test_missing_trace_names_the_path(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(DataMissing, match="AzureLLMInferenceTrace_code.csv"):
        azure("code", 3)
