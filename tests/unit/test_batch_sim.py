"""The planned-batch mode of the cluster simulator against ordinary traffic."""

from __future__ import annotations

import json

from prefixmesh.loadgen.batch_sim import MODES, compare, main
from prefixmesh.loadgen.workloads import build_workload


def test_planned_batch_runs_everything_on_its_planned_workers() -> None:
    reqs = build_workload("batch", 160, 0)
    out = compare(reqs, 4, list(MODES))
    runs = {r["mode"]: r for r in out["runs"]}
    assert all(r["completed"] == 160 and r["failed"] == 0 for r in runs.values())
    # Behaviour, not speed: the plan keeps every document's group on one worker, so the
    # cache hit ratio reaches the enlarged first-level saving, above round robin's.
    plan = out["plan"]
    assert runs["planned"]["cache_hit_ratio"] >= plan["saving_enlarged_first_level"] - 0.02
    assert runs["planned"]["cache_hit_ratio"] > runs["rr_fcfs"]["cache_hit_ratio"]
    assert plan["saving_naive_first_level"] <= plan["saving_enlarged_first_level"]
    assert plan["saving_enlarged_first_level"] <= plan["saving_multi_level"]
    assert max(runs["planned"]["worker_requests"].values()) < 0.4 * 160


def test_cli_writes_json(tmp_path) -> None:
    out = tmp_path / "b.json"
    assert main(["--count", "40", "--gpus", "2", "--modes", "planned,rr_fcfs",
                 "--prefixes", "4", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["mode"] for r in d["runs"]] == ["planned", "rr_fcfs"]
    assert d["workload"]["prefixes"] == 4
