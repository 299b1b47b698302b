"""``prefixmesh sim``: virtual-time sweeps over rates x global policies x local policies."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.loadgen.cluster_sim import ClusterConfig, ClusterSim, pressure_blocks
from prefixmesh.loadgen.ideal import annotate_ideal
from prefixmesh.loadgen.options import (
    WorkloadSpec,
    add_workload_args,
    parse_floats,
    parse_names,
)
from prefixmesh.loadgen.policy_variants import (
    parse_local_variant,
    parse_variant,
    split_variants,
)
from prefixmesh.loadgen.results import summarize
from prefixmesh.loadgen.sim_replicas import (
    ReplicaConfig,
    add_replica_args,
    replica_configs,
    replica_fields,
    replica_label,
)
from prefixmesh.loadgen.trail_preds import (
    PREDICTION_MODES,
    TRAIL_MODES,
    TrailPredictions,
    trail_requests,
)
from prefixmesh.loadgen.workloads import WorkloadRequest
from prefixmesh.services.scheduler.policies import POLICY_NAMES
from prefixmesh.services.worker.engine.types import SimEngineConfig
from prefixmesh.services.worker.local import LOCAL_POLICIES
from prefixmesh.shared.costmodel import (
    DEFAULT_PROFILE,
    CostModel,
    available_profiles,
    parse_gpu_profiles,
    profile_counts,
)


def simulate(requests: Sequence[WorkloadRequest], arrivals: Sequence[float], cfg: ClusterConfig,
             workload: str, rate: float, label: str | None = None,
             local_label: str | None = None) -> dict:
    """One simulated run, as a result row (docs/design.md section 11) plus simulator figures.

    ``label`` / ``local_label`` name the policies in the row (variants with knobs); default
    ``cfg.policy`` / ``cfg.local_policy``.
    """
    sim = ClusterSim(cfg)
    run = sim.run(requests, arrivals)
    row = summarize(run.results, run.duration_s, policy=label or cfg.policy,
                    local_policy=local_label or cfg.local_policy, workload=workload,
                    rate=rate, gpus=cfg.gpus, backend="sim")
    row.update(mode="virtual", profile=cfg.profile, virtual_s=round(run.duration_s, 3),
               wall_s=round(run.wall_s, 3), steps=run.steps, decisions=run.decisions,
               worker_requests=run.worker_requests, preemptions=run.preemptions,
               prefill_tokens=run.prefill_tokens, busy_s=round(run.busy_s, 3),
               predictions=cfg.predictions)
    if cfg.gpu_profiles:
        row["gpu_profiles"] = profile_counts(cfg.gpu_profiles)
    row.update(replica_fields(cfg.replicas, sim.policy))
    if cfg.engine_config is not None:
        row.update(max_num_seqs=cfg.engine_config.max_num_seqs,
                   num_blocks=cfg.engine_config.num_blocks)
    return row


# Local policies that never read predictions: one run each (predictions "none"), whatever
# --predictions lists.
PREDICTION_BLIND = frozenset({"fcfs"})


def sweep(spec: WorkloadSpec, gpus: int, rates: Sequence[float], policies: Sequence[str],
          local_policies: Sequence[str], profile: str, duration_s: float,
          progress: bool = True, predictions: str | Sequence[str] = "none",
          trail: TrailPredictions | None = None,
          engine: SimEngineConfig | None = None,
          replicas: Sequence[ReplicaConfig] = (ReplicaConfig(),),
          gpu_profiles: tuple[str, ...] = (), cache_pressure: float = 0.0) -> list[dict]:
    """Every (rate, policy, local policy, predictions) point over the same seeded requests
    and arrivals.

    ``policies`` and ``local_policies`` are variant texts (``e2:th_bal=inf``,
    ``sprpt_limited:preempt_fraction=0``; see ``prefixmesh.loadgen.policy_variants``).
    With ``trail`` (the trained predictor's outputs) the requests are the ``sharegpt``
    conversations it predicted, with their predicted replies' lengths when those were
    SmolLM2's own (``prefixmesh.loadgen.trail_preds``). ``engine`` overrides the profile's
    engine limits (sequence slots, KV blocks). Each of ``replicas`` (scheduler replicas
    and sync delay) is a point of its own, labelled ``policy@RxDms`` when replicated.
    ``gpu_profiles``: one profile per worker (a mixed fleet; overrides ``gpus``).
    ``cache_pressure`` X > 0: each rate's KV blocks per GPU set so its requests' working
    set is X times the fleet's cache.
    """
    variants = [parse_variant(p) for p in policies]
    local_variants = [parse_local_variant(p) for p in local_policies]
    modes = [predictions] if isinstance(predictions, str) else list(predictions)
    count = max(1, round(max(rates) * duration_s))
    if trail is not None:
        if spec.workload != "sharegpt":
            raise ValueError("the predictor's outputs are for the sharegpt workload")
        requests = trail_requests(trail, count, spec.seed)
    else:
        requests = spec.requests(count)
    rows = []
    for rate in rates:
        n = max(1, round(rate * duration_s))
        arrivals = spec.times(rate, n)
        rate_engine = engine
        if cache_pressure > 0:
            blocks = pressure_blocks(requests[:n], len(gpu_profiles) or gpus, cache_pressure)
            rate_engine = SimEngineConfig(
                max_num_seqs=engine.max_num_seqs if engine else None, num_blocks=blocks)
        for v in variants:
            runs = [(local, m) for local in local_variants
                    for m in (["none"] if local.policy in PREDICTION_BLIND else modes)]
            for (lv, mode), rc in ((r, rc) for r in runs for rc in replicas):
                cfg = ClusterConfig(gpus=gpus, policy=v.policy, local_policy=lv.policy,
                                    local_config=lv.config, profile=profile,
                                    policy_config=v.config, predictions=mode, trail=trail,
                                    engine_config=rate_engine, replicas=rc,
                                    gpu_profiles=gpu_profiles)
                label = replica_label(v.label, rc)
                row = simulate(requests[:n], arrivals, cfg, spec.workload, rate, label,
                               lv.label)
                row["seed"] = spec.seed
                if cache_pressure > 0:
                    row["cache_pressure"] = cache_pressure
                rows.append(row)
                if progress:
                    print(f"  {spec.workload} rate={rate:g} {label}/{lv.label} ({mode}): "
                          f"avg {row['latency_avg_s']:.3f}s p99 {row['latency_p99_s']:.3f}s "
                          f"hit {row['cache_hit_ratio']:.1%} failed {row['failed']} "
                          f"({row['wall_s']:.1f}s wall)", file=sys.stderr, flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixmesh sim",
        description="Virtual-time cluster simulation: the real global and local policies "
        "against simulated GPUs, in one process. Writes the result schema of `bench`. "
        "`prefixmesh sim --suite family|quick` runs the placement suite instead "
        "(loadgen/suite.py).")
    p.add_argument("--gpus", type=int, default=4, help="simulated GPUs (workers)")
    add_workload_args(p)
    p.add_argument("--rates", required=True, help="comma-separated request rates (req/s)")
    p.add_argument("--policies", default="round_robin,e2",
                   help=f"global policies: {', '.join(POLICY_NAMES)}, and ideal (the "
                   "reference no router reaches: loadgen/ideal.py); a policy may take "
                   "PolicyConfig knobs, e.g. e2:th_bal=inf,replicate_max_workers=1")
    p.add_argument("--local-policies", default="prefix_fair",
                   help=f"local policies: {', '.join(LOCAL_POLICIES)}; a policy may take its "
                   "config's knobs, e.g. sprpt_limited:preempt_fraction=0")
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=available_profiles())
    p.add_argument("--gpu-profiles", default="",
                   help="a fleet mixing GPU types: PROFILE:COUNT,... (e.g. "
                   "mistral-7b-a100:2,mistral-7b-a6000:2), one profile per worker; overrides "
                   "--gpus. The policies keep --profile as their default cost model")
    p.add_argument("--predictions", default="none",
                   help="output-length predictions on requests (for sprpt_limited), one or "
                   "a comma list of: none; oracle = each request's real output length; "
                   "initial / refined = the trained predictor's (needs --predictions-file)")
    p.add_argument("--predictions-file", type=Path, default=None,
                   help="the predictor's outputs (prefixmesh predictor eval --preds); the "
                   "sharegpt requests are then the conversations it predicted, with "
                   "SmolLM2's reply lengths if it was trained on them (--replies model)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests each simulated GPU runs at once (default: the profile's, "
                   "256 for the shipped ones)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks of 16 tokens per simulated GPU (default: the profile's "
                   "KV capacity)")
    p.add_argument("--cache-pressure", type=float, default=0.0,
                   help="X > 0: KV blocks per GPU set so the working set (distinct prompt "
                   "blocks of each rate's requests) is X times the fleet's cache (2-4: a "
                   "cache-pressure test); overrides --num-blocks")
    p.add_argument("--duration", type=float, default=120.0,
                   help="seconds of arrivals per run (requests = rate x duration)")
    add_replica_args(p)
    p.add_argument("--json", type=Path, required=True, help="write {\"runs\": [...]} here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--suite" or a.startswith("--suite=") for a in argv):
        from prefixmesh.loadgen.suite import main as suite_main  # the suite runs sweeps

        return suite_main(argv)
    args = build_parser().parse_args(argv)
    if args.gpus < 1:
        raise SystemExit("--gpus must be at least 1")
    if not args.duration > 0:
        raise SystemExit(f"--duration must be positive, got {args.duration:g}")
    if args.cache_pressure < 0:
        raise SystemExit(f"--cache-pressure must be 0 (off) or more, got {args.cache_pressure:g}")
    spec = WorkloadSpec.from_args(args)
    policies, locals_ = split_variants(args.policies), split_variants(args.local_policies)
    try:
        for p in policies:
            parse_variant(p)
        for p in locals_:
            parse_local_variant(p)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        fleet = parse_gpu_profiles(args.gpu_profiles) if args.gpu_profiles else ()
    except ValueError as exc:
        raise SystemExit(f"--gpu-profiles: {exc}") from None
    modes = parse_names(args.predictions)
    bad = [m for m in modes if m not in PREDICTION_MODES]
    if bad:
        raise SystemExit(f"unknown predictions: {', '.join(bad)}")
    if any(m in TRAIL_MODES for m in modes) != (args.predictions_file is not None):
        raise SystemExit("--predictions initial/refined and --predictions-file go together")
    trail = None if args.predictions_file is None else TrailPredictions.load(
        args.predictions_file)
    engine = None
    if args.max_num_seqs is not None or args.num_blocks is not None:
        if min(v for v in (args.max_num_seqs, args.num_blocks) if v is not None) < 1:
            raise SystemExit("--max-num-seqs and --num-blocks must be at least 1")
        tokens = CostModel.load(args.profile).max_batched_tokens
        if (args.max_num_seqs or 0) > tokens:
            raise SystemExit(f"--max-num-seqs must not exceed the profile's {tokens} tokens "
                             "batched per step")
        engine = SimEngineConfig(max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks)
    rows = sweep(spec, args.gpus, parse_floats(args.rates, "rates"),
                 policies, locals_, args.profile, args.duration,
                 predictions=modes, trail=trail, engine=engine,
                 replicas=replica_configs(args), gpu_profiles=fleet,
                 cache_pressure=args.cache_pressure)
    annotate_ideal(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": rows}, indent=1))
    print(f"wrote {len(rows)} runs to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
