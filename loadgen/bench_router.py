"""``prefixmesh bench-router``: closed-loop capacity and latency of the router path.

prefixmesh's mesh, sglang-router and no router at all (``direct``: the client spreads its
requests over the workers itself) in front of the very same standalone simulated GPU
workers, in one run. The HTTP routers are started once and stay up; a prefixmesh mesh is
started for its turn and stopped after it (meshes on the same workers would share their
subjects, and every scheduler would answer every edge). For each repeat, each contender,
in an order rotated per repeat so that other load on the machine spreads over all of
them, and each concurrency, ``--concurrency`` clients run a closed loop: each sends a
one-token completion of a short text prompt of its own (the loop's number and its own
first: nothing is shared, within a loop or with an earlier one, so cache affinity plays no
part) and the next one as soon as the answer is in.
After ``--warmup`` seconds, ``--duration`` seconds are measured. Before the first repeat,
one unmeasured round at the highest concurrency goes straight to the workers and one
through each HTTP router (fresh processes run their first rounds slower).

Each row: completed requests per second (``req_per_s``, the capacity at that
concurrency), latency p50 / p99 / mean from the client's send to the last byte, the
workers' own mean (arrival to last token, their ``/metrics``: the rest of the mean is the
path through the router and the client, both ways), of which the wait for a step to start
(``worker_queue_ms``), the steps' mean length and requests per step, each worker's share
of the requests and, through the mesh, the mean from
the edge sending a request to its arrival at the worker, the CPU
milliseconds every part used per completed request (``/proc``; workers, NATS, each
contender's processes, the client), how busy the machine's CPUs were, and the 1-minute
load average (other jobs on a shared machine show there). ``summary`` averages the
repeats and gives each contender's req/s over the reference's (``--reference``,
``sglang-cache_aware`` by default; ``prefixmesh-round_robin`` also over
``sglang-round_robin``: the same placement, so the path alone differs).

``--edges 1,2`` runs every prefixmesh contender once per number of edge processes
(sharing one port, ``prefixmesh up --shared-port``: one address, as a router's threads
share one), rows named ``CONTENDER (N edges)`` above one.

``--baseline DIR`` runs every prefixmesh contender a second time from other code: DIR
holds a ``prefixmesh`` package laid out as installed (``prefixmesh/services``, ``shared``,
``loadgen``: an older checkout's folders, linked), put first on the services' PYTHONPATH;
those rows are named ``CONTENDER (baseline)``, in front of the same workers.

The workers are the sim backend at time scale 1: a step lasts its modelled GPU time
(``mistral-7b-a6000``: 22 ms at least), so ``direct`` is the most these workers do on this
machine at that concurrency, and a router's shortfall from it is what its path costs.
``--worker-nice N`` runs the workers at that niceness, below the routers, the client and
NATS: on a machine of few cores the simulated GPUs' own Python otherwise takes turns on
the cores with the router path, which on a real host runs on cores of its own while the
GPUs do the engines' work. Every contender meets the same workers either way.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvloop

from prefixmesh.loadgen.compare import (
    Contender,
    Running,
    WorkerGroup,
    _model_id,
    available,
    start_contender,
    versions,
)
from prefixmesh.loadgen.options import parse_names
from prefixmesh.loadgen.procstat import CpuMeter
from prefixmesh.loadgen.results import percentile
from prefixmesh.shared.runtime.servers import ManagedProcess, start_nats, start_redis

DIRECT = "direct"
DEFAULT_CONTENDERS = ("prefixmesh-e2,prefixmesh-round_robin,sglang-cache_aware,"
                      "sglang-round_robin,direct")
DEFAULT_REFERENCE = "sglang-cache_aware"
# What a row says of the workers' steps: the wait for one, their length, requests in each.
WORKER_STEPS = ("worker_queue_ms", "step_ms", "requests_per_step")
# Pairs whose ratio isolates the path: the same placement policy on both sides.
SAME_POLICY = {"prefixmesh-round_robin": "sglang-round_robin"}
# Each request's prompt: the closed loop's number and its own first, so no two requests
# of a run share a prefix block: not within a loop, nor across loops (every contender's
# repeats and warm-up meet the same workers, whose KV caches and a router's own history
# still hold the earlier loops' prompts: numbered from 0 in each loop, those came back as
# cache hits, routed to wherever the earlier loop had sent them).
PROMPT = "{loop}.{n}: measure the router path with a short prompt that nobody shares."
# The workers' local queue policy: vLLM's own order, as `prefixmesh compare` uses.
LOCAL_POLICY = "fcfs"
SUBJECT_PREFIX = "benchrouter"
REQUEST_TIMEOUT_S = 60.0
# Seconds after start for every contender to have heard the workers' load reports.
SETTLE_S = 2.0
# Closed loops run so far in this process (each numbers its prompts anew).
_LOOPS = itertools.count()


def prompt_text(loop: int, n: int) -> str:
    """The prompt of request ``n`` of closed loop ``loop``."""
    return PROMPT.format(loop=loop, n=n)


@dataclass
class Point:
    """What one closed-loop run saw in its measured window."""

    latencies: list[float]
    errors: int


async def closed_loop(urls: Sequence[str], model: str, concurrency: int, warmup_s: float,
                      duration_s: float) -> Point:
    """``concurrency`` clients, each sending the next one-token completion as soon as the
    last one is answered, to ``urls`` in turn; the requests sent within the measured
    window count."""
    counter, loop = itertools.count(), next(_LOOPS)
    point = Point([], 0)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        t_from, t_to = start + warmup_s, start + warmup_s + duration_s

        async def client() -> None:
            while True:
                n = next(counter)
                t0 = time.perf_counter()
                if t0 >= t_to:
                    return
                body = {"model": model, "prompt": prompt_text(loop, n), "max_tokens": 1,
                        "temperature": 0.0}
                try:
                    async with session.post(urls[n % len(urls)] + "/v1/completions",
                                            json=body) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if t0 >= t_from:
                    if ok:
                        point.latencies.append(time.perf_counter() - t0)
                    else:
                        point.errors += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return point


def measure(name: str, urls: Sequence[str], model: str, concurrency: int,
            args: argparse.Namespace, pids: dict[str, list[int]],
            group: WorkerGroup) -> dict:
    """One point: the closed loop, and the CPU every part used meanwhile."""
    meter = CpuMeter(pids)
    before = group.timings()
    t0 = time.perf_counter()
    point = uvloop.run(closed_loop(urls, model, concurrency, args.warmup, args.duration))
    wall = time.perf_counter() - t0
    cpu = meter.read()
    t = {k: v - before[k] for k, v in group.timings().items()}
    lat = sorted(point.latencies)
    n = len(lat)
    # The CPU was read over warm-up and window alike: per request of the whole loop.
    served = n * (args.warmup + args.duration) / args.duration
    return {
        "contender": name, "concurrency": concurrency, "requests": n, "errors": point.errors,
        "req_per_s": round(n / args.duration, 1),
        "p50_ms": round(percentile(lat, 50) * 1e3, 2),
        "p99_ms": round(percentile(lat, 99) * 1e3, 2),
        "mean_ms": round(statistics.fmean(lat) * 1e3, 2) if lat else 0.0,
        # Over the whole loop (warm-up too): the mean in the workers, arrival to last token,
        # and the mesh's path from its edge to the worker (none through an HTTP router).
        "worker_mean_ms": round(t["latency_sum"] / max(t["latency_count"], 1) * 1e3, 2),
        "edge_to_worker_ms": (round(t["arrival_sum"] / t["arrival_count"] * 1e3, 2)
                              if t["arrival_count"] else None),
        # Where the time in the workers went, and where the requests went: the wait for
        # a step, the steps' mean length and requests per step, each worker's share.
        "worker_queue_ms": round(t["queue_sum"] / max(t["queue_count"], 1) * 1e3, 2),
        "step_ms": round(t["step_sum"] / max(t["step_count"], 1) * 1e3, 2),
        "requests_per_step": round(t["latency_count"] / max(t["step_count"], 1), 2),
        "worker_shares": shares([v for k, v in t.items() if k.startswith("requests@")]),
        "cpu_ms_per_request": {k: round(v / max(served, 1) * 1e3, 3) for k, v in cpu.items()},
        "cpus_busy": round(sum(cpu.values()) / wall, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def shares(counts: Sequence[float]) -> list[float]:
    """Each worker's part of the requests (fractions, in worker order)."""
    total = sum(counts)
    return [round(c / total, 3) if total else 0.0 for c in counts]


def renice(pids: Sequence[int], nice: int) -> None:
    """Run the processes ``pids`` at niceness ``nice`` (0: leave them as they are)."""
    if nice:
        for pid in pids:
            os.setpriority(os.PRIO_PROCESS, pid, nice)


def summarize(rows: Sequence[dict], reference: str) -> list[dict]:
    """Per contender and concurrency: the repeats' mean req/s, p50, p99 and load, and the
    ratio of req/s to the reference's (and, for a same-policy pair, to its peer's): of the
    means, and (``_each``, ``_median``) within each repeat, where the two ran minutes
    apart at most: a burst of other load on the machine moves one repeat's ratio, not
    the median."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["contender"], r["concurrency"]), []).append(r)
    means = {k: statistics.fmean(r["req_per_s"] for r in v) for k, v in groups.items()}
    per_repeat = {(r["contender"], r["concurrency"], r["repeat"]): r["req_per_s"]
                  for r in rows if "repeat" in r}
    out = []
    for (name, conc), rs in groups.items():
        row = {"contender": name, "concurrency": conc, "repeats": len(rs),
               "req_per_s": round(means[(name, conc)], 1),
               "req_per_s_each": [r["req_per_s"] for r in rs],
               "p50_ms": round(statistics.fmean(r["p50_ms"] for r in rs), 2),
               "p99_ms": round(statistics.fmean(r["p99_ms"] for r in rs), 2),
               "mean_ms": round(statistics.fmean(r["mean_ms"] for r in rs), 2),
               "worker_mean_ms": round(statistics.fmean(r["worker_mean_ms"] for r in rs), 2),
               **{k: round(statistics.fmean(r[k] for r in rs), 2)
                  for k in WORKER_STEPS if all(k in r for r in rs)},
               "loadavg_1m": round(statistics.fmean(r["loadavg_1m"] for r in rs), 2)}
        for label, other in (("vs_reference", reference), ("vs_same_policy",
                                                           SAME_POLICY.get(name, ""))):
            if (other, conc) in means and other != name:
                row[label] = round(means[(name, conc)] / means[(other, conc)], 3)
                each = [r["req_per_s"] / theirs for r in rs if "repeat" in r
                        and (theirs := per_repeat.get((other, conc, r["repeat"])))]
                if each:
                    row[label + "_each"] = [round(x, 3) for x in each]
                    row[label + "_median"] = round(statistics.median(each), 3)
        paths = [r["edge_to_worker_ms"] for r in rs if r.get("edge_to_worker_ms") is not None]
        if paths:
            row["edge_to_worker_ms"] = round(statistics.fmean(paths), 2)
        out.append(row)
    return sorted(out, key=lambda r: (r["concurrency"], r["contender"]))


def markdown(summary: Sequence[dict], reference: str) -> str:
    """The summary as a markdown table."""
    lines = [f"| concurrency | contender | req/s (each repeat) | p50 ms | p99 ms | mean ms | "
             f"in workers ms | step wait ms | per step | edge to worker ms | vs {reference} | "
             f"vs same policy | load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        each = ", ".join(f"{x:,.0f}" for x in r["req_per_s_each"])
        ratios = [(f"{r[k]:.2f}x" + (f"; median {r[k + '_median']:.2f}x"
                                     if k + "_median" in r else "")) if k in r else ""
                  for k in ("vs_reference", "vs_same_policy")]
        path = f"{r['edge_to_worker_ms']:.1f}" if "edge_to_worker_ms" in r else ""
        wait, per_step = (f"{r[k]:.{d}f}" if k in r else ""
                          for k, d in (("worker_queue_ms", 1), ("requests_per_step", 2)))
        lines.append(f"| {r['concurrency']} | {r['contender']} | {r['req_per_s']:,.0f} ({each}) "
                     f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['mean_ms']:.1f} "
                     f"| {r['worker_mean_ms']:.1f} | {wait} | {per_step} | {path} "
                     f"| {ratios[0]} | {ratios[1]} | {r['loadavg_1m']:.1f} |")
    return "\n".join(lines) + "\n"


def runs_of(names: Sequence[str], contenders: dict[str, Contender], edge_counts: Sequence[int],
            baseline: Path | None) -> dict[str, tuple[Contender, dict[str, str], int]]:
    """Label -> (contender, extra environment of its services, edge processes), in the
    order given: each prefixmesh contender once per number of edges and, with a
    baseline, once more per number from that code."""
    out: dict[str, tuple[Contender, dict[str, str], int]] = {}
    for n in names:
        c = contenders.get(n)
        if c is None:  # direct
            continue
        if c.family != "prefixmesh":
            out[n] = (c, {}, 1)
            continue
        codes: list[tuple[str, dict[str, str]]] = [("", {})]
        if baseline is not None:
            codes.append((" (baseline)", {"PYTHONPATH": str(baseline.resolve())}))
        for suffix, env in codes:
            for edges in edge_counts:
                out[n + (f" ({edges} edges)" if edges > 1 else "") + suffix] = (c, env, edges)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixmesh bench-router", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Closed-loop capacity (requests/s) and latency of prefixmesh, "
        "sglang-router and direct-to-worker in front of the same simulated GPU workers, "
        "interleaved in one run: one-token requests of short unshared prompts. Writes JSON "
        "(rows and a summary) and a markdown table beside it.")
    p.add_argument("--workers", type=int, default=4, help="simulated GPU workers")
    p.add_argument("--concurrency", default="16,64,100",
                   help="comma-separated numbers of closed-loop clients")
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                   help="comma-separated: prefixmesh-POLICY, sglang-POLICY, vllm-POLICY, "
                   "direct (the client spreads requests over the workers itself)")
    p.add_argument("--reference", default=DEFAULT_REFERENCE,
                   help="the contender every summary row's req/s is divided by")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    p.add_argument("--repeats", type=int, default=3, help="rounds over every point")
    p.add_argument("--profile", default="mistral-7b-a6000", help="cost-model profile")
    p.add_argument("--edges", default="1",
                   help="comma-separated numbers of edge processes to run each prefixmesh "
                   "contender with (sharing one port)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="also run each prefixmesh contender from the prefixmesh package in "
                   "this folder (before/after in one run)")
    p.add_argument("--worker-nice", type=int, default=0, choices=range(0, 20), metavar="0-19",
                   help="niceness of the simulated GPU workers (above 0: the router path, "
                   "the client and NATS go first on a machine of few cores)")
    p.add_argument("--json", type=Path, required=True, help="results JSON (.md beside)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        concurrencies = [int(c) for c in parse_names(args.concurrency)]
    except ValueError:
        raise SystemExit(f"--concurrency: expected comma-separated integers, got "
                         f"{args.concurrency!r}") from None
    if not concurrencies or min(concurrencies) < 1 or args.repeats < 1 or args.duration <= 0:
        raise SystemExit("--concurrency, --repeats and --duration must be positive")
    if args.workers < 1 or args.warmup < 0:
        raise SystemExit("--workers must be at least 1 and --warmup at least 0")
    names = parse_names(args.contenders)
    contenders = {n: Contender.parse(n) for n in names if n != DIRECT}
    missing = {n: why for n, c in contenders.items() if (why := available(c))}
    if missing:
        raise SystemExit("; ".join(f"{n}: {w}" for n, w in missing.items()))
    try:
        edge_counts = [int(e) for e in parse_names(args.edges)]
    except ValueError:
        edge_counts = []
    if not edge_counts or min(edge_counts) < 1:
        raise SystemExit(f"--edges: expected comma-separated positive integers, got "
                         f"{args.edges!r}")
    if args.baseline is not None and not (args.baseline / "prefixmesh" / "services").is_dir():
        raise SystemExit(f"--baseline {args.baseline}: no prefixmesh/services in it")
    started = runs_of(names, contenders, edge_counts, args.baseline)
    # In the order given, a prefixmesh contender's runs where it was named.
    names = [label for n in names
             for label in ([n] if n == DIRECT else [k for k, r in started.items()
                                                     if r[0].name == n])]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-router-", dir=args.json.parent)) / "logs"
    log_dir.mkdir(parents=True)
    print(f"logs: {log_dir}", file=sys.stderr, flush=True)
    result: dict = {"runs": [], "summary": [], "meta": {
        "command": "prefixmesh bench-router " + " ".join(argv), "versions": versions(),
        "workers": args.workers, "profile": args.profile, "cpus": os.cpu_count(),
        "reference": args.reference, "prompt": PROMPT, "started": time.time(),
        "baseline": str(args.baseline or ""), "edges": edge_counts,
        "worker_nice": args.worker_nice}}
    infra: list[ManagedProcess] = []
    running: list[Running] = []
    try:
        nats, nats_url = start_nats(log_path=log_dir / "nats-server.log")
        infra.append(nats)
        redis, redis_url = start_redis(data_dir=log_dir, log_path=log_dir / "redis-server.log")
        infra.append(redis)
        with WorkerGroup(args.workers, LOCAL_POLICY, args.profile, nats_url, SUBJECT_PREFIX,
                         log_dir) as group:
            model = _model_id(group.urls[0])
            renice([p.pid for p in group.procs], args.worker_nice)
            pids = {"workers": [p.pid for p in group.procs], "nats": [nats.pid]}
            infra_urls = {"nats": nats_url, "redis": redis_url}
            # Routers that talk HTTP only stay up all run; a prefixmesh mesh runs only while
            # it is measured (all meshes would share the workers' subjects, and every
            # scheduler would answer every edge).
            up: dict[str, Running] = {}
            for name, (c, env, _) in started.items():
                if c.family != "prefixmesh":
                    up[name] = start_contender(c, group, infra_urls, len(running), log_dir, env)
                    running.append(up[name])
            time.sleep(SETTLE_S)
            # Fresh workers and routers run their first rounds slower (every contender's
            # first repeat was its slowest, the first one measured most of all): one
            # unmeasured round straight to the workers and one through each router that
            # stays up, at the highest concurrency, before anything is measured. A mesh
            # starts anew for each of its rounds and warms up in each round's --warmup.
            top = max(concurrencies)
            for name, urls in [(DIRECT, group.urls),
                               *((n, [r.url]) for n, r in up.items())]:
                print(f"warming up: {name}, {top} clients, {args.warmup + args.duration:g} s",
                      file=sys.stderr, flush=True)
                uvloop.run(closed_loop(urls, model, top, args.warmup + args.duration, 0.0))
            for rep in range(args.repeats):
                k = rep % len(names)
                for name in names[k:] + names[:k]:
                    mesh = None
                    if name in started and name not in up:
                        c, env, edges = started[name]
                        mesh = start_contender(c, group, infra_urls, len(running), log_dir, env,
                                               edges)
                        running.append(mesh)
                        time.sleep(SETTLE_S)
                    target = up.get(name) or mesh
                    urls = [target.url] if target is not None else group.urls
                    parts = dict(pids, **{f"{name}:{part}": [pid] for part, pid in
                                          (target.pids.items() if target is not None else ())
                                          if part not in ("nats-server", "redis-server")})
                    j = rep % len(concurrencies)
                    for conc in concurrencies[j:] + concurrencies[:j]:
                        row = measure(name, urls, model, conc, args, parts, group)
                        row["repeat"] = rep
                        result["runs"].append(row)
                        print(json.dumps(row), flush=True)
                        args.json.write_text(json.dumps(result, indent=1))
                    if mesh is not None:
                        mesh.stop()
    finally:
        for r in running:
            r.stop()
        for p in reversed(infra):
            p.stop()
    result["summary"] = summarize(result["runs"], args.reference)
    args.json.write_text(json.dumps(result, indent=1))
    md = markdown(result["summary"], args.reference)
    args.json.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
