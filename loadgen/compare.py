"""``prefixmesh compare``: prefixmesh and the peers' routers in front of the same simulated GPUs.

For each local policy named by the contenders (``fcfs`` unless a contender says
``NAME@POLICY``), the runner starts nats-server and redis-server when none is given, then
``--workers`` standalone sim workers (``prefixmesh worker --http PORT``) that also join the
mesh over NATS. Then, for each rate and each contender (in an order rotated per rate, so
that noise from other load on the machine spreads over all of them):

1. every worker's prefix cache is flushed (``POST /flush_cache``), so all start cold;
2. the contender is started in front of those workers: ``prefixmesh-POLICY`` is the mesh
   (edge, tokenizer, scheduler with POLICY, ...; its own workers: none), ``sglang-POLICY``
   is ``python -m sglang_router.launch_router``, ``vllm-POLICY`` is ``vllm-router``;
3. on the first rate, an overhead probe: short one-token requests, one at a time, alternately
   through the contender and straight to a worker (the bare worker), median latency each;
4. ``prefixmesh bench --text-prompts`` replays the same seeded workload and arrival trace
   through the contender's URL (text, because sglang-router rejects token-id prompts);
5. the contender is stopped (SIGTERM by PID, then SIGKILL).

Every process is started and stopped here, by PID; logs go to ``OUT_DIR/logs``. Result
rows follow docs/design.md section 11 with ``policy`` = contender name; the JSON also carries
``overhead`` rows and ``meta`` (versions, command line).

``--time-scale K`` runs the simulated GPUs K times slower than the modelled hardware (the
workers' ``--time-scale``; prefixmesh's scheduler gets the same clock, so its windows stay
in model seconds). Rates and durations are then model time: the client offers rate / K for
K x duration wall seconds and the rows are converted back (latency / K, throughput x K;
``time_scale`` and ``times: "model"`` in each row and in ``meta``). What runs outside the
simulated GPUs (client, HTTP, routers, bus) is divided by K as well, so a router's own
overhead looks K times smaller: the overhead probe runs only at K = 1. Each row also
carries the client's send lag and the workers' step lag (wall seconds), which say whether
the machine kept up.

``--clients prefixmesh,guidellm`` (with ``--guidellm PATH``) runs each point once per load
client, the contender restarted on flushed workers for each: guidellm replays the same
requests as a neutral cross-check (``loadgen/guidellm_client.py``); its rows are named
``CONTENDER (guidellm)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import aiohttp
import uvloop

from prefixmesh.loadgen.cluster_sim import pressure_blocks
from prefixmesh.loadgen.guidellm_client import run_guidellm
from prefixmesh.loadgen.options import (
    WorkloadSpec,
    add_workload_args,
    parse_floats,
    parse_names,
)
from prefixmesh.loadgen.report import markdown, plot
from prefixmesh.loadgen.soak import metric_sum, scrape
from prefixmesh.services.up import LocalMesh, MeshOptions
from prefixmesh.shared.costmodel import parse_gpu_profiles
from prefixmesh.shared.models import sim_card
from prefixmesh.shared.runtime.servers import (
    ManagedProcess,
    child_env,
    free_port,
    get_json,
    start_nats,
    start_redis,
)

ROUTERS = {
    # family -> (policies it ships, argv prefix)
    "sglang": (("cache_aware", "round_robin", "power_of_two", "random"),
               [sys.executable, "-m", "sglang_router.launch_router"]),
    "vllm": (("cache_aware", "round_robin", "power_of_two", "consistent_hash",
              "sticky_least_loaded", "random"),
             [sys.executable, "-m", "vllm_router.launch_router"]),
}
PACKAGES = {"sglang": "sglang-router", "vllm": "vllm-router"}
DEFAULT_CONTENDERS = ("prefixmesh-e2,prefixmesh-round_robin,prefixmesh-e2@prefix_fair,"
                      "sglang-cache_aware,sglang-round_robin,sglang-power_of_two,"
                      "vllm-cache_aware,vllm-consistent_hash")
# The engines' local policy when a contender names none: what vLLM's scheduler does.
DEFAULT_LOCAL = "fcfs"
# Start-up of a worker or router; a machine loaded by other jobs can take minutes.
READY_TIMEOUT_S = 240.0
POLL_S = 0.2
# Overhead probe: this many sequential requests of a short fixed prompt, one output token.
PROBE_REQUESTS = 40
PROBE_PROMPT = "Measure the router overhead with a short prompt that every worker caches."
# A flush is refused while requests still run; retry this long (seconds).
FLUSH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Contender:
    """One thing to put in front of the workers."""

    name: str  # as given, e.g. "prefixmesh-e2@prefix_fair"
    family: str  # prefixmesh | sglang | vllm
    policy: str
    local_policy: str

    @classmethod
    def parse(cls, text: str) -> Contender:
        head, _, local = text.partition("@")
        family, _, policy = head.partition("-")
        if family not in ("prefixmesh", *ROUTERS) or not policy:
            raise SystemExit(f"contender {text!r}: expected prefixmesh-P, sglang-P or vllm-P")
        if family in ROUTERS and policy not in ROUTERS[family][0]:
            raise SystemExit(f"{family} router has no policy {policy!r}: "
                             f"{', '.join(ROUTERS[family][0])}")
        return cls(text, family, policy, local or DEFAULT_LOCAL)


def available(c: Contender) -> str | None:
    """None when the contender can run here, else why not."""
    if c.family in PACKAGES:
        try:
            metadata.version(PACKAGES[c.family])
        except metadata.PackageNotFoundError:
            return f"{PACKAGES[c.family]} is not installed (pip install -e '.[peers]')"
    return None


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("prefixmesh", *PACKAGES.values()):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def guidellm_version(exe: str) -> str:
    """``guidellm --version``'s answer, or why there is none."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"
    return out.stdout.strip() or out.stderr.strip()


def _model_id(url: str) -> str:
    """The first model that ``url``/v1/models lists."""
    body = get_json(url + "/v1/models")
    if not isinstance(body, dict) or not body.get("data"):
        raise RuntimeError(f"{url}/v1/models lists no model")
    return body["data"][0]["id"]


def _post(url: str, timeout: float = 5.0) -> int:
    req = urllib.request.Request(url, data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def wait_models(url: str, proc: ManagedProcess | None, what: str) -> None:
    """Block until ``url``/v1/models lists a model (the endpoint can serve)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{what} exited with {proc.returncode}; see its log")
        body = get_json(url + "/v1/models")
        if isinstance(body, dict) and body.get("data"):
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"{what} not ready at {url} within {READY_TIMEOUT_S}s")


class WorkerGroup:
    """``n`` standalone HTTP sim workers on the mesh's bus; a context manager."""

    def __init__(self, n: int, local_policy: str, profile: str, nats_url: str,
                 subject_prefix: str, log_dir: Path, time_scale: float = 1.0,
                 profiles: Sequence[str] = (), kv_blocks: int = 0) -> None:
        self.procs: list[ManagedProcess] = []
        self.urls: list[str] = []
        self.metrics_urls: list[str] = []  # each worker's Prometheus /metrics
        self.n, self.local_policy, self.profile = n, local_policy, profile
        # One profile per worker (a fleet mixing GPU types); empty: ``profile`` for all.
        self.profiles = tuple(profiles) or (profile,) * n
        # A mixed fleet serves one model name (the first profile's), as one deployment.
        self.model_args = (["--model", sim_card(self.profiles[0]).name]
                           if len(set(self.profiles)) > 1 else [])
        self.time_scale = time_scale
        # Each worker's KV pool in blocks (0: its profile's); a cache-pressure run sets it.
        self.kv_args = ["--sim-kv-blocks", str(kv_blocks)] if kv_blocks else []
        self.nats_url, self.subject_prefix, self.log_dir = nats_url, subject_prefix, log_dir

    def __enter__(self) -> WorkerGroup:
        try:
            for i in range(self.n):
                port, metrics_port = free_port(), free_port()
                argv = [sys.executable, "-m", "prefixmesh.services.cli", "worker", "--http",
                        str(port), "--metrics-port", str(metrics_port),
                        "--nats-url", self.nats_url, "--subject-prefix", self.subject_prefix,
                        "--worker-id", f"w{i}", "--backend", "sim",
                        "--profile", self.profiles[i], *self.model_args,
                        "--local-policy", self.local_policy, "--log-level", "WARNING",
                        "--time-scale", str(self.time_scale), *self.kv_args]
                name = f"worker-{self.local_policy}-{i}"
                self.procs.append(ManagedProcess(name, argv, env=child_env(
                    PYTHONUNBUFFERED="1"), log_path=self.log_dir / f"{name}.log").start())
                self.urls.append(f"http://127.0.0.1:{port}")
                self.metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")
            for url, proc in zip(self.urls, self.procs):
                wait_models(url, proc, proc.name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.stop()

    def flush(self) -> None:
        """Drop every worker's prefix cache (waits until they are idle)."""
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        for url in self.urls:
            while _post(url + "/flush_cache") != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not flush its cache")
                time.sleep(0.5)

    def timings(self) -> dict[str, float]:
        """Sums and counts, over every worker so far, from their /metrics: seconds from a
        request's arrival to its last token (``latency``), waiting to start (``queue``),
        from its edge to its arrival (``arrival``: requests that came over the mesh only)
        and engine steps (``step``); and each worker's requests (``requests@I``)."""
        metrics = {"latency": "prefixmesh_worker_request_latency_seconds",
                   "queue": "prefixmesh_worker_queue_seconds",
                   "arrival": "prefixmesh_worker_arrival_delay_seconds",
                   "step": "prefixmesh_worker_step_seconds"}
        texts = [scrape(url) for url in self.metrics_urls]
        out = {f"{key}{part}": sum(metric_sum(t, name + part) or 0.0 for t in texts)
               for key, name in metrics.items() for part in ("_sum", "_count")}
        for i, t in enumerate(texts):
            out[f"requests@{i}"] = metric_sum(t, metrics["latency"] + "_count") or 0.0
        return out

    def step_lag(self) -> dict[str, float]:
        """The workers' step lag since the last flush: the worst lag ratio and step lag."""
        ratio = worst = 0.0
        for url in self.urls:
            info = get_json(url + "/server_info")
            lag = info.get("step_lag", {}) if isinstance(info, dict) else {}
            ratio = max(ratio, lag.get("lag_ratio", 0.0))
            worst = max(worst, lag.get("max_lag_s", 0.0))
        return {"worker_lag_ratio_max": ratio, "worker_step_lag_max_wall_s": worst}


class Running:
    """A started contender: its URL and how to stop it."""

    def __init__(self, url: str, stop: Callable[[], object],
                 pids: dict[str, int] | None = None) -> None:
        self.url, self.stop = url, stop
        # Its processes by name (what ``prefixmesh bench-router`` reads CPU time of).
        self.pids = pids or {}


def start_contender(c: Contender, group: WorkerGroup, infra: dict[str, str], serial: int,
                    log_dir: Path, env: dict[str, str] | None = None, edges: int = 1
                    ) -> Running:
    """Start ``c`` in front of ``group``'s workers; returns when it serves. ``env``: more
    environment for a prefixmesh mesh's services (e.g. PYTHONPATH of other code);
    ``edges``: a prefixmesh mesh's edge processes, sharing one port."""
    if c.family == "prefixmesh":
        # The first worker's profile: the edge serves its model name, as the workers do.
        opts = MeshOptions(
            workers=0, external_workers=group.n, policy=c.policy, local_policy=c.local_policy,
            edges=edges, shared_port=edges > 1,
            profile=group.profiles[0], port=0, metrics_port=0, nats_url=infra["nats"],
            redis_url=infra["redis"], subject_prefix=group.subject_prefix,
            log_dir=log_dir / f"mesh-{serial}-{c.name}", log_level="WARNING",
            # A fresh Redis key prefix: the scheduler must not reload an earlier run's tree.
            # The scheduler's policy clock runs in the workers' model time.
            extra_env={"PM_REDIS_PREFIX": f"cmp{serial}",
                       "PM_TIME_SCALE": str(group.time_scale), **(env or {})})
        mesh = LocalMesh(opts)
        try:
            mesh.start()
        except BaseException:
            mesh.stop()
            raise
        time.sleep(1.0)  # a few load reports, so the scheduler has seen every worker
        return Running(mesh.url, mesh.stop, mesh.pids())
    port = free_port()
    argv = [*ROUTERS[c.family][1], "--worker-urls", *group.urls, "--host", "127.0.0.1",
            "--port", str(port), "--policy", c.policy, "--prometheus-port", str(free_port()),
            "--log-level", "warn" if c.family == "sglang" else "warning"]
    proc = ManagedProcess(f"{c.name}-{serial}", argv, env=child_env(),
                          log_path=log_dir / f"{c.name}-{serial}.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_models(url, proc, c.name)
    except BaseException:
        proc.stop()
        raise
    return Running(url, proc.stop, {c.name: proc.pid})


async def probe(url: str, bare_url: str, model: str, n: int = PROBE_REQUESTS
                ) -> tuple[float, float]:
    """Median seconds of ``n`` one-token completions of a short fixed prompt through ``url``
    and straight to the worker at ``bare_url``, sent alternately (so background load on the
    machine hits both alike), one at a time."""
    body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0.0}
    times: dict[str, list[float]] = {url: [], bare_url: []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for i in range(n + 1):
            for target in (url, bare_url):
                t0 = time.perf_counter()
                async with s.post(target + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    await r.read()
                if i:  # the first round fills the caches; not counted
                    times[target].append(time.perf_counter() - t0)
    return statistics.median(times[url]), statistics.median(times[bare_url])


def run_bench(url: str, model: str, c: Contender, rate: float, args: argparse.Namespace,
              workload_argv: list[str], out: Path, log_dir: Path) -> dict:
    """``prefixmesh bench`` as a child process; its one result row."""
    # The model is named: sglang-router answers /v1/models as text/plain.
    argv = [sys.executable, "-m", "prefixmesh.services.cli", "bench", "--url", url, "--model",
            model,
            *workload_argv,
            "--rate", str(rate), "--duration", str(args.duration), "--json", str(out),
            "--label", c.name, "--local-policy", c.local_policy, "--gpus", str(args.workers),
            "--backend", "sim", "--no-progress", "--text-prompts",
            "--time-scale", str(args.time_scale)]
    with open(log_dir / f"bench-{c.name}-{rate:g}.log", "ab") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True,
                       stdin=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]


def run_point(c: Contender, client: str, rate: float, probe_now: bool, group: WorkerGroup,
              infra: dict[str, str], serial: int, model: str, spec: WorkloadSpec,
              args: argparse.Namespace, workload_argv: list[str], log_dir: Path,
              result: dict) -> dict | None:
    """One point: flush, start ``c``, (probe,) load it with ``client``, stop it; its row,
    or None when the contender would not start (recorded in ``meta.failures``)."""
    group.flush()
    try:
        running = start_contender(c, group, infra, serial, log_dir)
    except (RuntimeError, TimeoutError) as exc:
        # One contender that will not start costs its point, not the run.
        print(f"{c.name} at {rate:g}: {exc}", file=sys.stderr, flush=True)
        result["meta"]["failures"].append({"contender": c.name, "rate": rate, "error": str(exc)})
        return None
    try:
        if probe_now and client == "prefixmesh":
            via, bare = uvloop.run(probe(running.url, group.urls[0], model))
            result["overhead"].append({
                "contender": c.name, "probe_p50_ms": via * 1e3, "bare_p50_ms": bare * 1e3,
                "overhead_ms": (via - bare) * 1e3})
        if client == "guidellm":
            labels = {"policy": f"{c.name} (guidellm)", "local_policy": c.local_policy,
                      "gpus": args.workers, "backend": "sim", "client": "guidellm"}
            row = run_guidellm(args.guidellm, running.url, model, spec, rate, args.duration,
                               args.time_scale, labels, log_dir / f"run-{serial}",
                               log_dir / f"guidellm-{c.name}-{rate:g}.log")
        else:
            row = run_bench(running.url, model, c, rate, args, workload_argv,
                            log_dir / f"run-{serial}.json", log_dir)
    finally:
        running.stop()
    row.update(group.step_lag())
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixmesh compare",
        description="prefixmesh and sglang-router / vllm-router in front of the very same "
        "standalone simulated GPU workers; one JSON + markdown + PNG report. Workload "
        "options (--zipf, --mix, --arrivals, --seed, ...) are those of `prefixmesh bench`.")
    p.add_argument("--workers", type=int, default=4, help="simulated GPU workers")
    p.add_argument("--workload", required=True, help="workload name or mix (see bench)")
    p.add_argument("--rates", required=True, help="comma-separated request rates (req/s)")
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                   help="comma-separated: prefixmesh-POLICY, sglang-POLICY, vllm-POLICY, "
                   "each optionally @LOCAL_POLICY of the workers (default fcfs)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per point")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="K: run the simulated GPUs K times slower than the modelled hardware; "
                   "--rates and --duration are model time, offered K times slower, results "
                   "converted back to model time (latency / K, throughput x K); the overhead "
                   "probe is skipped unless K = 1")
    p.add_argument("--profile", default="mistral-7b-a6000", help="cost-model profile")
    p.add_argument("--gpu-profiles", default="",
                   help="a fleet mixing GPU types: PROFILE:COUNT,... one profile per worker "
                   "(overrides --workers; prefixmesh's scheduler keeps --profile as default)")
    p.add_argument("--cache-pressure", type=float, default=0.0,
                   help="P > 0: size every worker's KV pool so the working set of the "
                   "heaviest point's requests is P times the fleet's cache, one pool for "
                   "every rate (2-4 is a cache-pressure test; for one rate, the pool "
                   "`prefixmesh sim --cache-pressure` gives)")
    p.add_argument("--nats-url", default="", help="NATS to use (default: start one)")
    p.add_argument("--redis-url", default="", help="Redis to use (default: start one)")
    p.add_argument("--no-probe", action="store_true", help="skip the overhead probe")
    p.add_argument("--clients", default="prefixmesh",
                   help="load clients, each a separate run per point: prefixmesh (prefixmesh "
                   "bench), guidellm (needs --guidellm)")
    p.add_argument("--guidellm", default="", help="path of a guidellm executable (0.8.x)")
    p.add_argument("--skip-missing", action="store_true",
                   help="leave out router contenders whose package is not installed")
    p.add_argument("--json", type=Path, required=True, help="results JSON; .md and .png beside")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, workload_argv = build_parser().parse_known_args(argv)
    workload_argv = ["--workload", args.workload, *workload_argv]
    rates = parse_floats(args.rates, "rates")
    profiles: tuple[str, ...] = ()
    if args.gpu_profiles:
        try:
            profiles = parse_gpu_profiles(args.gpu_profiles)
        except ValueError as exc:
            raise SystemExit(f"--gpu-profiles: {exc}") from None
        args.workers = len(profiles)
    if not args.time_scale > 0:
        raise SystemExit("--time-scale must be positive")
    probe_on = not args.no_probe and args.time_scale == 1.0
    clients = parse_names(args.clients)
    if not set(clients) <= {"prefixmesh", "guidellm"}:
        raise SystemExit("--clients: prefixmesh and/or guidellm")
    if "guidellm" in clients and not args.guidellm:
        raise SystemExit("--clients guidellm needs --guidellm PATH")
    spec_parser = argparse.ArgumentParser()
    add_workload_args(spec_parser)
    spec = WorkloadSpec.from_args(spec_parser.parse_args(workload_argv))
    kv_blocks = 0
    if args.cache_pressure < 0:
        raise SystemExit("--cache-pressure must not be negative (0 = the profiles' pools)")
    if args.cache_pressure > 0:  # the heaviest point's requests, as its bench sends them
        heaviest = spec.requests(max(1, round(max(rates) * args.duration)))
        kv_blocks = pressure_blocks(heaviest, args.workers, args.cache_pressure)
    contenders = [Contender.parse(n) for n in parse_names(args.contenders)]
    missing = {c.name: why for c in contenders if (why := available(c))}
    if missing and not args.skip_missing:
        raise SystemExit("; ".join(f"{n}: {w}" for n, w in missing.items()))
    contenders = [c for c in contenders if c.name not in missing]
    out_dir = args.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="compare-", dir=out_dir)) / "logs"
    log_dir.mkdir(parents=True)
    print(f"logs: {log_dir}", file=sys.stderr, flush=True)
    result: dict = {"runs": [], "overhead": [], "meta": {
        "command": "prefixmesh compare " + " ".join(argv), "versions": versions(),
        "workers": args.workers, "left_out": missing, "failures": [],
        "gpu_profiles": list(profiles),
        "cache_pressure": args.cache_pressure, "kv_blocks": kv_blocks,
        "time_scale": args.time_scale, "clients": clients,
        "guidellm": guidellm_version(args.guidellm) if "guidellm" in clients else "",
        "times": "model" if args.time_scale != 1.0 else "wall",
        "started": time.time()}}
    infra_procs: list[ManagedProcess] = []
    try:
        infra = {"nats": args.nats_url, "redis": args.redis_url}
        if not infra["nats"]:
            proc, infra["nats"] = start_nats(log_path=log_dir / "nats-server.log")
            infra_procs.append(proc)
        if not infra["redis"]:
            proc, infra["redis"] = start_redis(data_dir=log_dir,
                                               log_path=log_dir / "redis-server.log")
            infra_procs.append(proc)
        by_local: dict[str, list[Contender]] = {}
        for c in contenders:
            by_local.setdefault(c.local_policy, []).append(c)
        serial = 0
        for local, group_contenders in by_local.items():
            with WorkerGroup(args.workers, local, args.profile, infra["nats"],
                             f"cmp{local}", log_dir, args.time_scale, profiles,
                             kv_blocks) as group:
                model = _model_id(group.urls[0])
                for ri, rate in enumerate(rates):
                    k = ri % len(group_contenders)
                    for c in group_contenders[k:] + group_contenders[:k]:
                        for client in clients:
                            serial += 1
                            row = run_point(c, client, rate, ri == 0 and probe_on, group,
                                            infra, serial, model, spec, args, workload_argv,
                                            log_dir, result)
                            if row is None:
                                continue
                            result["runs"].append(row)
                            print(json.dumps(row), flush=True)
                            args.json.write_text(json.dumps(result, indent=1))
    finally:
        for p in reversed(infra_procs):
            p.stop()
    args.json.write_text(json.dumps(result, indent=1))
    md = markdown(result["runs"]) + overhead_markdown(result["overhead"])
    if args.time_scale != 1.0:
        md = (f"Model time: simulated GPUs ran {args.time_scale:g}x slower; latencies / "
              f"{args.time_scale:g}, throughput x {args.time_scale:g}.\n\n" + md)
    args.json.with_suffix(".md").write_text(md)
    plot(result["runs"], args.json.with_suffix(".png"))
    print(md)
    return 0


def overhead_markdown(rows: Sequence[dict]) -> str:
    """The overhead probe as a markdown table."""
    if not rows:
        return ""
    lines = ["", "| contender | probe p50 (ms) | bare worker p50 (ms) | overhead (ms) |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['contender']} | {r['probe_p50_ms']:.2f} | {r['bare_p50_ms']:.2f} "
                     f"| {r['overhead_ms']:+.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
