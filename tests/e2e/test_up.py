"""``prefixmesh up`` as a user runs it: starts everything, stops everything on a signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from prefixmesh.shared.runtime.servers import free_port

pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_starts_own_servers_and_leaves_nothing_running(tmp_path, sig) -> None:
    state = tmp_path / "state.json"
    cmd = [sys.executable, "-m", "prefixmesh.services.cli", "up", "--workers", "2", "--port", "0",
           "--metrics-port", "0", "--nats-url", f"nats://127.0.0.1:{free_port()}",
           "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--log-dir",
           str(tmp_path / "logs"), "--state-file", str(state), "--subject-prefix", "uptest"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not state.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "mesh did not come up"
            time.sleep(0.1)
        info = json.loads(state.read_text())
        pids = info["pids"]
        # nats-server and redis-server were started (nothing listened on those ports).
        assert {"nats-server", "redis-server", "edge", "scheduler", "tokenizer", "predictor",
                "metrics", "worker-0", "worker-1"} <= set(pids)
        assert all(_alive(p) for p in pids.values())
        with urllib.request.urlopen(info["url"] + "/health", timeout=5) as r:
            assert r.status == 200
        # Every service's metrics are reachable from what `up` prints and writes: the
        # scheduler's decision counters, each worker's, the edge's.
        scrape = info["scrape_urls"]
        assert {"edge", "scheduler", "worker-0", "worker-1", "tokenizer", "predictor",
                "metrics"} <= set(scrape)
        with urllib.request.urlopen(scrape["scheduler"], timeout=5) as r:
            assert b"prefixmesh_scheduler_decisions_total" in r.read()
        with urllib.request.urlopen(scrape["worker-0"], timeout=5) as r:
            assert b"prefixmesh_worker_" in r.read()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "prefixmesh stopped" in out
        assert scrape["scheduler"] in out  # printed, not only in the state file
        assert [name for name, p in pids.items() if _alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # else a failure here leaks it into the next test's warnings


def test_children_do_not_outlive_a_killed_supervisor(tmp_path) -> None:
    """Even SIGKILL of `prefixmesh up` (no chance to clean up) leaves no service running."""
    state = tmp_path / "state.json"
    cmd = [sys.executable, "-m", "prefixmesh.services.cli", "up", "--workers", "1", "--port", "0",
           "--metrics-port", "0", "--nats-url", f"nats://127.0.0.1:{free_port()}",
           "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--state-file", str(state),
           "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not state.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        pids = json.loads(state.read_text())["pids"]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [name for name, p in pids.items() if _alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
