"""A nats-server started by the project runs few Go threads at once (``GOMAXPROCS``), unless
the environment says how many."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from prefixmesh.shared.runtime import servers
from prefixmesh.shared.runtime.servers import NATS_CORES_PER_PROC, nats_env, start_nats


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.mark.parametrize(("cores", "procs"), [(1, 1), (2, 1), (15, 1), (16, 2), (64, 8)])
def test_one_go_thread_per_eight_usable_cores_at_least_one(
        monkeypatch: pytest.MonkeyPatch, cores: int, procs: int) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    monkeypatch.setattr(servers.os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)
    assert NATS_CORES_PER_PROC == 8
    assert nats_env()["GOMAXPROCS"] == str(procs)


def test_a_gomaxprocs_of_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMAXPROCS", "3")
    assert nats_env()["GOMAXPROCS"] == "3"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_started_server_runs_with_it(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    proc, _ = start_nats(log_path=tmp_path / "nats.log")
    try:
        env = _environ(proc.pid)
    finally:
        proc.stop()
    cores = len(os.sched_getaffinity(0))
    assert env["GOMAXPROCS"] == str(max(1, cores // NATS_CORES_PER_PROC))
