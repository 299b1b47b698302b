"""``prefixmesh bench-scheduler --live`` on the session's NATS and Redis: every request is
routed through a spawned scheduler process, and the routed requests' completion records
go back to it as workers send theirs with ``--step-ms``, none by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
    # Exactly --requests are timed; the warmup's, sent in the same loop, are not.
    assert done["timed_requests"] == none["timed_requests"] == 400


def test_live_bench_refuses_no_timed_request(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--requests", "0"])
    assert exc.value.code == 2
    assert "--requests, --in-flight, --workers and --schedulers must be at least 1" in (
        capsys.readouterr().err)


def test_live_bench_refuses_a_negative_step(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--step-ms", "-1"])
    assert exc.value.code == 2
    assert "--step-ms must be at least 0" in capsys.readouterr().err


def test_live_bench_pin_refuses_without_a_core_to_spare(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--pin", "--schedulers", str(len(os.sched_getaffinity(0)))])
    assert exc.value.code == 2
    assert "--pin needs spawned schedulers and more cores than them" in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pin_gives_the_scheduler_a_core_of_its_own() -> None:
    from prefixmesh.loadgen.bench_scheduler_live import _pin

    cores = sorted(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
             for _ in range(2)]
    try:
        named = [SimpleNamespace(name="scheduler-0", pid=procs[0].pid),
                 SimpleNamespace(name="nats-server", pid=procs[1].pid)]
        _pin(named, cores, 1)  # type: ignore[arg-type]
        assert os.sched_getaffinity(procs[0].pid) == {cores[-1]}
        assert os.sched_getaffinity(procs[1].pid) == set(cores[:-1])
        assert os.sched_getaffinity(0) == set(cores[:-1])
    finally:
        os.sched_setaffinity(0, mine)
        for p in procs:
            p.kill()
            p.wait()


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
