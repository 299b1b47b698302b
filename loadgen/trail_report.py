"""Read ``prefixmesh sim`` results on TRAIL's questions: how much ``sprpt_limited`` gains
over ``fcfs``, and how much of it its preemption brings.

``python -m prefixmesh.loadgen.trail_report RESULTS.json...`` prints one markdown table per
panel (workload, GPUs, sequence slots, KV blocks): for each swept rate, each variant's mean
latency / mean TTFT in seconds and its preemptions, then ``fcfs``'s mean latency over each
other variant's (> 1: lower than ``fcfs``) and, where a variant also ran with its window at
0 (``VARIANT:preempt_fraction=0``, same predictions), the no-preemption mean over the
variant's (> 1: preemption pays) and the prefill tokens preemption added (recompute).
Variants are keyed by local policy and predictions (``sprpt_limited [oracle]``). Seeds of
the same point (rows with different ``seed``) are averaged; the load is the rate over the
highest ``fcfs`` throughput of the panel (its capacity, when the top rate saturates it).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.loadgen.report import load_runs

NO_PREEMPT = ":preempt_fraction=0"
BASELINE = "fcfs"


def variant(row: dict) -> str:
    """``local_policy`` with the predictions it ran on (none for prediction-blind ones)."""
    pred = row.get("predictions", "none")
    local = str(row.get("local_policy"))
    return local if pred == "none" else f"{local} [{pred}]"


def _mean(rows: Sequence[dict], key: str) -> float:
    return sum(float(r.get(key, 0.0)) for r in rows) / len(rows)


def panel_table(points: dict[float, dict[str, list[dict]]]) -> str:
    """One panel: rate -> variant -> rows (one per seed)."""
    names = sorted({v for by_variant in points.values() for v in by_variant},
                   key=lambda v: (v != BASELINE, NO_PREEMPT in v, v))
    paired = [v for v in names if v != BASELINE and NO_PREEMPT not in v
              and _no_preempt(v) in names]
    capacity = max((_mean(p[BASELINE], "throughput_rps") for p in points.values()
                    if BASELINE in p), default=0.0)
    head = ["rate (req/s)", "load", "seeds"] + [f"{v}: avg / TTFT / preempt" for v in names]
    head += [f"fcfs / {v}" for v in names if v != BASELINE and BASELINE in names]
    head += [f"{v}: no preemption / with; prefill +" for v in paired]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate in sorted(points):
        p = points[rate]
        seeds = max(len(rows) for rows in p.values())
        load = f"{rate / capacity:.2f}" if capacity else "-"
        cells = [f"{rate:g}", load, str(seeds)]
        for v in names:
            rows = p.get(v)
            cells.append(f"{_mean(rows, 'latency_avg_s'):.2f} / {_mean(rows, 'ttft_avg_s'):.2f}"
                         f" / {_mean(rows, 'preemptions'):.0f}" if rows else "-")
        base = p.get(BASELINE)
        for v in names:
            if v != BASELINE and BASELINE in names:
                rows = p.get(v)
                cells.append(f"{_mean(base, 'latency_avg_s') / _mean(rows, 'latency_avg_s'):.2f}"
                             if base and rows else "-")
        for v in paired:
            on, off = p.get(v), p.get(_no_preempt(v))
            if not on or not off:
                cells.append("-")
                continue
            gain = _mean(off, "latency_avg_s") / _mean(on, "latency_avg_s")
            extra = _mean(on, "prefill_tokens") / max(_mean(off, "prefill_tokens"), 1.0) - 1
            cells.append(f"{gain:.3f}; {extra:+.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _no_preempt(v: str) -> str:
    """The name of ``v`` with its preemption window at 0."""
    local, sep, pred = v.partition(" [")
    return f"{local}{NO_PREEMPT}{sep}{pred}"


def report(runs: Sequence[dict]) -> str:
    """Every panel's table (see module doc)."""
    panels: dict[tuple, dict[float, dict[str, list[dict]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for r in runs:
        key = (r.get("workload"), r.get("gpus"), r.get("max_num_seqs"), r.get("num_blocks"))
        panels[key][float(r["rate"])][variant(r)].append(r)
    out = []
    def order(key: tuple) -> tuple:  # by workload and GPUs, then the widest batch first
        workload, gpus, seqs, blocks = key
        return (str(workload), gpus or 0, -(seqs or 1 << 30), -(blocks or 1 << 30))

    for (workload, gpus, seqs, blocks), points in sorted(panels.items(),
                                                         key=lambda kv: order(kv[0])):
        limits = ", ".join(f"{k} {v}" for k, v in (("max_num_seqs", seqs), ("num_blocks", blocks))
                           if v is not None) or "the profile's limits"
        out.append(f"### {workload}, {gpus} GPU(s), {limits}\n\n{panel_table(points)}\n")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.trail_report",
                                description="sprpt_limited vs fcfs and preemption on/off, "
                                "from prefixmesh sim results (seeds averaged).")
    p.add_argument("results", nargs="+", type=Path, help="prefixmesh sim --json files")
    args = p.parse_args(argv)
    runs = load_runs(args.results)
    if not runs:
        raise SystemExit("no runs in the given files")
    print(report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
