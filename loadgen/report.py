"""``prefixmesh report``: markdown tables and latency-vs-rate plots from result JSON files.

One panel per workload (and GPU count), one line per policy (with its local policy),
average and p99 latency against request rate, the shape of Preble's Figure 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

COLUMNS = (("policy", "policy", "{}"), ("local_policy", "local", "{}"), ("rate", "rate", "{:g}"),
           ("gpus", "gpus", "{}"), ("completed", "done", "{}"), ("failed", "failed", "{}"),
           ("latency_avg_s", "avg s", "{:.3f}"), ("latency_p50_s", "p50 s", "{:.3f}"),
           ("latency_p99_s", "p99 s", "{:.3f}"), ("ttft_avg_s", "TTFT s", "{:.3f}"),
           ("throughput_rps", "req/s", "{:.2f}"), ("cache_hit_ratio", "hit", "{:.1%}"))


def load_runs(paths: Sequence[Path]) -> list[dict]:
    """All rows of all files (``{"runs": [...]}``), in order."""
    runs: list[dict] = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
            raise SystemExit(f"{path}: expected a JSON object with a 'runs' list")
        runs.extend(data["runs"])
    return runs


def _panel_key(r: dict) -> tuple[str, int]:
    return (str(r.get("workload", "")), int(r.get("gpus", 0) or 0))


def _line_key(r: dict) -> str:
    local = r.get("local_policy")
    return f"{r['policy']}/{local}" if local else str(r["policy"])


def markdown(runs: Sequence[dict]) -> str:
    """One table per (workload, gpus), rows sorted by rate then policy."""
    out = []
    panels: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in runs:
        panels[_panel_key(r)].append(r)
    for (workload, gpus), rows in panels.items():
        out.append(f"### {workload}, {gpus} GPUs\n")
        out.append("| " + " | ".join(h for _, h, _ in COLUMNS) + " |")
        out.append("|" + "---|" * len(COLUMNS))
        for r in sorted(rows, key=lambda r: (r.get("rate", 0), _line_key(r))):
            cells = [fmt.format(r[k]) if r.get(k) is not None and k in r else "" for k, _, fmt
                     in COLUMNS]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(runs: Sequence[dict], out: Path) -> None:
    """Average and p99 latency vs rate: a row of two axes per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in runs:
        panels[_panel_key(r)].append(r)
    fig, axes = plt.subplots(len(panels), 2, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for row, ((workload, gpus), rows) in enumerate(panels.items()):
        lines: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            lines[_line_key(r)].append(r)
        for col, (metric, label) in enumerate((("latency_avg_s", "average latency (s)"),
                                               ("latency_p99_s", "p99 latency (s)"))):
            ax = axes[row][col]
            for name, pts in sorted(lines.items()):
                pts = sorted(pts, key=lambda r: r["rate"])
                ax.plot([p["rate"] for p in pts], [p[metric] for p in pts], marker="o",
                        label=name)
            ax.set_title(f"{workload}, {gpus} GPUs")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
        axes[row][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixmesh report",
                                description="Markdown tables and latency-vs-rate PNG plots.")
    p.add_argument("files", nargs="+", type=Path, help="result JSON files")
    p.add_argument("--out", type=Path, default=None,
                   help="write OUT.md and OUT.png (default: print the markdown only)")
    args = p.parse_args(argv)
    runs = load_runs(args.files)
    if not runs:
        raise SystemExit("no runs in the given files")
    text = markdown(runs)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        plot(runs, args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
