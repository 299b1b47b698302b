"""Audit a policy's routing decisions against the simulated GPUs' real caches.

``python -m prefixmesh.loadgen.route_audit --workload toolbench --cache-pressure 3
--rate 54.72 --duration 10 --policies e2,cache_aware`` runs each policy once in the
simulator and classifies every decision by three questions, printing the counts:

- does any GPU really cache at least half of the prompt at that instant (``somewhere``)
  or none (``nowhere``);
- if somewhere, did the request go to the GPU caching most of it (``to_holder``);
- has the request's prefix (``prefix_id``) been sent anywhere before (``first``), and is
  the chosen GPU one it went to before (``back_home``) or not (``new_home``).

A ``new_home`` decision puts a prefix's KV on one more GPU: under cache pressure that
copy evicts something else. This is how the suite's cache-pressure loss was read
(docs/sim-results.md). ``--why`` (E2) prints each new-home decision's cost terms on the
chosen GPU and on the prefix's cheapest old home: the load term ``W``, ``M``, ``P`` and the
rest of the cost (prefill backlog and interference), and how much of the prompt the old
home really still held. Each GPU's requests, average latency and hit ratio follow, then,
with ``--state-every S`` (E2), the policy's view of each GPU every S seconds of the run;
``--slowest N`` then lists the N slowest requests: arrival, latency, time to first token,
prompt and cached tokens, the GPU and the decision that sent it there. A sweep draws its
requests once, for its heaviest rate, and replays the first ones at lighter rates;
``--draw N`` does the same, so that a lighter point of a sweep, or of a placement-suite
configuration of one GPU type without cache pressure (its heaviest load has ``--requests``
requests; a pressure configuration's pool is sized for the fleet instead), is audited on
the requests it ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Sequence

from prefixmesh.loadgen.cluster_sim import ClusterConfig, ClusterSim, pressure_blocks
from prefixmesh.loadgen.options import WorkloadSpec, add_workload_args
from prefixmesh.loadgen.policy_variants import parse_variant, split_variants
from prefixmesh.services.scheduler.policies.base import Decision, RouteInput
from prefixmesh.services.worker.engine.types import SimEngineConfig


def audit(spec: WorkloadSpec, policy: str, gpus: int, rate: float, duration_s: float,
          pressure: float, why: list[str] | None = None,
          per_gpu: dict[str, dict[str, float]] | None = None,
          slowest: list[str] | None = None, draw: int = 0,
          state: list[str] | None = None, state_every_s: float = 0.0,
          ) -> tuple[Counter, float, float]:
    """Decision classes, mean latency (s) and cache hit ratio of one simulated run;
    ``why`` (a list, E2 only) receives a line per new-home decision (``--why``),
    ``per_gpu`` each GPU's requests, latency, prompt and cached tokens (sums), ``slowest``
    a line per request, slowest first (``--slowest``). ``draw`` > the run's count: its
    requests are the first of ``draw`` drawn, as in a sweep whose heaviest rate needs
    ``draw`` (``--draw``). ``state`` (E2 only) receives, every ``state_every_s`` seconds
    of the run, a line per GPU of the policy's view of it (``--state-every``)."""
    n = max(1, round(rate * duration_s))
    reqs = spec.requests(max(n, draw))[:n]
    engine = (SimEngineConfig(num_blocks=pressure_blocks(reqs, gpus, pressure))
              if pressure > 0 else None)
    v = parse_variant(policy)
    sim = ClusterSim(ClusterConfig(gpus=gpus, policy=v.policy, policy_config=v.config,
                                   engine_config=engine))
    prefix_of = {f"r{i}": r.prefix_id for i, r in enumerate(reqs)}
    homes: dict[str, set[str]] = {}
    classes: Counter = Counter()
    route = sim.policy.route

    priced = why is not None and hasattr(sim.policy, "costs")
    chosen: dict[str, str] = {}
    kinds: dict[str, str] = {}

    viewed = state is not None and state_every_s > 0 and hasattr(sim.policy, "worker_state")
    next_view = state_every_s  # when to take the policy's view next (s of the run)

    def audited(req: RouteInput, now: float) -> Decision:
        nonlocal next_view
        if viewed and now >= next_view:
            _view(sim.policy, now, state)  # type: ignore[arg-type]
            while next_view <= now:
                next_view += state_every_s
        if priced:
            terms = sim.policy.explain(req, now)  # type: ignore[attr-defined]
            costs = sim.policy.costs(req, now)  # type: ignore[attr-defined]
        d = route(req, now)
        held = {w: e.cache.cached_prefix_tokens(req.block_hashes)
                for w, e in sim.engines.items()}
        most = max(held.values())
        where = "somewhere" if 2 * most >= req.prompt_tokens else "nowhere"
        to = "to_holder" if where == "somewhere" and held[d.worker_id] == most else "elsewhere"
        seen = homes.setdefault(prefix_of[req.request_id], set())
        home = "first" if not seen else "back_home" if d.worker_id in seen else "new_home"
        if priced and home == "new_home" and why is not None:
            old = min((w for w in seen if w in costs), key=costs.__getitem__)
            why.append(f"{d.kind:10s} old home {old} holds {held[old]}/{req.prompt_tokens} "
                       f"tokens; cost {costs[d.worker_id]:.3f} s there, old home +"
                       + _gap(terms[old], costs[old], terms[d.worker_id], costs[d.worker_id]))
        seen.add(d.worker_id)
        chosen[req.request_id] = d.worker_id
        kinds[req.request_id] = d.kind
        classes[(d.kind, where, to, home)] += 1
        return d

    sim.policy.route = audited  # type: ignore[method-assign]
    arrivals = spec.times(rate, n)
    run = sim.run(reqs, arrivals)
    done = [r for r in run.results if r.ok]
    if slowest is not None:
        for i in sorted(range(n), key=lambda i: -run.results[i].latency_s):
            r, rid = run.results[i], f"r{i}"
            where = f"{chosen.get(rid, '-')} ({kinds.get(rid, '-')})"
            slowest.append(f"{rid:>6s} at {arrivals[i]:7.2f} s: {r.latency_s:6.2f} s, first token "
                           f"{r.ttft_s:6.2f} s, prompt {r.prompt_tokens:6d}, cached "
                           f"{r.cached_tokens:6d} -> {where}")
    if per_gpu is not None:
        for i, r in enumerate(run.results):
            if r.ok:
                sums = per_gpu.setdefault(chosen[f"r{i}"], dict.fromkeys(
                    ("requests", "latency_s", "prompt", "cached"), 0.0))
                sums["requests"] += 1
                sums["latency_s"] += r.latency_s
                sums["prompt"] += r.prompt_tokens
                sums["cached"] += r.cached_tokens
    hit = sum(r.cached_tokens for r in done) / max(sum(r.prompt_tokens for r in done), 1)
    return classes, statistics.mean(r.latency_s for r in done), hit


def _view(policy: object, now: float, out: list[str]) -> None:
    """E2's view of each GPU at ``now``: ``L`` (its windowed GPU work), requests in the
    window and in flight, prefill backlog, and the queueing time of its last load report."""
    out.append(f"at {now:7.2f} s:")
    for w in sorted(policy.workers):  # type: ignore[attr-defined]
        ws = policy.worker_state(w)  # type: ignore[attr-defined]
        out.append(f"  {w}: L {ws.L:8.1f} s, {ws.n:5d} in the window, {ws.inflight:4d} in "
                   f"flight, backlog {max(0.0, ws.busy_until - now):6.1f} s, reported queue "
                   f"{ws.avg_queue_s:5.1f} s")


def _gap(old: tuple[float, float, float], old_cost: float, new: tuple[float, float, float],
         new_cost: float) -> str:
    """Old home's cost minus the chosen GPU's, in total and per term (seconds)."""
    rest = (old_cost - sum(old)) - (new_cost - sum(new))
    return (f"{old_cost - new_cost:.3f} s (W {old[0] - new[0]:+.3f}, M {old[1] - new[1]:+.3f}, "
            f"P {old[2] - new[2]:+.3f}, backlog + interference {rest:+.3f})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.route_audit",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_workload_args(p)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument("--cache-pressure", type=float, default=0.0)
    p.add_argument("--policies", default="e2,cache_aware")
    p.add_argument("--why", action="store_true",
                   help="print the cost terms of each E2 new-home decision")
    p.add_argument("--slowest", type=int, default=0, metavar="N",
                   help="list the N slowest requests and where they went")
    p.add_argument("--draw", type=int, default=0, metavar="N",
                   help="draw N requests and replay the first rate x duration of them, as "
                   "a sweep does at its lighter rates (the suite: N = its --requests, 500 by "
                   "default), so such a point is audited as it ran (default: draw rate x "
                   "duration)")
    p.add_argument("--state-every", type=float, default=0.0, metavar="SECONDS",
                   help="E2: every SECONDS of the run, print the policy's view of each GPU "
                   "(L, requests in the window and in flight, prefill backlog, reported "
                   "queueing time)")
    args = p.parse_args(argv)
    if args.state_every < 0:
        p.error("--state-every must be at least 0")
    if args.slowest < 0:
        p.error("--slowest must be at least 0")
    if args.draw < 0:
        p.error("--draw must be at least 0")
    spec = WorkloadSpec.from_args(args)
    for policy in split_variants(args.policies):
        why: list[str] | None = [] if args.why else None
        per_gpu: dict[str, dict[str, float]] = {}
        slow: list[str] | None = [] if args.slowest else None
        state: list[str] = []
        classes, avg, hit = audit(spec, policy, args.gpus, args.rate, args.duration,
                                  args.cache_pressure, why, per_gpu, slow, args.draw,
                                  state, args.state_every)
        print(f"{policy}: avg {avg:.3f} s, hit ratio {hit:.1%}")
        for key, count in sorted(classes.items()):
            print(f"  {' / '.join(key):55s} {count}")
        new = sum(c for k, c in classes.items() if k[3] == "new_home")
        print(f"  new homes: {new} of {sum(classes.values())}")
        for w, c in sorted(per_gpu.items()):
            n_w = c["requests"]
            print(f"  {w}: {n_w:.0f} requests, avg {c['latency_s'] / n_w:.2f} s, "
                  f"hit ratio {c['cached'] / max(c['prompt'], 1):.1%}")
        for line in why or ():
            print(f"    {line}")
        for line in state:
            print(f"  {line}")
        if slow:
            print(f"  slowest {min(args.slowest, len(slow))}:")
            for line in slow[:args.slowest]:
                print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
