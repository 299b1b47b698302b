"""The ``prefixmesh`` command line: one verb per job, ``--help`` on each."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _add_up(sub: argparse._SubParsersAction) -> None:
    from prefixmesh.services.up import MeshOptions
    from prefixmesh.shared.runtime.config import add_arguments

    p = sub.add_parser("up", help="run the whole mesh as local processes",
                       description="Start nats-server and redis-server when none is reachable, "
                       "then every prefixmesh service; print the edge URL; Ctrl-C stops all.")
    add_arguments(p, MeshOptions)
    p.add_argument("--state-file", type=Path, default=None,
                   help="write the URL and child PIDs here as JSON once ready")


def _cmd_up(args: argparse.Namespace) -> int:
    from prefixmesh.services.up import MeshOptions, run_up
    from prefixmesh.shared.runtime.config import from_sources

    opts = from_sources(MeshOptions, args)
    if opts.gpu_profiles:
        from prefixmesh.shared.costmodel import parse_gpu_profiles

        try:
            parse_gpu_profiles(opts.gpu_profiles)
        except ValueError as exc:
            print(f"--gpu-profiles: {exc}", file=sys.stderr)
            return 2
    for name in ("workers", "edges", "schedulers", "tokenizers", "nats_cluster"):
        if getattr(opts, name) < 1:
            print(f"--{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if opts.port:
        from prefixmesh.shared.runtime.config import PORT
        from prefixmesh.shared.runtime.servers import port_open

        ports = opts.edge_ports
        if opts.port + ports - 1 > PORT[1]:
            print(f"--port: the edges need ports {opts.port}-{opts.port + ports - 1}, past "
                  f"{PORT[1]}", file=sys.stderr)
            return 2
        taken = [opts.port + i for i in range(ports) if port_open(opts.host, opts.port + i)]
        if taken:
            need = (f"port {opts.port}" if ports == 1
                    else f"ports {opts.port}-{opts.port + ports - 1}")
            print(f"--port: the edges need {need}; in use: {', '.join(map(str, taken))}",
                  file=sys.stderr)
            return 2
    return run_up(opts, args.state_file)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="round_robin vs e2 on a burst of shared-prefix requests",
                       description="Start the mesh with simulated GPU workers once per policy, "
                       "send the same burst of ToolBench requests through the HTTP API, and "
                       "print latency and cache hit ratio per policy.")
    p.add_argument("--workers", type=int, default=4, help="simulated GPU workers")
    p.add_argument("--requests", type=int, default=160, help="requests per policy")
    p.add_argument("--rate", type=float, default=12.0, help="Poisson arrival rate (req/s)")
    p.add_argument("--policies", default="round_robin,e2", help="comma-separated policies")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--json", type=Path, default=None, help="also write results JSON here")


def _cmd_demo(args: argparse.Namespace) -> int:
    from prefixmesh.loadgen.demo import run_demo

    return run_demo(workers=args.workers, requests=args.requests, rate=args.rate,
                    policies=[p.strip() for p in args.policies.split(",") if p.strip()],
                    seed=args.seed, json_out=args.json)


def _bench_scheduler(argv: list[str]) -> int:
    live = "--live" in argv
    module = "bench_scheduler_live" if live else "bench_scheduler"
    return _run_module(f"prefixmesh.loadgen.{module}", [a for a in argv if a != "--live"])


def _worker(argv: list[str]) -> int:
    from prefixmesh.services.worker.__main__ import main as worker_main

    return worker_main(argv, standalone=True)


def _run_module(module: str, argv: list[str]) -> int:
    """``main(argv)`` of ``module``, imported only when its verb runs."""
    return int(importlib.import_module(module).main(argv))


# Verbs whose module owns its argument parser: ``prefixmesh VERB --help`` is theirs. Each
# names its help line and its module (a ``main(argv) -> int``) or a function of its own.
DELEGATED: dict[str, tuple[str, str | Callable[[list[str]], int]]] = {
    "workloads": ("list the workloads; --stats prints their generated statistics",
                  "prefixmesh.loadgen.stats"),
    "bench": ("open-loop HTTP load against an OpenAI-compatible endpoint",
              "prefixmesh.loadgen.bench"),
    "sim": ("virtual-time cluster simulation over rates and policies",
            "prefixmesh.loadgen.sweep"),
    "report": ("markdown tables and latency-vs-rate plots from result files",
               "prefixmesh.loadgen.report"),
    "fidelity": ("the same config through the live mesh and the simulator, side by side",
                 "prefixmesh.loadgen.fidelity"),
    "worker": ("one engine replica; --http PORT serves it standalone (OpenAI, SGLang and "
               "vLLM routes) for third-party routers", _worker),
    "compare": ("prefixmesh vs sglang-router / vllm-router in front of the same simulated "
                "GPUs", "prefixmesh.loadgen.compare"),
    "predictor": ("train / evaluate TRAIL's output-length predictor ([ml] extra)",
                  "prefixmesh.loadgen.predictor.train"),
    "batch": ("offline batches: 'batch plan FILE.jsonl' shows the planner's groups and the "
              "prefill tokens it saves, without running anything", "prefixmesh.loadgen.batch_cli"),
    "bench-scheduler": ("time the global policy's routing decisions (add --live for the "
                        "scheduler service over NATS)", _bench_scheduler),
    "bench-router": ("closed-loop capacity of prefixmesh, sglang-router and direct-to-worker "
                     "in front of the same simulated GPUs", "prefixmesh.loadgen.bench_router"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixmesh",
        description="Prefix-aware distributed serving for LLM workloads with shared prompts.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    _add_up(sub)
    _add_demo(sub)
    for name, (help_text, _fn) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


COMMANDS = {"up": _cmd_up, "demo": _cmd_demo}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        target = DELEGATED[argv[0]][1]
        if isinstance(target, str):
            return _run_module(target, argv[1:])
        return target(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return COMMANDS[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
