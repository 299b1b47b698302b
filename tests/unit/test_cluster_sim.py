"""The virtual-time cluster simulator and the report writer."""

from __future__ import annotations

import json

import pytest

from prefixmesh.loadgen.cluster_sim import ClusterConfig, ClusterSim
from prefixmesh.loadgen.policy_variants import (
    parse_local_variant,
    parse_variant,
    split_variants,
)
from prefixmesh.loadgen.report import load_runs, markdown
from prefixmesh.loadgen.report import main as report_main
from prefixmesh.loadgen.results import RequestResult, summarize
from prefixmesh.loadgen.sweep import main as sim_main
from prefixmesh.loadgen.workloads import WorkloadRequest
from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.worker.engine.types import SimEngineConfig
from tests.helpers import shared_prefix_requests

SCHEMA = {"policy", "local_policy", "workload", "rate", "gpus", "backend", "requests",
          "completed", "failed", "latency_avg_s", "latency_p50_s", "latency_p90_s",
          "latency_p99_s", "ttft_avg_s", "ttft_p99_s", "tpot_avg_s", "throughput_rps",
          "cache_hit_ratio"}


_shared_prefix_requests = shared_prefix_requests


def _run(policy: str, reqs, gap: float = 0.05, gpus: int = 4):
    arrivals = [i * gap for i in range(len(reqs))]
    return ClusterSim(ClusterConfig(gpus=gpus, policy=policy)).run(reqs, arrivals)


def test_every_request_completes_with_its_output_length() -> None:
    reqs = _shared_prefix_requests(40)
    run = _run("round_robin", reqs)
    assert all(r.ok for r in run.results)
    assert {r.output_tokens for r in run.results} == {8}
    assert all(r.latency_s >= r.ttft_s > 0 for r in run.results)


def test_e2_keeps_shared_documents_cached_where_round_robin_scatters_them() -> None:
    reqs = _shared_prefix_requests(80, docs=3)  # 3 documents cycling over 4 workers
    rr = summarize(_run("round_robin", reqs).results, 1.0)
    e2 = summarize(_run("e2", reqs).results, 1.0)
    # e2 prefills each document once; round robin once per worker it lands on.
    assert e2["cache_hit_ratio"] > rr["cache_hit_ratio"]
    assert e2["latency_avg_s"] < rr["latency_avg_s"]


def test_runs_are_deterministic() -> None:
    reqs = _shared_prefix_requests(30)
    a = [r.latency_s for r in _run("e2", reqs).results]
    b = [r.latency_s for r in _run("e2", reqs).results]
    assert a == b


def test_sim_verb_writes_the_result_schema_and_report_reads_it(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    assert sim_main(["--gpus", "2", "--workload", "toolbench", "--rates", "4,8",
                     "--policies", "round_robin,e2", "--duration", "5", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 4
    assert all(SCHEMA <= set(r) for r in runs)
    assert all(r["completed"] + r["failed"] == r["requests"] for r in runs)
    assert "| e2 |" in markdown(load_runs([out]))
    assert report_main([str(out), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep.png").stat().st_size > 1000
    assert "toolbench, 2 GPUs" in (tmp_path / "rep.md").read_text()


def test_report_rejects_files_that_are_not_results(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="runs"):
        report_main([str(bad)])


def test_policy_variants_parse_knobs_into_policy_config() -> None:
    v = parse_variant("e2:th_bal=inf,imbalance_ratio=1.1,replicate_max_workers=1")
    assert v.policy == "e2"
    assert v.label == "e2:th_bal=inf,imbalance_ratio=1.1,replicate_max_workers=1"
    assert v.config.th_bal == float("inf") and v.config.imbalance_ratio == 1.1
    assert v.config.replicate_max_workers == 1
    assert v.config.window_s == PolicyConfig().window_s  # untouched knobs keep defaults
    assert parse_variant("kv_cost:kv_use_events=false").config.kv_use_events is False
    assert parse_variant("round_robin").config == PolicyConfig()
    for bad in ("e3", "e2:nope=1", "e2:th_bal", "e2:replicate_max_workers=x"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_policies_list_keeps_knob_commas_with_their_variant() -> None:
    assert split_variants("round_robin,e2:th_bal=inf,imbalance_ratio=1.1,e2,cache_aware") == [
        "round_robin", "e2:th_bal=inf,imbalance_ratio=1.1", "e2", "cache_aware"]


def test_sim_verb_runs_policy_variants_under_their_labels(tmp_path) -> None:
    out = tmp_path / "ablation.json"
    assert sim_main(["--gpus", "2", "--workload", "toolbench", "--prefixes", "8", "--rates", "4",
                     "--policies", "e2:th_bal=inf,replicate_max_workers=1,e2",
                     "--duration", "5", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["e2:th_bal=inf,replicate_max_workers=1", "e2"]
    # Rebalancing off: no request is ever routed as a rebalance or a replica seed.
    assert not {"rebalance", "replicate"} & set(runs[0]["decisions"])
    assert sum(runs[0]["worker_requests"].values()) == runs[0]["requests"]
    with pytest.raises(SystemExit, match="no knob"):
        sim_main(["--workload", "toolbench", "--rates", "4", "--policies", "e2:bogus=1",
                  "--json", str(out)])


def test_local_policy_variants_parse_knobs_into_their_config() -> None:
    from prefixmesh.services.worker.local import SprptConfig

    v = parse_local_variant("sprpt_limited:preempt_fraction=0,max_preempt_per_step=2")
    assert v.policy == "sprpt_limited"
    assert v.config == SprptConfig(preempt_fraction=0.0, max_preempt_per_step=2)
    assert parse_local_variant("fcfs").config is None  # the policy's own defaults
    for bad in ("lifo", "sprpt_limited:th_bal=1", "sprpt_limited:preempt_fraction=2",
                "sprpt_limited:preempt_fraction"):
        with pytest.raises(ValueError):
            parse_local_variant(bad)


def test_sim_verb_runs_local_policy_variants(tmp_path) -> None:
    # sharegpt at a rate one GPU cannot keep up with, oracle lengths: sprpt_limited
    # preempts; with its window at 0 it never does, and the rows keep the variant labels.
    out = tmp_path / "local.json"
    assert sim_main(["--gpus", "1", "--workload", "sharegpt", "--rates", "30",
                     "--policies", "round_robin", "--local-policies",
                     "sprpt_limited,sprpt_limited:preempt_fraction=0", "--predictions", "oracle",
                     "--duration", "20", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["local_policy"] for r in runs] == ["sprpt_limited",
                                                 "sprpt_limited:preempt_fraction=0"]
    assert runs[0]["preemptions"] > 0 and runs[1]["preemptions"] == 0
    with pytest.raises(SystemExit, match="no knob"):
        sim_main(["--workload", "toolbench", "--rates", "4", "--local-policies",
                  "fcfs:bogus=1", "--json", str(out)])


def test_e2_with_rebalancing_off_never_rebalances_a_hot_prefix() -> None:
    # One hot document at a rate that overloads its worker: with th_bal = inf and
    # replication capped at one worker, E2 must keep every request on one worker.
    reqs = _shared_prefix_requests(120, docs=1)
    arrivals = [i * 0.01 for i in range(len(reqs))]
    off = PolicyConfig(th_bal=float("inf"), replicate_max_workers=1)
    run = ClusterSim(ClusterConfig(gpus=4, policy="e2", policy_config=off)).run(reqs, arrivals)
    assert sum(1 for n in run.worker_requests.values() if n) == 1
    assert set(run.decisions) <= {"exploit", "explore", "pd_balance"}


def test_knee_window_and_max_rate_under_an_slo() -> None:
    from prefixmesh.loadgen.knee import knee_report, knee_window, max_rate_under

    def row(policy: str, rate: float, p99: float, avg: float, failed: int = 0) -> dict:
        return {"policy": policy, "local_policy": "fcfs", "workload": "w", "gpus": 4,
                "rate": rate, "latency_p99_s": p99, "latency_avg_s": avg, "failed": failed,
                "cache_hit_ratio": 0.5}

    rr = {1.0: row("round_robin", 1, 2.0, 1.0), 2.0: row("round_robin", 2, 3.0, 1.2),
          3.0: row("round_robin", 3, 5.0, 2.0), 4.0: row("round_robin", 4, 9.0, 3.0),
          5.0: row("round_robin", 5, 30.0, 9.0)}
    assert knee_window(rr, 2.0, 5.0) == (2.0, [3.0, 4.0])
    assert max_rate_under(rr, 9.0) == 4.0
    assert max_rate_under(rr, 1.0) is None
    rr[3.0]["failed"] = 1  # a run with unfinished requests never counts as meeting an SLO
    assert max_rate_under(rr, 9.0) == 2.0
    rr[3.0]["failed"] = 0
    runs = [*rr.values(), row("e2", 4, 3.0, 1.5)]
    text = knee_report(runs, "round_robin", 2.0, 5.0)
    assert "knee = 4 req/s" in text
    assert "| e2/fcfs | 1.500 | 3.000 | 50.0% | 0 | 2.00 | 3.00 |" in text


def test_knee_report_combines_seeds_into_means() -> None:
    from prefixmesh.loadgen.knee import knee_report, panels

    def row(policy: str, rate: float, seed: int, p99: float, avg: float) -> dict:
        return {"policy": policy, "local_policy": "fcfs", "workload": "w", "gpus": 4,
                "rate": rate, "seed": seed, "latency_p99_s": p99, "latency_avg_s": avg,
                "failed": 0, "cache_hit_ratio": 0.5}

    runs = [row("round_robin", 1, 0, 2.0, 1.0), row("round_robin", 1, 1, 4.0, 1.0),
            row("round_robin", 4, 0, 10.0, 3.0), row("round_robin", 4, 1, 14.0, 5.0),
            row("e2", 4, 0, 3.0, 1.0), row("e2", 4, 1, 5.0, 2.0),
            row("weighted", 4, 0, 2.0, 1.0), row("weighted", 4, 1, 8.0, 2.0)]
    curve = panels(runs)[("w", 4)]["round_robin/fcfs"]
    assert curve[1.0]["latency_p99_s"] == 3.0 and curve[4.0]["p99_by_seed"] == [10.0, 14.0]
    text = knee_report(runs, "round_robin", 2.0, 5.0)
    assert "knee = 4 req/s" in text and "mean of seeds 0, 1" in text
    # e2: mean p99 4.0 (3 / 5), lowest in seed 1; weighted: mean 5.0, lowest in seed 0.
    assert "| e2/fcfs | 1.500 | 4.000 | 50.0% | 0 | 2.67 | 3.00 | 3.00 / 5.00 | 1 of 2 |" in text
    row = "| weighted/fcfs | 1.500 | 5.000 | 50.0% | 0 | 2.67 | 2.40 | 2.00 / 8.00 | 1 of 2 |"
    assert row in text


def test_knee_cli_keeps_only_the_named_policies(tmp_path, capsys) -> None:
    import json

    from prefixmesh.loadgen.knee import main

    rows = [{"policy": p, "local_policy": "fcfs", "workload": "w", "gpus": 4, "rate": r,
             "latency_p99_s": p99, "latency_avg_s": 1.0, "failed": 0, "cache_hit_ratio": 0.5}
            for p, r, p99 in (("round_robin", 1, 2.0), ("round_robin", 2, 6.0),
                              ("e2:th_bal=inf,x=1", 2, 3.0), ("weighted", 2, 2.5))]
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"runs": rows}))
    main([str(f), "--policies", "round_robin;e2:th_bal=inf,x=1"])
    out = capsys.readouterr().out
    assert "e2:th_bal=inf,x=1/fcfs" in out and "weighted" not in out


def test_run_counts_the_engines_preemptions() -> None:
    # One slot: a long request runs, then short ones queue behind it. sprpt_limited (oracle
    # lengths) evicts the long one inside its preemptable window; fcfs never preempts.
    long = WorkloadRequest(prompt=list(range(100, 164)), max_tokens=400, prefix_id="l",
                           output_len=400)
    short = [WorkloadRequest(prompt=list(range(1000 * k, 1000 * k + 64)), max_tokens=4,
                             prefix_id=f"s{k}", output_len=4) for k in range(1, 4)]
    arrivals = [0.0, 0.5, 0.6, 0.7]
    engine = SimEngineConfig(max_num_seqs=1)

    def run(local: str):
        cfg = ClusterConfig(gpus=1, policy="round_robin", local_policy=local,
                            engine_config=engine, predictions="oracle")
        return ClusterSim(cfg).run([long, *short], arrivals)

    fcfs, srpt = run("fcfs"), run("sprpt_limited")
    assert all(r.ok for r in fcfs.results + srpt.results)
    assert fcfs.preemptions == 0
    assert srpt.preemptions >= 1
    # The short requests no longer wait for the long one to finish.
    assert max(r.latency_s for r in srpt.results[1:]) < min(r.latency_s for r in fcfs.results[1:])
    # Its prompt stayed cached: resuming it recomputed only its tail block, so at most 16
    # prefill tokens per preemption went into recompute. Both ran the same work otherwise.
    extra = srpt.prefill_tokens - fcfs.prefill_tokens
    assert 0 < extra <= 16 * srpt.preemptions
    assert fcfs.prefill_tokens == 64 * 4 and 0 < fcfs.busy_s <= srpt.busy_s


def test_sim_verb_sets_the_engine_limits(tmp_path) -> None:
    out = tmp_path / "limits.json"
    assert sim_main(["--gpus", "1", "--workload", "sharegpt", "--rates", "4",
                     "--policies", "round_robin", "--local-policies", "fcfs",
                     "--max-num-seqs", "2", "--num-blocks", "512", "--duration", "5",
                     "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["runs"]
    assert row["max_num_seqs"] == 2 and row["num_blocks"] == 512
    assert row["prefill_tokens"] > 0 and row["busy_s"] > 0
    with pytest.raises(SystemExit, match="at least 1"):
        sim_main(["--workload", "sharegpt", "--rates", "4", "--max-num-seqs", "0",
                  "--json", str(out)])
    with pytest.raises(SystemExit, match="--cache-pressure must be 0"):
        sim_main(["--workload", "sharegpt", "--rates", "4", "--cache-pressure", "-1",
                  "--json", str(out)])


def test_summary_counts_the_failed_requests_messages() -> None:
    results = [RequestResult(ok=True, latency_s=1.0, ttft_s=0.1, output_tokens=2),
               RequestResult(ok=False, error="HTTP 503: generation failed: worker_lost"),
               RequestResult(ok=False, error="HTTP 503: generation failed: worker_lost"),
               RequestResult(ok=False)]
    row = summarize(results, 1.0)
    assert row["failed"] == 3
    assert row["errors"] == {"HTTP 503: generation failed: worker_lost": 2, "unknown": 1}
    assert "errors" not in summarize(results[:1], 1.0)


def test_trail_report_averages_seeds_and_pairs_preemption_on_and_off() -> None:
    from prefixmesh.loadgen.trail_report import report

    def row(local: str, seed: int, avg: float, pred: str = "oracle", **kw) -> dict:
        return {"workload": "sharegpt", "gpus": 1, "max_num_seqs": 16, "rate": 4.0,
                "seed": seed, "local_policy": local, "predictions": pred,
                "latency_avg_s": avg, "ttft_avg_s": avg / 2, "throughput_rps": 2.0,
                "preemptions": kw.get("pre", 0), "prefill_tokens": kw.get("prefill", 1000)}

    runs = [row("fcfs", 0, 30.0, "none"), row("fcfs", 1, 10.0, "none"),
            row("sprpt_limited", 0, 10.0, pre=8, prefill=1100),
            row("sprpt_limited", 1, 10.0, pre=4, prefill=1100),
            row("sprpt_limited:preempt_fraction=0", 0, 12.0),
            row("sprpt_limited:preempt_fraction=0", 1, 10.0)]
    text = report(runs)
    assert "### sharegpt, 1 GPU(s), max_num_seqs 16" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("| 4 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # rate, load (4 / 2 req/s), seeds, then each variant: fcfs first, preemption off last.
    assert cells[:6] == ["4", "2.00", "2", "20.00 / 10.00 / 0", "10.00 / 5.00 / 6",
                         "11.00 / 5.50 / 0"]
    assert cells[6:] == ["2.00", "1.82", "1.100; +10.0%"]


@pytest.mark.parametrize(("argv", "named"), [
    (["--workers", "0"], "--workers and --schedulers must be at least 1"),
    (["--rate", "-1"], "--rate and --duration must be positive"),
    (["--policy", "nosuch"], "invalid choice: 'nosuch'"),
])
def test_fidelity_refuses_bad_arguments_before_starting_a_mesh(
        capsys: pytest.CaptureFixture[str], argv: list[str], named: str) -> None:
    from prefixmesh.loadgen.fidelity import main as fidelity_main

    with pytest.raises(SystemExit) as exc:
        fidelity_main(["--workload", "toolbench", *argv])
    assert exc.value.code == 2 and named in capsys.readouterr().err
