"""``prefixmesh sim --suite NAME``: the placement suite, every policy over a family of fleets.

Each configuration is a workload, a fleet (GPU count or mixed profiles), an arrival process
and optionally a cache pressure, run at three loads (light, medium, heavy: fractions of
the fleet's estimated capacity) for several seeds, every global policy and ``ideal``
(loadgen/ideal.py) on the same requests and arrivals. Capacity is estimated once per
configuration (first seed) as the Poisson rate at which a reference's mean latency doubles
over its light-load latency (``capacity``). The reference is ``ideal`` without cache pressure.
Under cache pressure it is the best of E2's peers at each probed rate, on the pressured KV pool:

- ``ideal`` has ``IDEAL_KV_FACTOR`` x the profile's KV whatever the pressure, so its knee is
  the unpressured fleet's: the pressured fleet run at loads of it was overloaded, its mean
  latency growing with the run's length (docs/sim-results.md, "Cache pressure at the
  fleet's own knee").
- ``ideal`` on the pressured pool is no reference either: its free copy of every computed
  prefix needs the larger pool (on a full cache it evicts what other requests still use),
  so its knee would measure its own thrashing.
- So the reference is the fleet's best router at each rate, taken over the peers E2 is
  judged against (``PEERS``: every policy but E2): no one policy sets the rates, E2 (or a
  variant under ``--e2``) does not set its own, and every variant is judged at the same
  rates.

A configuration under cache pressure is one fleet: every GPU's KV pool is set once per
seed, from the requests of its heaviest run (``pressure_blocks``: their working set is
``cache_pressure`` times the fleet's cache), and the probes and every load run on it. A
lighter load, with fewer requests over the same time, so meets less pressure on the same
fleet (sizing each run's pool from its own requests instead made the lightest load the
most starved one: on ``multiturn`` 242 blocks a GPU at load 0.3 against 719 at 0.9).

Configurations without cache pressure keep ``ideal``'s knee (the same probes as before).

A run's length: its heaviest load holds ``--requests-per-gpu`` N x the configuration's
GPUs requests (the lighter loads the first of them, over the same time; by default
``REQUESTS_PER_GPU``: the same work per GPU in every configuration), or ``--requests``
requests in every configuration (with a fixed count a 16-GPU run is a quarter as long per
GPU as a 4-GPU one, little more than its cold start, and its p99 a handful of that cold
start's requests), or with ``--horizon`` at least that many seconds of arrivals.

Printed per configuration and load (means over the seeds): E2's average and p99 over the
best other policy's (< 1: E2 ahead), E2 over ``cache_aware``, and every policy's distance
from ``ideal``. The JSON (``results/suite-NAME.json`` by default) holds every run and
that summary. ``family`` is the whole family (864 runs: 429 s of CPU at the default
length, one core, docs/sim-results.md); ``mixed`` its multi-turn and cache-pressure
configurations on its H100 + A6000 fleet; ``quick`` a three-configuration sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixmesh.loadgen.cluster_sim import ClusterConfig, ClusterSim, pressure_blocks
from prefixmesh.loadgen.ideal import IDEAL, annotate_ideal
from prefixmesh.loadgen.options import WorkloadSpec
from prefixmesh.loadgen.policy_variants import parse_variant
from prefixmesh.loadgen.sweep import sweep
from prefixmesh.services.scheduler.policies import POLICY_NAMES
from prefixmesh.services.worker.engine.types import SimEngineConfig
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, parse_gpu_profiles

# Fractions of the estimated capacity run by every configuration (light, medium, heavy).
LOADS = (0.3, 0.6, 0.9)
POLICIES = (*POLICY_NAMES, IDEAL)
# The policies E2 is compared against; under cache pressure, the capacity's references.
PEERS = tuple(p for p in POLICY_NAMES if p != "e2")
# Requests of the heaviest load of a run (lighter loads take fewer over the same time), a
# GPU of the configuration's fleet (500 on 4 GPUs, 2,000 on 16), unless ``--requests``
# sets one count for all.
REQUESTS_PER_GPU = 125
# Capacity: the rate where the reference's mean latency (ideal's; under cache pressure the
# best peer's) reaches this multiple of its light-load latency, probed with this many
# requests.
KNEE_FACTOR = 2.0
PROBE_REQUESTS = 300
PROBE_S = 60.0
# With ``--horizon S``, each run's heaviest load spans at least S seconds of arrivals, as
# the probes that set its rate do (up to ``4 * PROBE_REQUESTS`` requests, their cap too);
# 0 (the default): exactly ``--requests``.
HORIZON_S = 0.0
# Ratio within which E2 counts as level with the best other policy (done-when: 3%).
TOLERANCE = 1.03


@dataclass(frozen=True, slots=True)
class SuiteConfig:
    """One configuration of the suite."""

    name: str
    workload: str
    gpus: int = 4
    arrivals: str = "poisson"
    gpu_profiles: str = ""
    cache_pressure: float = 0.0

    def fleet(self) -> tuple[str, ...]:
        return parse_gpu_profiles(self.gpu_profiles) if self.gpu_profiles else ()

    def gpu_count(self) -> int:
        """GPUs of the configuration: its mixed fleet's, else ``gpus``."""
        return len(self.fleet()) or self.gpus


# A fleet of two GPU generations: two H100s beside two A6000s.
MIXED_FLEET = "mistral-7b-h100:2,mistral-7b-a6000:2"


def _mix(share: float) -> str:
    return f"loogle:{share:g},toolbench:{1 - share:g}"


FAMILY = (
    SuiteConfig("doc0.1-4gpu-poisson", _mix(0.1), 4, "poisson"),
    SuiteConfig("doc0.3-4gpu-azconv", _mix(0.3), 4, "azure-conv"),
    SuiteConfig("doc0.5-4gpu-azcode", _mix(0.5), 4, "azure-code"),
    SuiteConfig("doc0.5-8gpu-azconv", _mix(0.5), 8, "azure-conv"),
    SuiteConfig("doc0.1-8gpu-azcode", _mix(0.1), 8, "azure-code"),
    SuiteConfig("doc0.3-16gpu-poisson", _mix(0.3), 16, "poisson"),
    SuiteConfig("hetero-h100+a6000-doc0.3", _mix(0.3), 4, "poisson", gpu_profiles=MIXED_FLEET),
    SuiteConfig("hetero-a100+a6000-toolbench", "toolbench", 4, "azure-conv",
                gpu_profiles="mistral-7b-a100:2,mistral-7b-a6000:2"),
    SuiteConfig("multiturn-4gpu", "multiturn", 4, "poisson"),
    SuiteConfig("pressure3-toolbench", "toolbench", 4, "poisson", cache_pressure=3.0),
    SuiteConfig("pressure3-multiturn", "multiturn", 4, "poisson", cache_pressure=3.0),
    SuiteConfig("lowshare-4gpu", "lowshare", 4, "poisson"),
)
# The family's multi-turn and cache-pressure configurations on its H100 + A6000 fleet.
MIXED = (
    SuiteConfig("mixed-multiturn", "multiturn", 4, "poisson", gpu_profiles=MIXED_FLEET),
    SuiteConfig("mixed-pressure3-toolbench", "toolbench", 4, "poisson",
                gpu_profiles=MIXED_FLEET, cache_pressure=3.0),
    SuiteConfig("mixed-pressure3-multiturn", "multiturn", 4, "poisson",
                gpu_profiles=MIXED_FLEET, cache_pressure=3.0),
)
SUITES: dict[str, tuple[SuiteConfig, ...]] = {
    "family": FAMILY,
    "mixed": MIXED,
    "quick": (FAMILY[1], FAMILY[6], FAMILY[8]),
}


def run_requests(rate: float, floor: int, horizon_s: float) -> int:
    """Requests of a run at ``rate``: ``horizon_s`` seconds of arrivals, at least ``floor``
    and at most ``4 * PROBE_REQUESTS`` (unless ``floor`` is more)."""
    n = round(rate * horizon_s)
    return max(floor, min(n, 4 * PROBE_REQUESTS))


def _probe_avg(cfg: SuiteConfig, spec: WorkloadSpec, rate: float, policy: str,
               engine: SimEngineConfig | None) -> float:
    """``policy``'s mean latency at ``rate`` (Poisson), on ``engine``'s limits (None: the
    profile's); inf if a request failed."""
    # Enough requests for a steady state: long replies keep many requests in flight.
    n = run_requests(rate, PROBE_REQUESTS, PROBE_S)
    reqs = spec.requests(n)
    fleet = cfg.fleet()
    run = ClusterSim(ClusterConfig(gpus=cfg.gpu_count(), policy=policy,
                                   gpu_profiles=fleet, engine_config=engine)
                     ).run(reqs, spec.times(rate, n))
    done = [r.latency_s for r in run.results if r.ok]
    return statistics.mean(done) if len(done) == len(reqs) else float("inf")


def fleet_blocks(cfg: SuiteConfig, spec: WorkloadSpec, requests: int) -> int:
    """KV blocks of each GPU of a configuration under cache pressure, for ``spec``'s seed:
    the working set of its heaviest run's ``requests`` requests is ``cache_pressure`` times
    the fleet's cache."""
    return pressure_blocks(spec.requests(requests), cfg.gpu_count(),
                           cfg.cache_pressure)


def capacity(cfg: SuiteConfig, seed: int, requests: int) -> float:
    """The rate at which the reference's mean latency is ``KNEE_FACTOR`` times its latency at
    a light rate (Poisson arrivals, ``PROBE_REQUESTS`` requests): doubling, then bisecting.
    Busy GPU time cannot say it: a GPU decoding one long reply is busy all the while.

    The reference is ``ideal``; under cache pressure, the lowest mean latency of ``PEERS`` at
    each rate, each GPU with the KV blocks of the configuration's heaviest run
    (``requests`` requests; see the module docstring)."""
    spec = WorkloadSpec(cfg.workload, arrivals="poisson", seed=seed)
    gpus = cfg.gpu_count()
    refs: list[str] = [IDEAL]
    engine = None
    if cfg.cache_pressure > 0:
        refs = list(PEERS)
        engine = SimEngineConfig(num_blocks=fleet_blocks(cfg, spec, requests))

    def latency(rate: float, target: float = float("-inf")) -> float:
        # The lowest of the references' (every one of them without ``target``: the light
        # load), or the first under ``target`` (enough to place the rate below the knee);
        # the last one under it is tried first next time.
        best = float("inf")
        for p in list(refs):
            best = min(best, _probe_avg(cfg, spec, rate, p, engine))
            if best < target:
                refs.remove(p)
                refs.insert(0, p)
                break
        return best

    light = latency(0.05 * gpus)
    target = KNEE_FACTOR * light
    lo, hi = 0.05 * gpus, 0.1 * gpus
    while latency(hi, target) < target and hi < 1e4:
        lo, hi = hi, 2 * hi
    for _ in range(4):
        mid = (lo + hi) / 2
        if latency(mid, target) < target:
            lo = mid
        else:
            hi = mid
    return lo


def run_config(cfg: SuiteConfig, seeds: Sequence[int], requests: int,
               e2_knobs: str = "", horizon_s: float = HORIZON_S) -> list[dict]:
    """Every policy at ``LOADS`` of the capacity, for each seed; E2 with ``e2_knobs``
    (``knob=value,...`` of PolicyConfig) when given, still labelled ``e2``.

    The heaviest load's run holds ``requests`` requests, or with ``horizon_s`` > 0 that
    many seconds of arrivals if more (``run_requests``): with a fixed count, the 16-GPU
    configuration at its heaviest load sees 17 s of arrivals and a 4-GPU one up to 77 s,
    the first little more than its cold start. A configuration under cache pressure keeps
    ``requests``: its pool is sized from them, before its rate is known."""
    e2 = f"e2:{e2_knobs}" if e2_knobs else "e2"
    policies = [e2 if p == "e2" else p for p in POLICIES]
    rows: list[dict] = []
    fleet = cfg.fleet()
    cap = capacity(cfg, seeds[0], requests)  # one per configuration: seeds share rates
    rates = [round(f * cap, 3) for f in LOADS]
    if cfg.cache_pressure <= 0 and horizon_s > 0:
        requests = run_requests(rates[-1], requests, horizon_s)
    for seed in seeds:
        spec = WorkloadSpec(cfg.workload, arrivals=cfg.arrivals, seed=seed)
        pool: dict = {}
        engine = None
        if cfg.cache_pressure > 0:  # one fleet at every load (module docstring)
            blocks = fleet_blocks(cfg, spec, requests)
            engine = SimEngineConfig(num_blocks=blocks)
            pool = {"cache_pressure": cfg.cache_pressure, "num_blocks": blocks}
        got = sweep(spec, cfg.gpus, rates, policies, ["prefix_fair"], DEFAULT_PROFILE,
                    requests / rates[-1], progress=False, gpu_profiles=fleet, engine=engine)
        for r in got:
            if r["policy"] == e2:
                r.update(policy="e2", e2_knobs=e2_knobs)
            r.update(config=cfg.name, arrivals=cfg.arrivals, load=LOADS[rates.index(r["rate"])],
                     requests_heaviest=requests, **pool)
        rows.extend(got)
    annotate_ideal(rows)
    return rows


def summarize_config(rows: Sequence[dict]) -> list[dict]:
    """Per load: each policy's mean average and p99 over the seeds, E2 / best other, E2 /
    cache_aware, every policy / ideal."""
    by_load: dict[float, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_load[r["load"]][r["policy"]].append(r)
    out = []
    for load in sorted(by_load):
        pol = {p: (statistics.mean(r["latency_avg_s"] for r in rs),
                   statistics.mean(r["latency_p99_s"] for r in rs),
                   sum(r["failed"] for r in rs))
               for p, rs in by_load[load].items()}
        others = {p: v for p, v in pol.items() if p in PEERS}
        best_avg = min(others, key=lambda p: others[p][0])
        best_p99 = min(others, key=lambda p: others[p][1])
        e2, ideal, ca = pol["e2"], pol[IDEAL], pol["cache_aware"]
        out.append({
            "load": load, "rate_mean": statistics.mean(r["rate"] for r in by_load[load]["e2"]),
            "policies": {p: {"avg_s": round(a, 4), "p99_s": round(q, 4), "failed": f,
                             "vs_ideal_avg": round(a / ideal[0], 4),
                             "vs_ideal_p99": round(q / ideal[1], 4)}
                         for p, (a, q, f) in pol.items()},
            "best_other_avg": best_avg, "best_other_p99": best_p99,
            "e2_vs_best_avg": round(e2[0] / others[best_avg][0], 4),
            "e2_vs_best_p99": round(e2[1] / others[best_p99][1], 4),
            "cache_aware_over_e2_avg": round(ca[0] / e2[0], 4),
        })
    return out


def report(name: str, summary: dict[str, list[dict]]) -> str:
    """The suite's figures as markdown."""
    lines = [f"Suite `{name}`: means over seeds; E2/best < 1 = E2 ahead; CA/E2 = "
             "cache_aware's average over E2's; x ideal = the policy's average over ideal's.",
             "", "| config | load | rate | E2/best avg | E2/best p99 | best other (avg; p99) | "
             "CA/E2 avg | E2 x ideal | best x ideal | E2 within 3% |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, points in summary.items():
        for s in points:
            ok = s["e2_vs_best_avg"] <= TOLERANCE and s["e2_vs_best_p99"] <= TOLERANCE
            best = s["best_other_avg"]
            lines.append(
                f"| {cfg} | {s['load']:g} | {s['rate_mean']:.2f} | {s['e2_vs_best_avg']:.3f} | "
                f"{s['e2_vs_best_p99']:.3f} | {best}; {s['best_other_p99']} | "
                f"{s['cache_aware_over_e2_avg']:.2f} | "
                f"{s['policies']['e2']['vs_ideal_avg']:.2f} | "
                f"{s['policies'][best]['vs_ideal_avg']:.2f} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixmesh sim --suite",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--suite", required=True, choices=tuple(SUITES))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--requests", type=int, default=None,
                   help="requests of the heaviest load of each run, the same in every "
                   "configuration (at least, with --horizon); default: --requests-per-gpu")
    p.add_argument("--horizon", type=float, default=HORIZON_S, metavar="S",
                   help="S > 0: each run's heaviest load spans at least S seconds of arrivals "
                   f"(up to {4 * PROBE_REQUESTS} requests; not under cache pressure, whose pool "
                   "is sized from the run's requests); default 0: exactly the requests of "
                   "--requests or --requests-per-gpu")
    p.add_argument("--requests-per-gpu", type=int, default=None, metavar="N",
                   help="the heaviest load of each configuration runs N x its GPUs requests "
                   f"(the same work per GPU in every configuration; default {REQUESTS_PER_GPU} "
                   "unless --requests is given)")
    p.add_argument("--only", default="", help="comma-separated configuration names to run")
    p.add_argument("--e2", default="", metavar="KNOBS",
                   help="judge this E2 variant instead of the default: PolicyConfig "
                   "knob=value pairs, comma-separated (e.g. interference_weight=0.1)")
    p.add_argument("--json", type=Path, default=None,
                   help="results (default results/suite-NAME.json)")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not seeds:
        p.error("--seeds: at least one seed")
    if args.requests is not None and args.requests_per_gpu is not None:
        p.error("--requests and --requests-per-gpu each set the runs' length: give one")
    if args.requests is not None and args.requests < 1:
        p.error("--requests must be at least 1")
    if args.requests_per_gpu is not None and args.requests_per_gpu < 1:
        p.error("--requests-per-gpu must be at least 1")
    per_gpu = REQUESTS_PER_GPU if args.requests is None and args.requests_per_gpu is None \
        else args.requests_per_gpu
    if not args.horizon >= 0:  # NaN too
        p.error(f"--horizon must be 0 or more seconds, got {args.horizon:g}")
    try:
        parse_variant(f"e2:{args.e2}")
    except ValueError as exc:
        p.error(f"--e2: {exc}")
    names = [c.name for c in SUITES[args.suite]]
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := [n for n in only if n not in names]:
        p.error(f"--only: no configuration {', '.join(map(repr, unknown))} in suite "
                f"{args.suite!r} (it has: {', '.join(names)})")
    configs = [c for c in SUITES[args.suite] if not only or c.name in only]
    out = args.json or Path("results") / f"suite-{args.suite}.json"
    rows: list[dict] = []
    summary: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    for cfg in configs:
        requests = per_gpu * cfg.gpu_count() if per_gpu else args.requests
        got = run_config(cfg, seeds, requests, args.e2, args.horizon)
        rows.extend(got)
        summary[cfg.name] = summarize_config(got)
        print(f"  {cfg.name}: done ({time.perf_counter() - t0:.0f}s wall)", file=sys.stderr,
              flush=True)
    md = report(args.suite, summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"suite": args.suite, "seeds": seeds, "loads": LOADS,
                               "e2_knobs": args.e2, "requests": args.requests,
                               "requests_per_gpu": per_gpu,
                               "horizon_s": args.horizon,
                               "configs": [asdict(c) for c in configs], "summary": summary,
                               "runs": rows, "wall_s": round(time.perf_counter() - t0, 1)},
                              indent=1))
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {len(rows)} runs to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
