"""``prefixmesh bench-scheduler``: the policy's memory mode and the rate scaled with the
workers (decision timings themselves are benchmarks, not tests)."""

from __future__ import annotations

import json

from prefixmesh.loadgen.bench_scheduler import main, make_stream, policy_memory, run_bench


def test_policy_memory_grows_with_the_requests_it_holds():
    small = policy_memory(make_stream("toolbench", 320.0), 32, 200)
    big = policy_memory(make_stream("toolbench", 320.0), 32, 2000)
    assert 0 < small["policy_bytes"] < big["policy_bytes"]
    assert big["window_entries"] == 2000  # all inside the 180 s window
    assert big["tree_nodes"] > small["tree_nodes"] > 0
    assert big["bytes_per_worker"] == round(big["policy_bytes"] / 32)


def test_memory_mode_scales_the_default_rate_with_the_workers(tmp_path, capsys):
    out = tmp_path / "mem.json"
    assert main(["--workers", "64", "--requests", "50", "--warmup", "50", "--scale-rate",
                 "--memory", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["rate"] == 640.0 and row["requests"] == 100 and row["workers"] == 64
    assert json.loads(capsys.readouterr().out) == row


def test_remote_mode_times_a_peer_replica_learning_each_decision():
    row = run_bench(make_stream("toolbench", 160.0), workers=8, requests=300, warmup=100,
                    remote=True)
    assert row["remote_p50_us"] > 0 and row["remote_cost_ratio"] > 0
    plain = run_bench(make_stream("toolbench", 160.0), workers=8, requests=50, warmup=10)
    assert "remote_p50_us" not in plain and plain["clock"] == "wall"
    cpu = run_bench(make_stream("toolbench", 160.0), workers=8, requests=50, warmup=10,
                    cpu_clock=True)
    assert cpu["clock"] == "cpu" and cpu["p99_us"] >= cpu["p50_us"] > 0


def test_feedback_is_timed_apart_from_the_decisions():
    # 2 s of virtual time at 160 req/s: completions, load reports, ticks and KV events
    # (stored 50 ms after routing) all reach the policy during the timed part.
    row = run_bench(make_stream("toolbench", 160.0), workers=8, requests=320, warmup=100)
    fed = row["feedback_us_per_decision"]
    assert set(fed) == {"kv_events", "done", "load", "tick"}
    assert all(v > 0 for v in fed.values())


def test_messages_sum_consecutive_decisions_with_the_feedback_between_them():
    row = run_bench(make_stream("toolbench", 160.0), workers=8, requests=320, warmup=100,
                    message=32)
    assert row["message_requests"] == 32
    assert 0 < row["message_p50_ms"] <= row["message_p99_ms"] <= row["message_max_ms"]
    # A message's time holds its decisions' own: at least 32 of the fastest (p50 is not
    # a bound, but no message of 32 can take less than the decisions it holds).
    assert row["message_max_ms"] * 1e3 >= 32 * row["p50_us"] / 2
    few = run_bench(make_stream("toolbench", 160.0), workers=8, requests=20, warmup=10,
                    message=64)
    assert "message_p50_ms" not in few  # fewer decisions than one message


def test_bad_counts_are_refused_before_any_work(capsys):
    import pytest

    from prefixmesh.loadgen.bench_scheduler_live import main as live_main

    for argv, named in ((["--workers", "0"], "--workers and --requests must be at least 1"),
                        (["--requests", "0"], "--workers and --requests must be at least 1"),
                        (["--rate", "0"], "--rate must be positive"),
                        (["--message", "0"], "--message must be at least 1")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and named in capsys.readouterr().err
    for argv in (["--schedulers", "0"], ["--workers", "0"]):
        with pytest.raises(SystemExit) as exc:
            live_main(argv)  # refused before any server or scheduler starts
        assert exc.value.code == 2 and "--schedulers must be at least 1" in capsys.readouterr().err
