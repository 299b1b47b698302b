"""When ``prefixmesh up`` says the mesh is up (services/up.py ``awaited``): the edge answers,
every worker it started reports (a worker reports only once its engine runs), the
scheduler routes to all of them and every scheduler replica routes; and what it says while
it waits."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from prefixmesh.services.cli import main as cli_main
from prefixmesh.services.up import awaited, last_log_line
from prefixmesh.shared.runtime.servers import free_port, free_ports


def cluster(workers: dict[str, bool], scheduler_knows: int | None) -> dict:
    """A /cluster view: worker id -> stale; the scheduler's worker count (None: no stats)."""
    sched = None if scheduler_knows is None else {"workers": scheduler_knows, "stale": False}
    return {"workers": [{"worker_id": w, "stale": stale} for w, stale in workers.items()],
            "scheduler": sched}


def test_ready_only_when_every_worker_reports_and_every_scheduler_routes_to_them() -> None:
    own = ["w0", "w1"]
    assert awaited(True, cluster({"w0": False, "w1": False}, 2), own, 2) == []
    # A worker still loading its model has not reported.
    waiting = awaited(True, cluster({"w0": False}, 1), own, 2)
    assert waiting == ["worker w1 to report (its engine is loading)"]
    # Another mesh's worker on the same bus does not stand in for ours.
    assert awaited(True, cluster({"w0": False, "other": False}, 2), own, 2) == waiting
    # A stale report (the worker stopped) is not a live one.
    assert awaited(True, cluster({"w0": False, "w1": True}, 2), own, 2) == waiting
    # Reported, but the scheduler cannot route to it yet.
    assert awaited(True, cluster({"w0": False, "w1": False}, 1), own, 2) == [
        "the scheduler to know the workers (1/2)"]
    assert awaited(True, cluster({"w0": False, "w1": False}, None), own, 2) == ["the scheduler"]
    # Workers started elsewhere (external) are counted, not named.
    assert awaited(True, cluster({"w0": False, "w1": False}, 2), own, 3) == [
        "1 more workers to report"]
    assert awaited(False, None, own, 2) == ["the edge", "the metrics service"]
    # One replica's stats are in, but the others are still catching up with the cluster.
    ready = cluster({"w0": False, "w1": False}, 2)
    assert awaited(True, ready, own, 2, routing=1, schedulers=3) == [
        "scheduler replicas to route (1/3)"]
    assert awaited(True, ready, own, 2, routing=3, schedulers=3) == []


def test_last_log_line_drops_the_log_prefix_and_splits_progress_bars(tmp_path: Path) -> None:
    log = tmp_path / "worker-0.log"
    assert last_log_line(log) == ""
    log.write_text("2026-01-01 10:00:00,000 INFO worker prefixmesh.shared.smollm2 [-] "
                   "converting the model\nConverting...:  10%|#  | 27/272\rConverting...:  "
                   "55%|#####  | 150/272\r\n")
    assert last_log_line(log) == "Converting...:  55%|#####  | 150/272"
    log.write_text("2026-01-01 10:00:00,000 INFO worker x [-] worker w0 ready\n")
    assert last_log_line(log) == "worker w0 ready"


def test_free_ports_lie_below_the_ephemeral_range_so_no_connection_takes_them() -> None:
    # Linux hands out 32768-60999 to bind(0) and to outgoing connections' source ports:
    # a port picked there could be taken by a connection before the child binds it.
    ports = {free_port() for _ in range(50)}
    assert all(port < 32768 for port in ports) and len(ports) > 1
    first = free_ports(4)
    assert first + 3 < 32768


def test_free_ports_are_never_handed_out_twice_by_one_process() -> None:
    # A mesh picks every service's port before any binds: a port free when checked (and
    # released at once) must not go to a second service.
    blocks = [free_ports(3) for _ in range(100)]
    ports = [p for first in blocks for p in range(first, first + 3)]
    ports += [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports) == 600


def test_edge_ports_are_a_free_block_and_a_taken_one_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    first = free_ports(3)
    held = []
    for port in range(first, first + 3):  # every port of the block binds
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        held.append(s)
    held[1].listen()
    try:
        # --port naming a block whose second port is taken: a 2 exit naming it.
        assert cli_main(["up", "--port", str(first), "--edges", "2"]) == 2
        assert f"in use: {first + 1}" in capsys.readouterr().err
    finally:
        for s in held:
            s.close()
    for flag in ("--edges", "--schedulers", "--tokenizers", "--nats-cluster", "--workers"):
        assert cli_main(["up", flag, "0"]) == 2
        assert f"{flag} must be at least 1" in capsys.readouterr().err
    # A block of edge ports that would run past the last TCP port.
    assert cli_main(["up", "--port", "65535", "--edges", "2"]) == 2
    assert "the edges need ports 65535-65536, past 65535" in capsys.readouterr().err
