"""Read sweep results the way Preble's figures are read: at the baseline's knee, and by SLO.

``python -m loadgen.knee RESULTS.json... [--baseline round_robin] [--low 2] [--high 5]``
prints, for each (workload, GPUs) panel, the baseline's low-load p99 (its p99 at the lowest
swept rate), every swept rate where the baseline's p99 is between ``low`` and ``high`` times
that (the knee window), and at those rates each policy's average and p99 latency with the
baseline's divided by it (> 1: the policy is that many times lower). The *knee* is the
highest rate in the window: the last point before the baseline's tail goes vertical.

``--slo S`` instead prints, per panel and policy, the highest swept rate whose p99 is at
most ``S`` seconds with no failed request (the max rate under a p99 SLO).

Rows are keyed by policy label and local policy; a run with failed (unfinished) requests
is marked, because its latency figures cover only the requests that completed.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from loadgen.report import load_runs

Panel = tuple[str, int]


def _key(r: dict) -> str:
    local = r.get("local_policy")
    return f"{r['policy']}/{local}" if local else str(r["policy"])


def panels(runs: Sequence[dict]) -> dict[Panel, dict[str, dict[float, dict]]]:
    """(workload, gpus) -> policy key -> rate -> row (the last row wins on duplicates)."""
    out: dict[Panel, dict[str, dict[float, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in runs:
        out[(str(r["workload"]), int(r["gpus"]))][_key(r)][float(r["rate"])] = r
    return out


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
            out.append(f"rate {rate:g} req/s:\n")
            out.append("| policy | avg s | p99 s | hit | failed | avg x (base/policy) "
                       "| p99 x (base/policy) |")
            out.append("|---|---|---|---|---|---|---|")
            rows = [(k, c[rate]) for k, c in by_policy.items() if rate in c]
            for k, r in sorted(rows, key=lambda kr: kr[1]["latency_p99_s"]):
                avg_x = b["latency_avg_s"] / r["latency_avg_s"] if r["latency_avg_s"] else 0
                p99_x = b["latency_p99_s"] / r["latency_p99_s"] if r["latency_p99_s"] else 0
                out.append(f"| {k} | {r['latency_avg_s']:.3f} | {r['latency_p99_s']:.3f} | "
                           f"{r['cache_hit_ratio']:.1%} | {r['failed']} | {avg_x:.2f} | "
                           f"{p99_x:.2f} |")
            out.append("")
    return "\n".join(out)


def slo_report(runs: Sequence[dict], slo_s: float) -> str:
    """Markdown: per panel and policy, the max swept rate under a p99 SLO."""
    out = [f"| workload | GPUs | policy | max rate with p99 <= {slo_s:g} s | rates swept |",
           "|---|---|---|---|---|"]
    for (workload, gpus), by_policy in panels(runs).items():
        for k, curve in by_policy.items():
            best = max_rate_under(curve, slo_s)
            out.append(f"| {workload} | {gpus} | {k} | "
                       f"{'below ' + format(min(curve), 'g') if best is None else format(best, 'g')}"
                       f" | {', '.join(f'{x:g}' for x in sorted(curve))} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.knee", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--baseline", default="round_robin", help="policy whose knee is used")
    p.add_argument("--low", type=float, default=2.0, help="knee window: p99 from this x ...")
    p.add_argument("--high", type=float, default=5.0, help="... to this x the low-load p99")
    p.add_argument("--slo", type=float, default=None,
                   help="print the max rate under this p99 (seconds) instead")
    args = p.parse_args(argv)
    runs = load_runs(args.results)
    print(slo_report(runs, args.slo) if args.slo else knee_report(runs, args.baseline,
                                                                    args.low, args.high))
    return 0


if __name__ == "__main__":
    sys.exit(main())
