"""Active-active scheduler replicas in the virtual-time simulator (``prefixmesh sim
--schedulers R --sync-delay-ms D``).

``ReplicatedPolicy`` stands where ``ClusterSim`` expects one global policy. It holds R
policy instances (one per replica, each with its own tree and load window) and splits the
arrivals among them as a NATS queue group on the route subject would (``round_robin``, or
``random`` with a seeded generator). Everything a replica learns from others reaches it
``D`` seconds after it happened, through one delayed-delivery queue in virtual time:

- the workers' KV events, load reports and completion records (every replica subscribes
  to all of them; with D > 0 even one replica sees them late), and
- the other replicas' routing decisions, applied with ``apply_remote_decision`` (the
  in-flight load and the predicted tree entries a decision adds).

Deliveries due by the time of a call are applied first, each at its own due time, so
every replica sees a non-decreasing clock and routes on exactly what had reached it.
With R = 1 and D = 0 it makes the same decisions as the bare policy.
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from prefixmesh.loadgen.report import load_runs
from prefixmesh.services.scheduler.policies import make_policy
from prefixmesh.services.scheduler.policies.base import (
    Decision,
    GlobalPolicy,
    PolicyConfig,
    RouteInput,
)
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.wire import KvEvent, LoadReportEvent, RequestDoneEvent

# How requests are spread over the replicas: as the route subject's queue group would
# (in turn, or at random), or by prompt head ("prefix": the block hash at
# PREFIX_SPLIT_BLOCKS picks the replica, as an edge publishing to one route subject per
# replica would), so that one replica sees every request of a prefix at once.
SPLITS = ("round_robin", "random", "prefix")
PREFIX_SPLIT_BLOCKS = 32


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """Scheduler replicas of one simulated cluster."""

    # Replicas routing at once (1: a single scheduler).
    schedulers: int = 1
    # Propagation delay of events, load reports, completions and decisions (seconds).
    sync_delay_s: float = 0.0
    # "round_robin" or "random" (seeded by ``seed``).
    split: str = "round_robin"
    seed: int = 0
    # Whether replicas learn each other's decisions (False: only the workers' events, the
    # setup whose load counts shrink to 1/R; an ablation).
    share_decisions: bool = True

    def __post_init__(self) -> None:
        if self.schedulers < 1:
            raise ValueError("schedulers must be at least 1")
        if self.sync_delay_s < 0:
            raise ValueError("sync_delay_s must not be negative")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}")

    @property
    def replicated(self) -> bool:
        """Whether this differs from one scheduler that sees everything at once."""
        return self.schedulers > 1 or self.sync_delay_s > 0


class ReplicatedPolicy:
    """R replicas of a global policy behind the simulator's one-policy interface."""

    def __init__(self, name: str, config: PolicyConfig, cost: CostModel,
                 replicas: ReplicaConfig) -> None:
        self.rcfg = replicas
        self.replicas: list[GlobalPolicy] = [make_policy(name, config, cost)
                                             for _ in range(replicas.schedulers)]
        self.delay = replicas.sync_delay_s
        self._rng = random.Random(replicas.seed) if replicas.split == "random" else None
        self._turn = 0
        # (due time, push order, what to apply at that time)
        self._queue: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        # Decisions each replica made (load split, for the result row).
        self.routed = [0] * replicas.schedulers
        # Remote decisions applied, all replicas together.
        self.remote_applied = 0

    def _deliver(self, now: float) -> None:
        """Apply every delivery due by ``now``, in due-time order."""
        q = self._queue
        while q and q[0][0] <= now:
            due, _, apply = heapq.heappop(q)
            apply(due)

    def _later(self, now: float, apply: Callable[[float], None]) -> None:
        """Deliver ``apply`` after the sync delay (at once when there is none)."""
        if self.delay <= 0:
            apply(now)
            return
        self._seq += 1
        heapq.heappush(self._queue, (now + self.delay, self._seq, apply))

    def _broadcast(self, now: float, apply: Callable[[GlobalPolicy, float], None]) -> None:
        """Something every replica receives: each after the sync delay."""
        self._deliver(now)
        for p in self.replicas:
            self._later(now, partial(apply, p))

    def add_worker(self, worker_id: str, capacity_tokens: int, now: float) -> None:
        """Registration reaches every replica at once (workers register before serving)."""
        self._deliver(now)
        for p in self.replicas:
            p.add_worker(worker_id, capacity_tokens, now)

    def route(self, req: RouteInput, now: float) -> Decision:
        """The replica whose turn it is routes; the others learn the decision later."""
        self._deliver(now)
        n = len(self.replicas)
        if self._rng is not None:
            i = self._rng.randrange(n)
        elif self.rcfg.split == "prefix" and req.block_hashes:
            hashes = req.block_hashes
            i = hashes[min(PREFIX_SPLIT_BLOCKS, len(hashes)) - 1] % n
        else:
            i = self._turn
            self._turn = (i + 1) % n
        d = self.replicas[i].route(req, now)
        self.routed[i] += 1
        if not self.rcfg.share_decisions:
            return d
        for j, p in enumerate(self.replicas):
            if j != i:
                self._later(now, partial(self._remote, p, req, d))
        return d

    def _remote(self, p: GlobalPolicy, req: RouteInput, d: Decision, t: float) -> None:
        p.apply_remote_decision(req, d, t)
        self.remote_applied += 1

    def on_kv_events(self, worker_id: str, events: list[KvEvent], now: float) -> None:
        """A worker's KV events, to every replica."""
        self._broadcast(now, lambda p, t: p.on_kv_events(worker_id, events, t))

    def on_load(self, report: LoadReportEvent, now: float) -> None:
        """A worker's load report, to every replica."""
        self._broadcast(now, lambda p, t: p.on_load(report, t))

    def on_done(self, done: RequestDoneEvent, now: float) -> None:
        """A completion record, to every replica."""
        self._broadcast(now, lambda p, t: p.on_done(done, t))

    def tick(self, now: float) -> None:
        """Each replica's own maintenance, on what has reached it."""
        self._deliver(now)
        for p in self.replicas:
            p.tick(now)


# ---------------------------------------------------------------------- prefixmesh sim


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """``--schedulers``, ``--sync-delay-ms`` (comma lists: every pair is a point) and
    ``--split``."""
    p.add_argument("--schedulers", default="1",
                   help="scheduler replicas routing at once, or a comma list (e.g. 1,2,4,8)")
    p.add_argument("--sync-delay-ms", default="0",
                   help="delay before a replica sees KV events, load reports, completions "
                   "and the other replicas' decisions (ms), or a comma list (e.g. 0,1,10,50)")
    p.add_argument("--split", default="round_robin", choices=SPLITS,
                   help="how arrivals are spread over the replicas (a queue group)")
    p.add_argument("--no-share-decisions", action="store_true",
                   help="replicas do not learn each other's decisions (only the workers' "
                   "events): an ablation")


def replica_configs(args: argparse.Namespace) -> list[ReplicaConfig]:
    """Every (schedulers, delay) pair of the arguments; one scheduler is one point
    whatever the delays when it is the only count and the delays are all 0."""
    try:
        counts = [int(x) for x in str(args.schedulers).split(",") if x.strip()]
        delays = [float(x) for x in str(args.sync_delay_ms).split(",") if x.strip()]
        return [ReplicaConfig(schedulers=r, sync_delay_s=d / 1000, split=args.split,
                              seed=args.seed, share_decisions=not args.no_share_decisions)
                for r in counts for d in delays]
    except ValueError as exc:
        raise SystemExit(f"--schedulers / --sync-delay-ms: {exc}") from None


def replica_label(label: str, rc: ReplicaConfig) -> str:
    """``e2`` -> ``e2@4x10ms`` (4 replicas, 10 ms) when replicated; unchanged otherwise,
    so a single scheduler's rows keep the label every other report uses."""
    if not rc.replicated:
        return label
    tail = "" if rc.share_decisions else "-nodec"
    if rc.split != "round_robin":
        tail += f"-{rc.split}"
    return f"{label}@{rc.schedulers}x{rc.sync_delay_s * 1000:g}ms{tail}"


def replica_fields(rc: ReplicaConfig, policy: object) -> dict:
    """Result-row fields of the replica setup (and, replicated, each replica's share)."""
    row: dict = {"schedulers": rc.schedulers, "sync_delay_ms": rc.sync_delay_s * 1000}
    if isinstance(policy, ReplicatedPolicy):
        row.update(split=rc.split, share_decisions=rc.share_decisions,
                   replica_routed=policy.routed,
                   remote_applied=policy.remote_applied)
    return row


# ---------------------------------------------------------------------- report


def _mean(rows: Sequence[dict], field: str) -> float:
    return sum(r[field] for r in rows) / len(rows)


Groups = dict[tuple, dict[tuple[int, float, str], dict]]


def _groups(runs: Sequence[dict]) -> Groups:
    """(workload, GPUs, rate, policy, local) -> (schedulers, delay ms, mode) -> seed -> row;
    mode "yes" (decisions shared, queue-group split), "no" (not shared) or the split when
    another."""
    groups: Groups = {}
    for r in runs:
        base = str(r["policy"]).split("@")[0]
        key = (r["workload"], r["gpus"], r["rate"], base, r.get("local_policy"))
        split = r.get("split", "round_robin")
        mode = "yes" if r.get("share_decisions", True) else "no"
        if split != "round_robin":
            mode += f", {split} split"
        point = (int(r.get("schedulers", 1)), float(r.get("sync_delay_ms", 0.0)), mode)
        groups.setdefault(key, {}).setdefault(point, {})[r.get("seed")] = r
    return groups


def _versus(by_seed: dict, one: dict) -> tuple[list, float, float, float, float] | None:
    """Seeds both ran, mean avg and p99 over them, and their change against ``one``."""
    seeds = sorted(set(by_seed) & set(one), key=str)
    if not seeds:
        return None
    rows = [by_seed[s] for s in seeds]
    ref = [one[s] for s in seeds]
    avg, p99 = _mean(rows, "latency_avg_s"), _mean(rows, "latency_p99_s")
    return (seeds, avg, p99, avg / _mean(ref, "latency_avg_s") - 1,
            p99 / _mean(ref, "latency_p99_s") - 1)


def _panels(runs: Sequence[dict]) -> Iterator[tuple[tuple, dict, dict]]:
    """Each panel's key, its points and its one-scheduler reference (panels without one
    are skipped), in a stable order."""
    for key, points in sorted(_groups(runs).items(), key=str):
        one = points.get((1, 0.0, "yes"))
        if one is not None:
            yield key, points, one


def replica_matrix(runs: Sequence[dict]) -> str:
    """Markdown, compact: per panel, schedulers x sync delay, each cell the change of the
    mean average / p99 latency against one scheduler with no delay (decisions shared)."""
    out: list[str] = []
    for (workload, gpus, rate, policy, local), points, one in _panels(runs):
        delays = sorted({d for _, d, mode in points if mode == "yes"})
        counts = sorted({n for n, _, mode in points if mode == "yes"})
        out.append(f"{workload}, {gpus} GPUs, {rate:g} req/s, {policy}/{local}: one "
                   f"scheduler {_mean(list(one.values()), 'latency_avg_s'):.3f} / "
                   f"{_mean(list(one.values()), 'latency_p99_s'):.3f} s (avg / p99, seeds "
                   f"{', '.join(map(str, sorted(one, key=str)))})\n")
        out.append("| schedulers | " + " | ".join(f"{d:g} ms" for d in delays) + " |")
        out.append("|---|" + "---|" * len(delays))
        for n in counts:
            cells = []
            for d in delays:
                v = _versus(points.get((n, d, "yes"), {}), one)
                cells.append("" if v is None else f"{v[3]:+.1%} / {v[4]:+.1%}"
                             + ("" if len(v[0]) == len(one)
                                else " (seed " + ", ".join(map(str, v[0])) + ")"))
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def replica_report(runs: Sequence[dict]) -> str:
    """Markdown: per (workload, GPUs, rate, policy), each (schedulers, delay) point against
    one scheduler with no delay, means over the seeds both ran."""
    out: list[str] = []
    for (workload, gpus, rate, policy, local), points, one in _panels(runs):
        out.append(f"### {workload}, {gpus} GPUs, {rate:g} req/s, {policy}/{local}\n")
        out.append("| schedulers | sync delay ms | decisions shared | seeds | avg s | p99 s "
                   "| hit | failed | avg vs 1 | p99 vs 1 |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for (n, d, mode), by_seed in sorted(points.items(),
                                            key=lambda kv: (kv[0][2] != "yes", kv[0][2],
                                                            kv[0][:2])):
            v = _versus(by_seed, one)
            if v is None:
                continue
            seeds, avg, p99, d_avg, d_p99 = v
            rows = [by_seed[s] for s in seeds]
            out.append(f"| {n} | {d:g} | {mode} | "
                       f"{', '.join(map(str, seeds))} | {avg:.3f} | "
                       f"{p99:.3f} | {_mean(rows, 'cache_hit_ratio'):.1%} | "
                       f"{sum(r['failed'] for r in rows)} | {d_avg:+.1%} | {d_p99:+.1%} |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.loadgen.sim_replicas",
                                description="Scheduler replicas against one scheduler "
                                "(results of prefixmesh sim --schedulers ... "
                                "--sync-delay-ms ...).")
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--matrix", action="store_true",
                   help="compact: schedulers x delay, change of avg / p99 per cell")
    args = p.parse_args(argv)
    runs = load_runs(args.results)
    print(replica_matrix(runs) if args.matrix else replica_report(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
