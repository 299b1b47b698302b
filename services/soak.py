"""Soak run: the whole mesh under steady ``prefixmesh bench`` load, sampled for growth.

``python -m services.soak --rate R --duration 1800 --json results/soak.json`` starts a
local mesh (``LocalMesh``, its own nats-server and redis-server on free ports), runs
``prefixmesh bench`` against it for ``--duration`` seconds at ``--rate`` requests/s (80 % of
the measured capacity, docs/reliability.md), and every ``--interval`` seconds samples the
resident memory (VmRSS) of every service process and the active scheduler's prefix-tree
size (``prefixmesh_scheduler_tree_nodes`` / ``_tree_tokens``). The JSON holds every sample
and, per series, the growth from the first to the last sample after ``--warmup`` seconds
(the contract: under 10 %).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

from services.up import LocalMesh, MeshOptions
from shared.servers import ManagedProcess, free_port

# Growth allowed after warm-up (fraction) before the run is reported as failing.
MAX_GROWTH = 0.10
TREE_METRICS = ("prefixmesh_scheduler_tree_nodes", "prefixmesh_scheduler_tree_tokens")


def rss_kib(pid: int) -> int | None:
    """Resident memory of a process in KiB (Linux /proc), None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read().decode()
    except OSError:
        return ""


def tree_size(mesh: LocalMesh) -> dict[str, float]:
    """Tree gauges of the scheduler that holds the lease."""
    for name, port in mesh.metrics_ports.items():
        if not name.startswith("scheduler"):
            continue
        text = scrape(f"http://127.0.0.1:{port}/metrics")
        if not re.search(r"^prefixmesh_scheduler_active 1(\.0)?$", text, re.MULTILINE):
            continue
        out = {}
        for metric in TREE_METRICS:
            m = re.search(rf"^{metric} (\S+)$", text, re.MULTILINE)
            if m:
                out[metric] = float(m.group(1))
        return out
    return {}


def sample(mesh: LocalMesh, t0: float) -> dict:
    procs = {p.name: rss_kib(p.pid) for p in mesh.infra + mesh.services if p.proc is not None}
    return {"t_s": round(time.monotonic() - t0, 1), "rss_kib": procs, "tree": tree_size(mesh)}


def growth(samples: list[dict], warmup_s: float) -> dict[str, float]:
    """Per series: (last - first) / first over the samples taken after warm-up."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2:
        return {}
    first, last = after[0], after[-1]
    out = {}
    for kind in ("rss_kib", "tree"):
        for name, v0 in first[kind].items():
            v1 = last[kind].get(name)
            if v0 and v1 is not None:
                out[f"{kind}:{name}"] = round((v1 - v0) / v0, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.soak", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, required=True, help="bench request rate (req/s)")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=300.0,
                   help="seconds before growth is measured")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--workers", type=int, default=4, help="sim workers")
    p.add_argument("--workload", default="toolbench", help="prefixmesh bench workload")
    p.add_argument("--json", type=Path, required=True, help="write the samples here")
    a = p.parse_args(argv)
    opts = MeshOptions(workers=a.workers, port=0, metrics_port=0,
                       nats_url=f"nats://127.0.0.1:{free_port()}",
                       redis_url=f"redis://127.0.0.1:{free_port()}/0", subject_prefix="soak",
                       log_level="WARNING")
    samples: list[dict] = []
    with LocalMesh(opts) as mesh:
        bench_json = mesh.log_dir / "bench.json"
        bench = ManagedProcess("bench", [
            sys.executable, "-m", "services.cli", "bench", "--url", mesh.url,
            "--workload", a.workload, "--rate", str(a.rate), "--duration", str(a.duration),
            "--no-progress", "--json", str(bench_json)], log_path=mesh.log_dir / "bench.log")
        t0 = time.monotonic()
        bench.start()
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
        result = {"rate": a.rate, "duration_s": a.duration, "warmup_s": a.warmup,
                  "workers": a.workers, "workload": a.workload,
                  "bench_exit": bench.proc.returncode, "log_dir": str(mesh.log_dir),
                  "bench": json.loads(bench_json.read_text()) if bench_json.exists() else None,
                  "growth": growth(samples, a.warmup), "samples": samples}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    worst = max(result["growth"].values(), default=0.0)
    print(f"max growth after warm-up: {worst:.1%} (limit {MAX_GROWTH:.0%}); {a.json}")
    return 0 if worst < MAX_GROWTH and result["bench_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
