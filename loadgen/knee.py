"""Read sweep results the way Preble's figures are read: at the baseline's knee, and by SLO.

``python -m prefixmesh.loadgen.knee RESULTS.json... [--baseline round_robin] [--low 2] [--high 5]``
prints, for each (workload, GPUs) panel, the baseline's low-load p99 (its p99 at the lowest
swept rate), every swept rate where the baseline's p99 is between ``low`` and ``high`` times
that (the knee window), and at those rates each policy's average and p99 latency with the
baseline's divided by it (> 1: the policy is that many times lower). The *knee* is the
highest rate in the window: the last point before the baseline's tail goes vertical.

``--slo S`` instead prints, per panel and policy, the highest swept rate whose p99 is at
most ``S`` seconds with no failed request (the max rate under a p99 SLO).

Rows are keyed by policy label and local policy; a run with failed (unfinished) requests
is marked, because its latency figures cover only the requests that completed.

Several seeds of the same point (rows with different ``seed``, e.g. one file per
``prefixmesh sim --seed S``) are combined: average, p99 and hit ratio are the means over
the seeds (failed: the sum), the window and ratios are read from those means, and the
tables add each seed's p99 and in how many seeds the policy had the lowest p99 of the
point. A rate counts only for the policies that ran every seed the baseline ran there.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.loadgen.report import load_runs

Panel = tuple[str, int]


def _key(r: dict) -> str:
    local = r.get("local_policy")
    return f"{r['policy']}/{local}" if local else str(r["policy"])


def combine(by_seed: dict) -> dict:
    """One row standing for several seeds' rows of one point (means; failed summed)."""
    rows = [by_seed[k] for k in sorted(by_seed, key=str)]
    if len(rows) == 1:
        return rows[0]
    n = len(rows)
    out = dict(rows[0])
    for f in ("latency_avg_s", "latency_p99_s", "cache_hit_ratio"):
        out[f] = sum(r[f] for r in rows) / n
    out["failed"] = sum(r["failed"] for r in rows)
    out["seeds"] = [r.get("seed") for r in rows]
    out["p99_by_seed"] = [r["latency_p99_s"] for r in rows]
    return out


def panels(runs: Sequence[dict]) -> dict[Panel, dict[str, dict[float, dict]]]:
    """(workload, gpus) -> policy key -> rate -> row; rows of several seeds of one point
    are combined (``combine``); the last row wins on duplicates of one seed."""
    raw: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in runs:
        raw[(str(r["workload"]), int(r["gpus"]))][_key(r)][float(r["rate"])][r.get("seed")] = r
    out: dict[Panel, dict[str, dict[float, dict]]] = defaultdict(lambda: defaultdict(dict))
    for panel, by_policy in raw.items():
        for k, by_rate in by_policy.items():
            for rate, by_seed in by_rate.items():
                out[panel][k][rate] = combine(by_seed)
    return out


def _lowest_counts(rows: Sequence[tuple[str, dict]]) -> dict[str, int]:
    """Per policy key: in how many seeds its p99 was the lowest of ``rows``."""
    seeds = rows[0][1].get("seeds") or []
    wins = dict.fromkeys((k for k, _ in rows), 0)
    for i in range(len(seeds)):
        best = min(rows, key=lambda kr: kr[1]["p99_by_seed"][i])
        wins[best[0]] += 1
    return wins


def knee_window(curve: dict[float, dict], low: float, high: float) -> tuple[float, list[float]]:
    """The baseline's low-load p99 and the rates whose p99 is in [low, high] x it."""
    rates = sorted(curve)
    base = curve[rates[0]]["latency_p99_s"]
    inside = [x for x in rates
              if low * base <= curve[x]["latency_p99_s"] <= high * base
              and not curve[x]["failed"]]
    return base, inside


def max_rate_under(curve: dict[float, dict], slo_s: float) -> float | None:
    """Highest rate with p99 <= slo_s and nothing failed, below the first rate that misses."""
    best = None
    for x in sorted(curve):
        r = curve[x]
        if r["failed"] or r["latency_p99_s"] > slo_s:
            break
        best = x
    return best


def knee_report(runs: Sequence[dict], baseline: str, low: float, high: float) -> str:
    """Markdown: per panel, the knee window and every policy against the baseline there."""
    out: list[str] = []
    for (workload, gpus), by_policy in panels(runs).items():
        base_key = next((k for k in by_policy if k.split("/")[0] == baseline), None)
        if base_key is None:
            out.append(f"### {workload}, {gpus} GPUs: no {baseline} runs\n")
            continue
        curve = by_policy[base_key]
        lo_p99, window = knee_window(curve, low, high)
        lo_rate = min(curve)
        out.append(f"### {workload}, {gpus} GPUs\n")
        out.append(f"{base_key} p99 at {lo_rate:g} req/s (low load): {lo_p99:.3f} s; "
                   f"rates with p99 in [{low:g}x, {high:g}x] of it: "
                   f"{', '.join(f'{x:g}' for x in window) or 'none'}"
                   + (f"; knee = {window[-1]:g} req/s" if window else "") + "\n")
        for rate in window:
            b = curve[rate]
            seeds = b.get("seeds")
            rows = [(k, c[rate]) for k, c in by_policy.items()
                    if rate in c and c[rate].get("seeds") == seeds]
            out.append(f"rate {rate:g} req/s"
                       + (f", mean of seeds {', '.join(map(str, seeds))}" if seeds else "")
                       + ":\n")
            extra = " p99 s by seed | lowest p99 in seeds |" if seeds else ""
            out.append("| policy | avg s | p99 s | hit | failed | avg x (base/policy) "
                       "| p99 x (base/policy) |" + extra)
            out.append("|---|---|---|---|---|---|---|" + ("---|---|" if seeds else ""))
            wins = _lowest_counts(rows) if seeds else {}
            for k, r in sorted(rows, key=lambda kr: kr[1]["latency_p99_s"]):
                avg_x = b["latency_avg_s"] / r["latency_avg_s"] if r["latency_avg_s"] else 0
                p99_x = b["latency_p99_s"] / r["latency_p99_s"] if r["latency_p99_s"] else 0
                line = (f"| {k} | {r['latency_avg_s']:.3f} | {r['latency_p99_s']:.3f} | "
                        f"{r['cache_hit_ratio']:.1%} | {r['failed']} | {avg_x:.2f} | "
                        f"{p99_x:.2f} |")
                if seeds:
                    line += (f" {' / '.join(f'{x:.2f}' for x in r['p99_by_seed'])} | "
                             f"{wins[k]} of {len(seeds)} |")
                out.append(line)
            out.append("")
    return "\n".join(out)


def slo_report(runs: Sequence[dict], slo_s: float) -> str:
    """Markdown: per panel and policy, the max swept rate under a p99 SLO."""
    out = [f"| workload | GPUs | policy | max rate with p99 <= {slo_s:g} s | rates swept |",
           "|---|---|---|---|---|"]
    for (workload, gpus), by_policy in panels(runs).items():
        for k, curve in by_policy.items():
            best = max_rate_under(curve, slo_s)
            knee = f"below {min(curve):g}" if best is None else f"{best:g}"
            out.append(f"| {workload} | {gpus} | {k} | {knee}"
                       f" | {', '.join(f'{x:g}' for x in sorted(curve))} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.knee",
                                description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--baseline", default="round_robin", help="policy whose knee is used")
    p.add_argument("--low", type=float, default=2.0, help="knee window: p99 from this x ...")
    p.add_argument("--high", type=float, default=5.0, help="... to this x the low-load p99")
    p.add_argument("--slo", type=float, default=None,
                   help="print the max rate under this p99 (seconds) instead")
    p.add_argument("--policies", default=None,
                   help="only rows whose policy label is one of these (';'-separated, since "
                   "labels with knobs contain commas)")
    args = p.parse_args(argv)
    runs = load_runs(args.results)
    if args.policies:
        keep = set(args.policies.split(";"))
        runs = [r for r in runs if r["policy"] in keep]
    print(slo_report(runs, args.slo) if args.slo else knee_report(runs, args.baseline,
                                                                    args.low, args.high))
    return 0


if __name__ == "__main__":
    sys.exit(main())
