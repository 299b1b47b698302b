"""The guidellm cross-check client: its data file and its report turned into a result row
(loadgen/guidellm_client.py); guidellm itself is not needed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from prefixmesh.loadgen.guidellm_client import (
    export_requests,
    guidellm_argv,
    row_from_report,
)
from prefixmesh.loadgen.options import WorkloadSpec, add_workload_args
from prefixmesh.loadgen.results import to_model_time


def _spec() -> WorkloadSpec:
    p = argparse.ArgumentParser()
    add_workload_args(p)
    return WorkloadSpec.from_args(p.parse_args(["--workload", "toolbench", "--zipf", "1.1"]))


def test_export_writes_the_bench_requests_as_text(tmp_path: Path) -> None:
    spec = _spec()
    path = tmp_path / "data.jsonl"
    export_requests(spec, 5, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    reqs = spec.requests(5)
    assert len(rows) == 5
    assert [r["output_tokens_count"] for r in rows] == [q.max_tokens for q in reqs]
    assert all(isinstance(r["prompt"], str) and r["prompt"] for r in rows)


def test_argv_names_rate_count_and_a_local_tokenizer(tmp_path: Path) -> None:
    argv = guidellm_argv("guidellm", "http://h:1", "m", tmp_path / "d.jsonl", 2.5, 40,
                         tmp_path / "o.json")
    text = " ".join(argv)
    assert "kind=poisson,rate=2.5" in text and "kind=max_requests,count=40" in text
    tok = next(a for a in argv if a.startswith("kind=huggingface_auto"))
    assert (Path(tok.split("model=", 1)[1]) / "tokenizer.json").exists()


def _metric(mean: float, median: float, p90: float, p99: float) -> dict:
    return {"successful": {"mean": mean, "median": median,
                           "percentiles": {"p90": p90, "p99": p99}}}


def test_report_becomes_a_model_time_row() -> None:
    bench = {
        "duration": 20.0,
        "metrics": {
            "request_totals": {"successful": 3, "errored": 1, "incomplete": 0, "total": 4},
            "request_latency": _metric(4.0, 3.6, 6.0, 8.0),
            "time_to_first_token_ms": _metric(400.0, 300.0, 700.0, 900.0),
            "inter_token_latency_ms": _metric(100.0, 100.0, 100.0, 100.0),
        },
        "requests": {"successful": [
            {"request_start_time": 10.0, "prompt_tokens": 100, "cached_tokens": 50},
            {"request_start_time": 12.0, "prompt_tokens": 100, "cached_tokens": 0},
            {"request_start_time": 14.0, "prompt_tokens": 200, "cached_tokens": 150},
        ]},
    }
    row = row_from_report(bench, {"policy": "x (guidellm)"})
    assert row["completed"] == 3 and row["failed"] == 1 and row["requests"] == 4
    assert row["latency_avg_s"] == 4.0 and row["latency_p99_s"] == 8.0
    assert row["ttft_avg_s"] == pytest.approx(0.4) and row["tpot_avg_s"] == pytest.approx(0.1)
    assert row["throughput_rps"] == pytest.approx(0.15)
    assert row["cache_hit_ratio"] == pytest.approx(0.5)
    assert row["sent_rps_wall"] == pytest.approx(0.5)  # 2 gaps over 4 s
    model = to_model_time(row, 4.0)
    assert model["latency_p50_s"] == pytest.approx(0.9) and model["throughput_rps"] == 0.6
    assert model["sent_rps_wall"] == row["sent_rps_wall"]
