"""The scheduler's per-decision histogram: the same series prometheus-client's gives."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from prefixmesh.shared.runtime.metrics import DECISION_BUCKETS_S, LoopHistogram


def test_loop_histogram_exports_what_prometheus_client_would() -> None:
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopHistogram("x_seconds", "decision time", DECISION_BUCKETS_S, registry=ours_reg)
    theirs = Histogram("x_seconds", "decision time", buckets=DECISION_BUCKETS_S,
                       registry=theirs_reg)
    # Below the first bound, on bounds (le is inclusive), between them, above the last.
    for v in (0.0, 1e-5, 1.2e-5, 2.5e-5, 3e-4, 0.01, 0.5, 7.0):
        ours.observe(v)
        theirs.observe(v)

    def samples(reg: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value
                for m in reg.collect() for s in m.samples if not s.name.endswith("_created")}

    got, want = samples(ours_reg), samples(theirs_reg)
    assert got == want
    assert got[("x_seconds_bucket", "1e-05")] == 2 and got[("x_seconds_count", "")] == 8
    assert b'x_seconds_bucket{le="+Inf"} 8.0' in generate_latest(ours_reg)
