"""``prefixmesh bench-router``: which runs a contender list expands to, and its summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixmesh.loadgen.bench_router import (
    WORKER_STEPS,
    build_parser,
    closed_loop,
    markdown,
    renice,
    runs_of,
    shares,
    summarize,
)
from prefixmesh.loadgen.compare import Contender


def test_each_prefixmesh_contender_runs_once_per_edge_count_and_code(tmp_path: Path) -> None:
    names = ["prefixmesh-e2", "sglang-cache_aware", "direct"]
    contenders = {n: Contender.parse(n) for n in names if n != "direct"}
    runs = runs_of(names, contenders, [1, 2], tmp_path)
    assert list(runs) == ["prefixmesh-e2", "prefixmesh-e2 (2 edges)",
                          "prefixmesh-e2 (baseline)", "prefixmesh-e2 (2 edges) (baseline)",
                          "sglang-cache_aware"]
    assert [r[2] for r in runs.values()] == [1, 2, 1, 2, 1]
    # The baseline's runs put its code first on the services' path; the others run this.
    assert runs["prefixmesh-e2 (baseline)"][1] == {"PYTHONPATH": str(tmp_path.resolve())}
    assert runs["prefixmesh-e2 (2 edges)"][1] == {}
    # An HTTP router has one process whatever --edges says; direct is no run of its own.
    assert runs_of(names, contenders, [4], None) == {
        "prefixmesh-e2 (4 edges)": (contenders["prefixmesh-e2"], {}, 4),
        "sglang-cache_aware": (contenders["sglang-cache_aware"], {}, 1)}


def test_the_summary_splits_the_latency_into_workers_and_path() -> None:
    def row(name: str, rps: float, worker_ms: float, path_ms: float | None,
            wait_ms: float) -> dict:
        return {"contender": name, "concurrency": 64, "req_per_s": rps, "p50_ms": 50.0,
                "p99_ms": 80.0, "mean_ms": 55.0, "worker_mean_ms": worker_ms,
                "worker_queue_ms": wait_ms, "step_ms": 25.0, "requests_per_step": rps / 160,
                "edge_to_worker_ms": path_ms, "loadavg_1m": 2.0}

    rows = [row("prefixmesh-e2", 1200, 40.0, 3.0, 15.0),
            row("prefixmesh-e2", 1300, 44.0, 5.0, 17.0),
            row("sglang-cache_aware", 1250, 42.0, None, 15.5)]
    by_name = {r["contender"]: r for r in summarize(rows, "sglang-cache_aware")}
    mesh, http = by_name["prefixmesh-e2"], by_name["sglang-cache_aware"]
    assert (mesh["req_per_s"], mesh["worker_mean_ms"], mesh["edge_to_worker_ms"]) == (
        1250, 42.0, 4.0)
    assert (mesh["worker_queue_ms"], mesh["requests_per_step"]) == (16.0, 7.81)
    assert mesh["vs_reference"] == 1.0
    assert "edge_to_worker_ms" not in http  # an HTTP router has no edge
    table = markdown(summarize(rows, "sglang-cache_aware"), "sglang-cache_aware")
    assert ("| 64 | prefixmesh-e2 | 1,250 (1,200, 1,300) | 50.0 | 80.0 | 55.0 | 42.0 | 16.0 "
            "| 7.81 | 4.0 |") in table
    # Without repeat numbers no two rows pair up: only the ratio of the means.
    assert "vs_reference_median" not in mesh
    # Each repeat's ratio: a burst in one repeat (the reference's 1,250 -> 625 in the
    # second) moves the ratio of the means, not the median of three.
    paired = [dict(r, repeat=i) for i in range(3) for r in (
        row("prefixmesh-e2", 1200, 40.0, 3.0, 15.0),
        row("sglang-cache_aware", 625 if i == 1 else 1250, 42.0, None, 15.5))]
    mesh = {r["contender"]: r for r in summarize(paired, "sglang-cache_aware")}["prefixmesh-e2"]
    assert mesh["vs_reference_each"] == [0.96, 1.92, 0.96]
    assert (mesh["vs_reference"], mesh["vs_reference_median"]) == (1.152, 0.96)
    assert "| 1.15x; median 0.96x |" in markdown(summarize(paired, "sglang-cache_aware"),
                                                 "sglang-cache_aware")
    # Rows of an older run, without the step figures: summed without them.
    old = [{k: v for k, v in r.items() if k not in WORKER_STEPS} for r in rows]
    assert "worker_queue_ms" not in summarize(old, "sglang-cache_aware")[0]
    assert "| 42.0 |  |  | 4.0 |" in markdown(summarize(old, "sglang-cache_aware"),
                                              "sglang-cache_aware")


def test_shares_are_each_workers_part_of_the_requests() -> None:
    assert shares([30.0, 10.0, 10.0, 50.0]) == [0.3, 0.1, 0.1, 0.5]
    assert shares([0.0, 0.0]) == [0.0, 0.0]  # nothing served: no division by zero


def test_worker_nice_lowers_the_workers_priority_and_rejects_what_it_cannot_set() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = os.getpriority(os.PRIO_PROCESS, child.pid)
        renice([child.pid], 0)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == start
        nicer = min(start + 3, 19)  # only ever nicer: no privilege needed
        renice([child.pid], nicer)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == nicer
    finally:
        child.kill()
        child.wait()
    assert build_parser().parse_args(["--json", "x.json"]).worker_nice == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--json", "x.json", "--worker-nice", "20"])


async def test_no_prompt_comes_back_in_a_later_closed_loop() -> None:
    """Every contender's rounds meet the same workers, whose caches (and a router's own
    history) hold the earlier rounds' prompts: a prompt sent again would be a cache hit,
    so each loop numbers its prompts apart from every other loop's."""
    from aiohttp import web

    from prefixmesh.shared.runtime.servers import free_port

    seen: list[list[str]] = []

    async def complete(request: web.Request) -> web.Response:
        seen[-1].append((await request.json())["prompt"])
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        for _ in range(2):
            seen.append([])
            point = await closed_loop([f"http://127.0.0.1:{port}"], "m", 4, 0.0, 0.2)
            assert point.errors == 0 and len(point.latencies) > 0
    finally:
        await runner.cleanup()
    first, second = seen
    assert len(set(first)) == len(first) and len(set(second)) == len(second)
    assert not set(first) & set(second)
