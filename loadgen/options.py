"""Workload options shared by ``prefixmesh bench``, ``sim`` and ``compare``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from prefixmesh.loadgen.arrivals import ARRIVAL_SPECS, arrival_times
from prefixmesh.loadgen.workloads import WORKLOADS, WorkloadRequest, build_workload, parse_mix


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """``--workload`` and the options every workload-driven verb accepts."""
    p.add_argument("--workload", required=True,
                   help=f"one of {', '.join(WORKLOADS)}, or a mix like toolbench:0.5,videoqa:0.5")
    p.add_argument("--mix", default=None, help="same as a mix in --workload")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of prefix popularity")
    p.add_argument("--prefixes", type=int, default=None, help="distinct shared prefixes")
    p.add_argument("--agents", type=int, default=None,
                   help="embodied: agent episodes in flight at once (default 16)")
    p.add_argument("--arrivals", default="poisson",
                   help=f"arrival process: {', '.join(ARRIVAL_SPECS)} (burst:SIZE)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to replay: a workload with options and an arrival process."""

    workload: str
    zipf: float | None = None
    prefixes: int | None = None
    arrivals: str = "poisson"
    seed: int = 0
    agents: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadSpec:
        """The spec the command line names; exits naming the option when a workload or
        arrival process is unknown (before any work starts)."""
        spec = cls(workload=args.mix or args.workload, zipf=args.zipf, prefixes=args.prefixes,
                   arrivals=args.arrivals, seed=args.seed,
                   agents=getattr(args, "agents", None))
        try:
            parse_mix(spec.workload)
        except ValueError as exc:
            raise SystemExit(f"--{'mix' if args.mix else 'workload'}: {exc}") from None
        if spec.arrivals.partition(":")[0] not in ARRIVAL_SPECS:
            raise SystemExit(f"--arrivals: unknown arrival process {spec.arrivals!r} "
                             f"(known: {', '.join(ARRIVAL_SPECS)}; burst:SIZE)")
        return spec

    def requests(self, count: int) -> list[WorkloadRequest]:
        return build_workload(self.workload, count, self.seed, zipf=self.zipf,
                              prefixes=self.prefixes, agents=self.agents)

    def times(self, rate: float, count: int) -> list[float]:
        return arrival_times(self.arrivals, rate, count, self.seed)


def parse_floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"--{what}: need positive numbers")
    return values


def parse_names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
