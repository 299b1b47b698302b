"""Workload statistics and ``prefixmesh workloads [--stats]``.

``workload_stats`` measures what a workload really generated: prompt and output length
(mean, population std), the shared-prefix fraction as a prefix cache would see it (the
fraction of prompt blocks whose block hash already appeared in an earlier request, i.e. an
infinite cache's hit ratio in blocks), and how many requests use each shared prefix.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from prefixmesh.loadgen.workloads import WORKLOADS, WorkloadRequest, build_workload
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes

DEFAULT_COUNT = 1000
# Preble Table 1 (prompt mean/std, output mean/std tokens, shared %), for comparison.
PREBLE_TABLE1: dict[str, tuple[float, float, float, float, float]] = {
    "toolbench": (1835, 742, 43, 16, 85),
    "embodied": (2285, 471, 16, 13, 97),
    "programming": (3871, 1656, 190, 343, 97),
    "videoqa": (9865, 5976, 4, 1.5, 88),
    "loogle": (23474, 6105, 16, 9.9, 91),
}


def _prompt_ids(req: WorkloadRequest) -> list[int]:
    if isinstance(req.prompt, str):  # text workloads (toolbench_text): tokenize to measure
        from prefixmesh.loadgen.workloads.base import tokenizer

        return tokenizer().encode(req.prompt, add_special_tokens=False)
    return req.prompt


def workload_stats(reqs: Sequence[WorkloadRequest], block_size: int = BLOCK_SIZE
                   ) -> dict[str, Any]:
    """Lengths, block-hash sharing and prefix reuse of a request list (tokens)."""
    prompt_lens: list[int] = []
    outputs = [r.output_len or r.max_tokens for r in reqs]
    seen: set[int] = set()
    blocks = shared_blocks = declared = 0
    for r in reqs:
        ids = _prompt_ids(r)
        prompt_lens.append(len(ids))
        hashes = block_hashes(ids, r.tenant, block_size)
        blocks += len(hashes)
        shared_blocks += sum(1 for h in hashes if h in seen)
        seen.update(hashes)
        declared += min(r.shared_tokens, len(ids))
    per_prefix = Counter(r.prefix_id for r in reqs)
    total_prompt = sum(prompt_lens)
    return {
        "requests": len(reqs),
        "prompt_mean": statistics.fmean(prompt_lens) if reqs else 0.0,
        "prompt_std": statistics.pstdev(prompt_lens) if reqs else 0.0,
        "output_mean": statistics.fmean(outputs) if reqs else 0.0,
        "output_std": statistics.pstdev(outputs) if reqs else 0.0,
        "prompt_tokens": total_prompt,
        "prompt_blocks": blocks,
        # Fraction of full prompt blocks whose hash appeared in an earlier request.
        "shared_fraction": shared_blocks / blocks if blocks else 0.0,
        # Sum of shared_tokens over prompt tokens: the sharing the workload declares.
        "declared_shared_fraction": declared / total_prompt if total_prompt else 0.0,
        "prefixes": len(per_prefix),
        "requests_per_prefix": len(reqs) / len(per_prefix) if per_prefix else 0.0,
        "max_requests_per_prefix": max(per_prefix.values()) if per_prefix else 0,
        "sessions": len({r.session for r in reqs if r.session}),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """The stats rows as a markdown table, with Preble's Table 1 beside each workload."""
    head = ("| workload | requests | prompt mean/std | output mean/std | shared (blocks) | "
            "declared | prefixes | req/prefix | Preble Table 1 | build s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ref = PREBLE_TABLE1.get(r["workload"])
        target = (f"{ref[0]:g}/{ref[1]:g}, {ref[2]:g}/{ref[3]:g}, {ref[4]:g}%" if ref else "-")
        lines.append(
            f"| {r['workload']} | {r['requests']} | {r['prompt_mean']:.0f}/{r['prompt_std']:.0f}"
            f" | {r['output_mean']:.1f}/{r['output_std']:.1f} | {r['shared_fraction']:.1%}"
            f" | {r['declared_shared_fraction']:.1%} | {r['prefixes']}"
            f" | {r['requests_per_prefix']:.1f} | {target} | {r['build_s']:.2f} |")
    return "\n".join(lines)


def add_workloads_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``workloads`` verb on a ``prefixmesh`` subparsers object."""
    p = subparsers.add_parser(
        "workloads", help="list workloads, or build them and print their statistics",
        description="Without --stats, list the workloads. With --stats, build each named "
        "workload (all by default) and print prompt/output lengths, the block-hash shared "
        "fraction and prefix reuse, beside Preble's Table 1.")
    _add_arguments(p)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="workloads (or mixes like toolbench:0.5,videoqa:0.5); default all")
    p.add_argument("--stats", action="store_true", help="build and measure the workloads")
    p.add_argument("--count", type=int, default=DEFAULT_COUNT, help="requests per workload")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--zipf", type=float, default=None,
                   help="prefix popularity exponent (default: each workload's own)")
    p.add_argument("--prefixes", type=int, default=None,
                   help="distinct shared prefixes (default: each workload's own)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the rows as JSON")


def run_workloads(args: argparse.Namespace) -> int:
    """Run the ``workloads`` verb; returns the exit status."""
    names = args.names or list(WORKLOADS)
    if not args.stats:
        for name in names:
            spec = WORKLOADS.get(name)
            if spec is None:
                print(f"unknown workload {name!r}", file=sys.stderr)
                return 2
            print(f"{name:<12} {spec.summary}")
        return 0
    if args.count < 1:
        print("--count must be at least 1", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        options = {"zipf": args.zipf, "prefixes": args.prefixes}
        start = time.perf_counter()
        try:
            reqs = build_workload(name, args.count, args.seed, **options)
        except ValueError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
        elapsed = time.perf_counter() - start
        rows.append({"workload": name, "seed": args.seed, "build_s": elapsed,
                     **workload_stats(reqs)})
        print(f"  {name}: built {len(reqs)} in {elapsed:.2f} s", file=sys.stderr, flush=True)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"workloads": rows}, f, indent=2)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixmesh.loadgen.stats [--stats] [--count N] [--seed K] [names...]``."""
    parser = argparse.ArgumentParser(prog="prefixmesh workloads",
                                     description="Workload statistics (see docs/workloads.md).")
    _add_arguments(parser)
    return run_workloads(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
