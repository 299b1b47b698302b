"""A nats-server started by the project runs few Go threads at once (``GOMAXPROCS``), unless
the environment says how many."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from prefixmesh.shared.runtime import servers
from prefixmesh.shared.runtime.servers import (
    NATS_CORES_PER_PROC,
    NatsCluster,
    nats_env,
    start_nats,
    usable_cores,
)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.mark.parametrize(("cores", "procs"), [(1, 1), (2, 1), (15, 1), (16, 2), (64, 8)])
def test_one_go_thread_per_eight_usable_cores_at_least_one(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int, procs: int) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    monkeypatch.setattr(servers, "CGROUP_FS", tmp_path)  # no quota, whatever the host's
    monkeypatch.setattr(servers.os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)
    assert NATS_CORES_PER_PROC == 8
    assert nats_env()["GOMAXPROCS"] == str(procs)


def test_a_gomaxprocs_of_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setenv("GOMAXPROCS", "3")  # one core would give 1
    assert nats_env()["GOMAXPROCS"] == "3"


@pytest.mark.parametrize(("cpu_max", "cores"), [("200000 100000\n", 2), ("150000 100000\n", 2),
                                                 ("max 100000\n", 64), ("5000 100000\n", 1),
                                                 ("100 0\n", 64), ("garbled\n", 64)])
def test_a_cgroup_cpu_quota_caps_the_usable_cores(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpu_max: str, cores: int) -> None:
    monkeypatch.setattr(servers.os, "sched_getaffinity", lambda pid: set(range(64)),
                        raising=False)
    # The quota as a container's limit writes it, at the top of the cgroup fs it sees (the
    # process's own cgroup folder, when it names one, is absent here).
    (tmp_path / "cpu.max").write_text(cpu_max)
    assert usable_cores(tmp_path) == cores


def test_no_cgroup_quota_leaves_the_affinity(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setattr(servers.os, "sched_getaffinity", lambda pid: set(range(12)),
                        raising=False)
    assert usable_cores(tmp_path) == 12  # no cpu.max file at all


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_started_server_runs_with_it(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    proc, _ = start_nats(log_path=tmp_path / "nats.log")
    try:
        env = _environ(proc.pid)
    finally:
        proc.stop()
    assert env["GOMAXPROCS"] == str(max(1, usable_cores() // NATS_CORES_PER_PROC))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_every_node_of_a_started_cluster_runs_with_it(nats_cluster: NatsCluster) -> None:
    expected = os.environ.get("GOMAXPROCS") or str(
        max(1, usable_cores() // NATS_CORES_PER_PROC))
    assert [_environ(n.pid)["GOMAXPROCS"] for n in nats_cluster.nodes] == [expected] * 3
