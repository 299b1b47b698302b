"""Soak run: the whole mesh under steady ``prefixmesh bench`` load, sampled for growth.

``python -m prefixmesh.loadgen.soak --capacity-rates 4,8,12,16 --duration 1800
--json results/soak.json``
starts a local mesh (``LocalMesh``, its own nats-server and redis-server on free ports) and:

1. measures the mesh's capacity: ``prefixmesh bench`` at each of ``--capacity-rates`` for
   ``--capacity-duration`` seconds; the capacity is the highest rate, below the first one
   that misses, with no failed request and a p99 latency at most ``--capacity-p99-factor``
   times the p99 at the lowest rate (latency has not started to climb yet);
2. runs ``prefixmesh bench`` for ``--duration`` seconds at ``--load-fraction`` (0.8) of that
   capacity (or at ``--rate``, skipping step 1), sampling every ``--interval`` seconds the
   resident memory (VmRSS) of every service process, the active scheduler's prefix-tree
   size (``prefixmesh_scheduler_tree_nodes`` / ``_tree_tokens``) and each worker's evicted
   KV blocks (``prefixmesh_worker_kv_blocks_evicted_total``).

Warm-up: the prefix tree mirrors the workers' caches, so it grows until they are full. With
``--warmup auto`` (the default) the warm-up ends ``--settle`` seconds (one scheduler window)
after the first sample at which every worker has evicted blocks, or earlier, once some
worker has evicted and the tree grew under 1 % over the last ``--settle`` seconds; a number
is a fixed time.
Per series the JSON gives the growth after warm-up, (last - first) / first, and the peak,
(max - first) / first; the run fails (exit 1) when a peak reaches 10 %, when any request
failed, or when the warm-up leaves less than ``--min-window`` seconds to measure.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from prefixmesh.services.up import LocalMesh, MeshOptions
from prefixmesh.shared.runtime.servers import ManagedProcess, free_port, get_text

# Peak growth allowed after warm-up (fraction) before the run is reported as failing.
MAX_GROWTH = 0.10
TREE_METRICS = ("prefixmesh_scheduler_tree_nodes", "prefixmesh_scheduler_tree_tokens")
EVICTED_METRIC = "prefixmesh_worker_kv_blocks_evicted_total"


def rss_kib(pid: int) -> int | None:
    """Resident memory of a process in KiB (Linux /proc), None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def scrape(url: str) -> str:
    """A /metrics page; "" when it cannot be read (a service that is down has no samples)."""
    return get_text(url) or ""


def metric_sum(text: str, metric: str) -> float | None:
    """Sum of every sample of ``metric`` (all label sets) in a text exposition."""
    values = re.findall(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values) if values else None


def tree_size(mesh: LocalMesh) -> dict[str, float]:
    """Tree gauges of the first scheduler replica that routes (every replica hears every
    event, so each holds the whole tree)."""
    for p in mesh.routing_schedulers()[:1]:
        text = scrape(f"http://127.0.0.1:{mesh.metrics_ports[p.name]}/metrics")
        out = {}
        for metric in TREE_METRICS:
            v = metric_sum(text, metric)
            if v is not None:
                out[metric] = v
        return out
    return {}


def evicted_blocks(mesh: LocalMesh) -> dict[str, float]:
    """Per worker: KV blocks evicted so far (0 while its cache has not filled)."""
    out = {}
    for name, port in mesh.metrics_ports.items():
        if name.startswith("worker"):
            text = scrape(f"http://127.0.0.1:{port}/metrics")
            out[name] = metric_sum(text, EVICTED_METRIC) or 0.0
    return out


def sample(mesh: LocalMesh, t0: float) -> dict:
    procs = {p.name: rss_kib(p.pid) for p in mesh.infra + mesh.services if p.proc is not None}
    return {"t_s": round(time.monotonic() - t0, 1), "rss_kib": procs, "tree": tree_size(mesh),
            "evicted_blocks": evicted_blocks(mesh)}


def warmup_end(samples: list[dict], warmup: str, settle_s: float) -> float | None:
    """Start of the measured window: a fixed time, or with ``auto`` the earlier of
    ``settle_s`` after the first sample at which every worker has evicted KV blocks (the
    caches are full, the tree only follows evictions from then on), and the first sample
    at which some worker has evicted and the tree grew under 1 % over the last
    ``settle_s`` (a worker whose share of the prefixes fits its cache never evicts).
    None while neither has happened."""
    if warmup != "auto":
        return float(warmup)
    tokens = "prefixmesh_scheduler_tree_tokens"
    for s in samples:
        ev = s["evicted_blocks"]
        if ev and all(v > 0 for v in ev.values()):
            return s["t_s"] + settle_s
        now = s["tree"].get(tokens)
        before = [p["tree"].get(tokens) for p in samples if p["t_s"] <= s["t_s"] - settle_s]
        if (any(v > 0 for v in ev.values()) and now and before and before[-1]
                and now < 1.01 * before[-1]):
            return s["t_s"]
    return None


def growth(samples: list[dict], start_s: float) -> dict[str, dict[str, float]]:
    """Per series, over the samples from ``start_s`` on: growth (last - first) / first and
    peak (max - first) / first."""
    after = [s for s in samples if s["t_s"] >= start_s]
    if len(after) < 2:
        return {}
    out = {}
    for kind in ("rss_kib", "tree"):
        for name, v0 in after[0][kind].items():
            series = [s[kind].get(name) for s in after]
            series = [v for v in series if v is not None]
            if v0 and len(series) >= 2:
                out[f"{kind}:{name}"] = {"growth": round((series[-1] - v0) / v0, 4),
                                         "peak": round((max(series) - v0) / v0, 4),
                                         "first": v0, "last": series[-1]}
    return out


def run_bench(mesh: LocalMesh, workload: str, rate: float, duration: float, out: Path,
              seed: int) -> ManagedProcess:
    bench = ManagedProcess(out.stem, [
        sys.executable, "-m", "prefixmesh.services.cli", "bench", "--url", mesh.url,
        "--workload", workload,
        "--rate", str(rate), "--duration", str(duration), "--seed", str(seed), "--no-progress",
        "--json", str(out)], log_path=out.with_suffix(".log"))
    bench.start()
    return bench


def bench_row(path: Path) -> dict | None:
    if not path.exists():
        return None
    runs = json.loads(path.read_text()).get("runs") or []
    return runs[0] if runs else None


def capacity(rows: list[dict], p99_factor: float) -> float | None:
    """Highest rate, below the first that misses, with nothing failed and a p99 within
    ``p99_factor`` x the lowest rate's."""
    rows = sorted(rows, key=lambda r: r["rate"])
    if not rows:
        return None
    base = rows[0]["latency_p99_s"]
    best = None
    for r in rows:
        if r["failed"] or r["latency_p99_s"] > p99_factor * base:
            break
        best = r["rate"]
    return best


def measure_capacity(mesh: LocalMesh, a: argparse.Namespace) -> tuple[float | None, list[dict]]:
    rows = []
    for rate in a.capacity_rates:
        out = mesh.log_dir / f"capacity-{rate:g}.json"
        bench = run_bench(mesh, a.workload, rate, a.capacity_duration, out, a.seed + 1)
        while bench.alive():
            time.sleep(0.5)
        row = bench_row(out)
        if row is None:
            print(f"capacity: bench at {rate:g} req/s wrote no result; "
                  f"see {out.with_suffix('.log')}")
            break
        rows.append(row)
        print(f"capacity: {rate:g} req/s -> p99 {row['latency_p99_s']:.3f} s, "
              f"failed {row['failed']}", flush=True)
        if capacity(rows, a.capacity_p99_factor) != rate:
            break  # past the knee: higher rates only take longer
    return capacity(rows, a.capacity_p99_factor), rows


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive numbers, e.g. 4,8,12")
    return sorted(rates)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.soak",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, help="bench request rate (req/s); default: "
                   "--load-fraction of the capacity measured over --capacity-rates")
    p.add_argument("--capacity-rates", type=parse_rates, default=None,
                   help="rates to measure the capacity at, e.g. 4,8,12,16")
    p.add_argument("--capacity-duration", type=float, default=40.0,
                   help="seconds of load per capacity rate")
    p.add_argument("--capacity-p99-factor", type=float, default=2.0,
                   help="a rate is within capacity while its p99 is at most this times "
                   "the lowest rate's")
    p.add_argument("--load-fraction", type=float, default=0.8,
                   help="soak rate as a fraction of the measured capacity")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of soak load")
    p.add_argument("--warmup", default="auto", help="'auto' (until every worker's KV cache "
                   "has filled, plus --settle) or seconds")
    p.add_argument("--settle", type=float, default=180.0,
                   help="auto warm-up: seconds after the caches fill (one scheduler window)")
    p.add_argument("--min-window", type=float, default=300.0,
                   help="fewest seconds of measurement after warm-up for a verdict")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--workers", type=int, default=4, help="sim workers")
    p.add_argument("--workload", default="toolbench", help="prefixmesh bench workload")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--json", type=Path, required=True, help="write the samples here")
    a = p.parse_args(argv)
    if a.rate is None and not a.capacity_rates:
        p.error("give --rate or --capacity-rates")
    if a.warmup != "auto":
        try:
            float(a.warmup)
        except ValueError:
            p.error("--warmup must be 'auto' or a number of seconds")
    opts = MeshOptions(workers=a.workers, port=0, metrics_port=0,
                       nats_url=f"nats://127.0.0.1:{free_port()}",
                       redis_url=f"redis://127.0.0.1:{free_port()}/0", subject_prefix="soak",
                       log_level="WARNING")
    samples: list[dict] = []
    result: dict = {"workers": a.workers, "workload": a.workload, "duration_s": a.duration,
                    "warmup": a.warmup, "settle_s": a.settle}
    with LocalMesh(opts) as mesh:
        result["log_dir"] = str(mesh.log_dir)
        rate = a.rate
        if rate is None:
            cap, rows = measure_capacity(mesh, a)
            result["capacity"] = {"rate": cap, "p99_factor": a.capacity_p99_factor,
                                  "duration_s": a.capacity_duration, "runs": rows}
            if cap is None:
                print("capacity: not even the lowest rate was within bounds; lower the rates")
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps(result, indent=2) + "\n")
                return 1
            rate = round(a.load_fraction * cap, 3)
            print(f"capacity {cap:g} req/s; soaking at {rate:g} req/s", flush=True)
        result["rate"] = rate
        bench_json = mesh.log_dir / "bench.json"
        t0 = time.monotonic()
        bench = run_bench(mesh, a.workload, rate, a.duration, bench_json, a.seed)
        try:
            while bench.alive():
                samples.append(sample(mesh, t0))
                print(json.dumps(samples[-1]), flush=True)
                deadline = time.monotonic() + a.interval
                while bench.alive() and time.monotonic() < deadline:
                    time.sleep(0.5)
            samples.append(sample(mesh, t0))
        finally:
            bench.stop()
        result["bench_exit"] = bench.proc.returncode if bench.proc else None
        result["bench"] = bench_row(bench_json)
    start = warmup_end(samples, a.warmup, a.settle)
    window = samples[-1]["t_s"] - start if start is not None and samples else 0.0
    result.update(warmup_end_s=start, window_s=round(window, 1),
                  growth=growth(samples, start) if start is not None else {}, samples=samples)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    failed = (result["bench"] or {}).get("failed", 1)
    if start is None or window < a.min_window:
        print(f"no verdict: warm-up ended at {start} s, leaving {window:.0f} s "
              f"(need {a.min_window:g}); {a.json}")
        return 1
    worst = max((g["peak"] for g in result["growth"].values()), default=0.0)
    print(f"warm-up ended at {start:.0f} s; max peak growth over {window:.0f} s: {worst:.1%} "
          f"(limit {MAX_GROWTH:.0%}); failed requests: {failed}; {a.json}")
    return 0 if worst < MAX_GROWTH and failed == 0 and result["bench_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
