"""``prefixmesh bench-scheduler --live`` on the session's NATS and Redis: every request is
routed through a spawned scheduler process, and the routed requests' completion records
go back to it as workers send theirs with ``--step-ms``, none by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.loadgen.bench_scheduler_live import main

pytestmark = pytest.mark.timeout(120)


def run(nats_server: str, redis_server: str, out: Path, prefix: str, *extra: str) -> dict:
    assert main(["--nats-url", nats_server, "--redis-url", redis_server, "--prefix", prefix,
                 "--workers", "4", "--warmup", "50", "--requests", "400", "--in-flight", "2",
                 "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_live_bench_routes_and_reports_completions(nats_server: str, redis_server: str,
                                                   tmp_path: Path) -> None:
    done = run(nats_server, redis_server, tmp_path / "a.json", "benchlive-done",
               "--step-ms", "0.5")
    assert done["step_ms"] == 0.5 and done["decisions_per_s"] > 0
    # Records of requests routed early enough to be due (about 43 tokens x 0.5 ms) went out.
    assert 0 < done["completion_records"] <= 450
    none = run(nats_server, redis_server, tmp_path / "b.json", "benchlive-none")  # default
    assert none["completion_records"] == 0 and none["decisions_per_s"] > 0


def test_live_bench_refuses_a_negative_step(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--step-ms", "-1"])
    assert exc.value.code == 2
    assert "--step-ms must be at least 0" in capsys.readouterr().err


def test_live_bench_profiles_the_scheduler_it_spawns(nats_server: str, redis_server: str,
                                                     tmp_path: Path) -> None:
    """``--profile DIR``: the spawned scheduler runs under cProfile and, once stopped,
    leaves its profile there, with the routing code in it."""
    import pstats

    run(nats_server, redis_server, tmp_path / "p.json", "benchlive-prof",
        "--profile", str(tmp_path / "prof"))
    stats = pstats.Stats(str(tmp_path / "prof" / "scheduler-0.prof"))
    functions = {name for _file, _line, name in stats.stats}  # type: ignore[attr-defined]
    assert "route" in functions and "_decide" in functions
