"""In-process decision benchmark of a global policy (``prefixmesh bench-scheduler``).

Builds a synthetic prompt stream with the sharing structure of Preble's workloads
(docs/design.md section 10), warms the policy, then times ``route()`` one decision at a time with
``time.perf_counter_ns`` on one core. Between decisions (untimed) it feeds what a live
cluster would: KV events from a per-worker LRU block cache, completion records, periodic
load reports and ``tick``. Block hashes are computed before timing: the edge computes
them, not the scheduler.

Output (docs/design.md section 11): ``{"workload", "workers", "policy", "decisions_per_s", "p50_us",
"p99_us"}``, plus ``feedback_us_per_decision``: what the policy spent on the untimed
feedback (KV events, completions, load reports, ticks) over the timed part, per timed
decision (both replicas' with ``--remote``).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import os
import random
import sys
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

from prefixmesh.services.scheduler.policies import POLICY_NAMES, make_policy
from prefixmesh.services.scheduler.policies.base import (
    GlobalPolicy,
    PolicyConfig,
    RouteInput,
)
from prefixmesh.services.scheduler.replicas import apply_peer_decisions, routed
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes, extend_hashes
from prefixmesh.shared.bus import BatchLimits
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel
from prefixmesh.shared.runtime.lifecycle import settle_gc
from prefixmesh.shared.wire import (
    BUS_EVENT,
    BlockRemoved,
    BlockStored,
    LoadReportEvent,
    RequestDoneEvent,
    RoutingDecisionsEvent,
    encode,
)

WORKLOADS = ("toolbench", "videoqa")
VOCAB = 32_000
# Shapes (Preble Table 1): prompt mean/std, output mean/std, arrival rate for 16 workers.
TOOLBENCH_SYSTEM_TOKENS = 160
TOOLBENCH_TOOLS = 2_000
TOOLBENCH_ZIPF = 1.1
TOOLBENCH_TOOL_TOKENS = (1_400, 700)  # mean, std of one tool's instructions
TOOLBENCH_QUERY_TOKENS = (275, 120)  # unique part: ~15% of 1835
TOOLBENCH_OUTPUT = (43, 16)
VIDEOQA_SYSTEM_TOKENS = 96
VIDEOQA_VIDEO_TOKENS = (9_800, 5_900)  # frame_count / 30 * 256
VIDEOQA_QUESTIONS = (3, 9)  # questions per video, inclusive range
VIDEOQA_ACTIVE = 48  # videos being asked about at any time
VIDEOQA_QUESTION_TOKENS = (24, 8)
VIDEOQA_OUTPUT = (4, 1.5)
DEFAULT_RATE = {"toolbench": 160.0, "videoqa": 48.0}  # requests per second, 16 workers
# Simulated cluster feedback (untimed).
LOAD_REPORT_S = 0.25
TICK_S = 0.1
SERVICE_S_PER_OUTPUT = 0.03  # seconds per output token a simulated request takes
# The feedback the policy gets between decisions, timed apart from them.
FEEDBACK = ("kv_events", "done", "load", "tick")
KV_DELAY_S = 0.05  # routing -> BlockStored delay (prefill time)
# Requests of one routing message at most, as a busy edge sends them (``--message``).
MESSAGE_REQUESTS = BatchLimits().max_batch


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a stream: arrival time (s), what the edge sends, real output length,
    and where its shared parts end (blocks of system prompt; of system prompt + head)."""

    t: float
    route: RouteInput
    output_tokens: int
    system_blocks: int = 0
    head_blocks: int = 0


def _tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(VOCAB), k=n)


def _normal_int(rng: random.Random, mean_std: tuple[float, float], lo: int) -> int:
    return max(lo, int(rng.gauss(*mean_std)))


@dataclass(frozen=True, slots=True)
class _Prefix:
    """A shared prompt head, kept as its block hashes and the tokens after its last full
    block (the token list itself is not kept: big short-lived lists only load the GC)."""

    tokens: int
    hashes: list[int]
    rest: list[int]
    system_blocks: int

    @staticmethod
    def of(system: list[int], head: list[int]) -> _Prefix:
        tokens = system + head
        hashes = block_hashes(tokens)
        return _Prefix(
            len(tokens), hashes, tokens[len(hashes) * BLOCK_SIZE :], len(system) // BLOCK_SIZE
        )

    def prompt(self, tail: list[int]) -> list[int]:
        """Block hashes of this head followed by ``tail``, continuing the chain."""
        if not self.hashes:
            return block_hashes(self.rest + tail)
        return self.hashes + extend_hashes(self.hashes[-1], self.rest + tail)

    def request(self, t: float, request_id: str, tail: list[int], max_tokens: int,
                output_tokens: int) -> BenchRequest:
        """The request of this head + ``tail`` arriving at ``t``."""
        return BenchRequest(
            t,
            RouteInput(request_id, self.prompt(tail), self.tokens + len(tail), max_tokens),
            output_tokens,
            self.system_blocks,
            len(self.hashes),
        )


def toolbench_stream(rate: float, seed: int = 0) -> Iterator[BenchRequest]:
    """System prompt + one of many tool instructions (Zipf 1.1) + a unique query."""
    rng = random.Random(seed)
    system = _tokens(rng, TOOLBENCH_SYSTEM_TOKENS)
    # workloads.base.zipf_weights computes the same, but importing it would load the whole
    # workloads package (numpy, the data registry) into every bench-scheduler start.
    cum = list(itertools.accumulate(1.0 / k**TOOLBENCH_ZIPF
                                    for k in range(1, TOOLBENCH_TOOLS + 1)))
    tools: dict[int, _Prefix] = {}
    t = 0.0
    for i in itertools.count():
        t += rng.expovariate(rate)
        k = min(bisect.bisect_left(cum, rng.random() * cum[-1]), TOOLBENCH_TOOLS - 1)
        prefix = tools.get(k)
        if prefix is None:
            instr = _tokens(rng, _normal_int(rng, TOOLBENCH_TOOL_TOKENS, 200))
            prefix = tools[k] = _Prefix.of(system, instr)
        query = _tokens(rng, _normal_int(rng, TOOLBENCH_QUERY_TOKENS, 32))
        yield prefix.request(t, f"tb-{i}", query, 256, _normal_int(rng, TOOLBENCH_OUTPUT, 1))


def videoqa_stream(rate: float, seed: int = 0) -> Iterator[BenchRequest]:
    """System prompt + video tokens shared by several questions + a short question."""
    rng = random.Random(seed)
    system = _tokens(rng, VIDEOQA_SYSTEM_TOKENS)
    active: list[list] = []  # [prefix, questions_left]
    t = 0.0
    for i in itertools.count():
        while len(active) < VIDEOQA_ACTIVE:
            video = _tokens(rng, _normal_int(rng, VIDEOQA_VIDEO_TOKENS, 1_000))
            active.append([_Prefix.of(system, video), rng.randint(*VIDEOQA_QUESTIONS)])
        t += rng.expovariate(rate)
        j = rng.randrange(len(active))
        prefix, left = active[j]
        question = _tokens(rng, _normal_int(rng, VIDEOQA_QUESTION_TOKENS, 4))
        if left <= 1:
            active[j] = active[-1]
            active.pop()
        else:
            active[j][1] = left - 1
        yield prefix.request(t, f"vq-{i}", question, 8, _normal_int(rng, VIDEOQA_OUTPUT, 1))


def make_stream(workload: str, rate: float | None = None, seed: int = 0) -> Iterator[BenchRequest]:
    """The named synthetic stream at ``rate`` requests/s (default: sized for 16 workers)."""
    r = rate if rate is not None else DEFAULT_RATE[workload]
    if workload == "toolbench":
        return toolbench_stream(r, seed)
    if workload == "videoqa":
        return videoqa_stream(r, seed)
    raise ValueError(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")


class _Mirrored:
    """The timed policy and a peer replica of it (``--remote``): the cluster's feedback
    reaches both, and the peer learns the timed policy's decisions by
    ``apply_remote_decision`` (timed too: what each replica spends per decision another
    replica made)."""

    def __init__(self, main: GlobalPolicy, peer: GlobalPolicy) -> None:
        self.main, self.peer = main, peer

    @property
    def workers(self) -> Collection[str]:
        return self.main.workers

    def on_kv_events(self, worker: str, events: list, now: float) -> None:
        self.main.on_kv_events(worker, events, now)
        self.peer.on_kv_events(worker, events, now)

    def on_load(self, report: LoadReportEvent, now: float) -> None:
        self.main.on_load(report, now)
        self.peer.on_load(report, now)

    def on_done(self, done: RequestDoneEvent, now: float) -> None:
        self.main.on_done(done, now)
        self.peer.on_done(done, now)

    def tick(self, now: float) -> None:
        self.main.tick(now)
        self.peer.tick(now)


class _Cluster:
    """Untimed stand-in for the workers: prefix caches, completions, load reports.

    A worker's cache is an LRU of prompt segments (system prompt, shared head, unique
    tail), each stored and evicted whole, so KV events look like a real prefix cache's
    (tails go before heads, a shared system prompt stays) at a cost per request that does
    not grow with prompt length: the workers are other processes and should not crowd the
    scheduler's CPU caches here.
    """

    def __init__(self, policy: GlobalPolicy | _Mirrored, workers: list[str],
                 capacity_blocks: int) -> None:
        self.policy = policy
        # Nanoseconds the policy spent on each kind of feedback (``clock``: set by the run).
        self.clock = time.perf_counter_ns
        self.spent = dict.fromkeys(FEEDBACK, 0)
        self.capacity = capacity_blocks
        # Per worker: last hash of a segment -> its hashes, least recently used first.
        self.caches: dict[str, OrderedDict[int, list[int]]] = {w: OrderedDict() for w in workers}
        self.used: dict[str, int] = dict.fromkeys(workers, 0)
        self.busy: dict[str, int] = dict.fromkeys(workers, 0)
        self.prefill: dict[str, int] = dict.fromkeys(workers, 0)
        # (due time, push order, a completion or the (worker, request) whose KV is stored)
        self.events: list[tuple[float, int, RequestDoneEvent | tuple[str, BenchRequest]]] = []
        self.seq = 0
        self.next_report = 0.0
        self.next_tick = 0.0

    def _feed(self, kind: str, handler: Callable[..., None], *args: object) -> None:
        """Hand the policy one piece of feedback, its time counted under ``kind``."""
        t0 = self.clock()
        handler(*args)
        self.spent[kind] += self.clock() - t0

    def _push(self, t: float, ev: RequestDoneEvent | tuple[str, BenchRequest]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, ev))

    def routed(self, br: BenchRequest, worker: str, matched: int) -> None:
        """Queue the KV events and the completion of a request just routed."""
        self.busy[worker] += 1
        self.prefill[worker] += br.route.prompt_tokens - matched
        self._push(br.t + KV_DELAY_S, (worker, br))
        done = RequestDoneEvent(
            request_id=br.route.request_id,
            worker_id=worker,
            prompt_tokens=br.route.prompt_tokens,
            cached_tokens=matched,
            completion_tokens=br.output_tokens,
        )
        self._push(br.t + KV_DELAY_S + SERVICE_S_PER_OUTPUT * br.output_tokens, done)

    def _cache(self, worker: str, br: BenchRequest, now: float) -> None:
        hashes = br.route.block_hashes
        cuts = sorted({0, br.system_blocks, br.head_blocks, len(hashes)})
        segments = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        lru = self.caches[worker]
        events: list = []
        for a, b in segments:  # parents first, as a worker reports them
            if hashes[b - 1] not in lru:
                seg = list(hashes[a:b])
                lru[hashes[b - 1]] = seg
                self.used[worker] += len(seg)
                events.append(BlockStored(seg, hashes[a - 1] if a else None, [], BLOCK_SIZE))
        for _, b in reversed(segments):  # tail refreshed first: the system prompt is newest
            lru.move_to_end(hashes[b - 1])
        while self.used[worker] > self.capacity:
            _, seg = lru.popitem(last=False)
            self.used[worker] -= len(seg)
            events.append(BlockRemoved(seg))
        if events:
            self._feed("kv_events", self.policy.on_kv_events, worker, events, now)

    def advance(self, now: float) -> None:
        """Deliver everything due by ``now``."""
        events = self.events
        while events and events[0][0] <= now:
            t, _, ev = heapq.heappop(events)
            if isinstance(ev, RequestDoneEvent):
                self.busy[ev.worker_id] -= 1
                if ev.worker_id in self.policy.workers:
                    self._feed("done", self.policy.on_done, ev, t)
            else:
                worker, br = ev
                if worker in self.policy.workers:
                    self._cache(worker, br, t)
        while self.next_report <= now:
            self._reports(self.next_report)
            self.next_report += LOAD_REPORT_S
        while self.next_tick <= now:
            self._feed("tick", self.policy.tick, self.next_tick)
            self.next_tick += TICK_S

    def _reports(self, t: float) -> None:
        # Decode tokens: one per running request per step (~10 steps per report period).
        for w, busy in self.busy.items():
            decode = busy * 10
            prefill = self.prefill[w]
            self.prefill[w] = 0
            share = decode / (decode + prefill) if decode + prefill else 0.0
            self._feed("load", self.policy.on_load,
                       LoadReportEvent(w, t, running=busy, total_blocks=self.capacity,
                                       free_blocks=max(self.capacity - self.used[w], 0),
                                       decode_share=share),
                       t)


def setup_policy(policy: str, workers: int, config: PolicyConfig | None, profile: str,
                 peer: bool = False) -> tuple[GlobalPolicy, _Cluster, GlobalPolicy | None]:
    """The policy with ``workers`` registered workers, the cluster that feeds it and (with
    ``peer``) a second replica fed the same."""
    cost = CostModel.load(profile)
    names = [f"w{i}" for i in range(workers)]
    pols = []
    for _ in range(2 if peer else 1):
        pols.append(p := make_policy(policy, config or PolicyConfig(), cost))
        for w in names:
            p.add_worker(w, cost.kv_capacity_tokens, 0.0)
    fed = _Mirrored(pols[0], pols[1]) if peer else pols[0]
    return pols[0], _Cluster(fed, names, cost.capacity_blocks), pols[1] if peer else None


def _quantiles(times: list[int]) -> tuple[float, float, float]:
    """Calls per second of work, p50 and p99 (µs) of sorted nanosecond timings."""
    total_s = sum(times) / 1e9
    return (round(len(times) / total_s, 1) if total_s else 0.0,
            round(times[len(times) // 2] / 1e3, 2),
            round(times[min(len(times) - 1, int(len(times) * 0.99))] / 1e3, 2))


def policy_memory(
    workload_stream: Iterable[BenchRequest],
    workers: int,
    requests: int,
    policy: str = "e2",
    *,
    workload: str = "custom",
    profile: str = DEFAULT_PROFILE,
) -> dict:
    """Memory the policy holds after routing ``requests`` requests of the stream (untimed).

    Counted with ``tracemalloc``: the live allocations made in the scheduler's own code
    (``services/scheduler/``: tree nodes, caching sets, LRU orders, the load window), not
    the stand-in cluster's. ``bytes_per_worker`` is that total over the workers.
    """
    tracemalloc.start()
    try:
        pol, cluster, _ = setup_policy(policy, workers, None, profile)
        for br in itertools.islice(workload_stream, requests):
            cluster.advance(br.t)
            d = pol.route(br.route, br.t)
            cluster.routed(br, d.worker_id, d.matched_tokens)
        only = [tracemalloc.Filter(True, f"*{os.sep}services{os.sep}scheduler{os.sep}*")]
        snap = tracemalloc.take_snapshot().filter_traces(only)
    finally:
        tracemalloc.stop()
    total = sum(st.size for st in snap.statistics("filename"))
    tree = pol.summary().tree
    window = getattr(pol, "window", None)
    return {
        "workload": workload,
        "workers": workers,
        "policy": policy,
        "requests": requests,
        "policy_bytes": total,
        "bytes_per_worker": round(total / workers),
        "tree_nodes": tree.n_nodes if tree is not None else 0,
        "tree_blocks": tree.n_blocks if tree is not None else 0,
        # Blocks the tree holds per worker (a block cached by two workers counts twice).
        "cached_blocks": sum(tree.worker_blocks.values()) if tree is not None else 0,
        "window_entries": len(window.entries) if window is not None else 0,
    }


def run_bench(
    workload_stream: Iterable[BenchRequest],
    workers: int = 16,
    requests: int = 20_000,
    policy: str = "e2",
    *,
    workload: str = "custom",
    warmup: int = 5_000,
    config: PolicyConfig | None = None,
    profile: str = DEFAULT_PROFILE,
    remote: bool = False,
    cpu_clock: bool = False,
    wire: bool = False,
    message: int = MESSAGE_REQUESTS,
) -> dict:
    """Warm ``policy`` with ``warmup`` requests, then time ``requests`` decisions of the stream.

    ``remote``: a peer replica learns each decision (``apply_remote_decision``), timed as
    ``remote_*`` (what a replica spends on a decision another one made). ``cpu_clock``:
    time with this thread's CPU clock instead of the wall clock, so that the time slices
    other processes take on a shared machine do not count (the policy's own work,
    garbage collections included, does). ``wire``: the peer gets each decision as a replica
    does, in a ``RoutingDecisionsEvent`` (of one decision) decoded from bytes and applied by
    ``apply_peer_decisions``, decoding timed with the applying (encoding, the deciding
    replica's work, is not).

    ``message``: the timed decisions are also summed ``message`` at a time with the
    feedback the policy took in before each of them, as ``message_*`` quantiles (ms): how
    long one routing message of that many requests holds a scheduler's event loop, what a
    step paid now and then by a few decisions (an index flush, a trim) does to the requests
    of a whole message, which the per-decision quantiles hide (with ``remote``, the peer's
    share of the feedback is in it too)."""
    pol, cluster, peer = setup_policy(policy, workers, config, profile, peer=remote)
    stream = iter(workload_stream)
    times: list[int] = []
    applied: list[int] = []
    clock = time.thread_time_ns if cpu_clock else time.perf_counter_ns
    cluster.clock = clock
    loop: list[int] = []  # each timed decision plus the feedback taken in before it (ns)
    spent = cluster.spent
    for i in range(warmup + requests):
        if i == warmup:
            spent = cluster.spent = dict.fromkeys(FEEDBACK, 0)
        br = next(stream)
        fed = sum(spent.values())
        cluster.advance(br.t)
        fed = sum(spent.values()) - fed
        t0 = clock()
        d = pol.route(br.route, br.t)
        t1 = clock()
        if peer is not None:
            data = encode(RoutingDecisionsEvent(scheduler_id="bench", ts=br.t,
                                                decisions=[routed(br.route, d)])) if wire else b""
            t2 = clock()
            if wire:
                ev = BUS_EVENT.decode(data)
                assert isinstance(ev, RoutingDecisionsEvent)
                apply_peer_decisions(peer, ev, "peer", br.t)
            else:
                peer.apply_remote_decision(br.route, d, br.t)
            if i >= warmup:
                applied.append(clock() - t2)
        if i >= warmup:
            times.append(t1 - t0)
            loop.append(t1 - t0 + fed)
        cluster.routed(br, d.worker_id, d.matched_tokens)
    messages = sorted(sum(loop[k : k + message]) / 1e6
                      for k in range(0, len(loop) - message + 1, message))
    times.sort()
    per_s, p50, p99 = _quantiles(times)
    out = {"workload": workload, "workers": workers, "policy": policy,
           "decisions_per_s": per_s, "p50_us": p50, "p99_us": p99,
           "clock": "cpu" if cpu_clock else "wall",
           # What the policy spent on the cluster's feedback (KV events, completions, load
           # reports, ticks) over the timed part, per timed decision.
           "feedback_us_per_decision": {k: round(ns / 1e3 / max(requests, 1), 2)
                                        for k, ns in cluster.spent.items()}}
    if messages:
        out.update(message_requests=message,
                   message_p50_ms=round(messages[len(messages) // 2], 3),
                   message_p99_ms=round(messages[min(len(messages) - 1,
                                                     int(len(messages) * 0.99))], 3),
                   message_max_ms=round(messages[-1], 3))
    if applied:
        applied.sort()
        per_s, p50, p99 = _quantiles(applied)
        # Mean time of a remote decision over a decision's own: the share of a replica's
        # policy CPU that the other replicas' decisions take is (R - 1) x this.
        out.update(remote_per_s=per_s, remote_p50_us=p50, remote_p99_us=p99,
                   remote_cost_ratio=round(sum(applied) / sum(times), 3))
    return out


# The on/off options of the command line and what each turns on.
SWITCHES = {
    "--remote": "also time a peer replica learning each decision (apply_remote_decision): "
                "remote_* figures",
    "--remote-wire": "with --remote: the peer decodes each decision from the decisions "
                     "subject's bytes first, as a replica does (timed with the applying)",
    "--cpu-clock": "time with the thread's CPU clock (other processes' time slices on a "
                   "shared machine do not count)",
    "--memory": "measure the policy's memory after warmup + requests decisions "
                "(tracemalloc, untimed) instead of timing",
}


def main(argv: list[str] | None = None) -> int:
    """CLI: ``bench-scheduler --workload W --workers N --requests K --json OUT``."""
    ap = argparse.ArgumentParser(
        prog="prefixmesh bench-scheduler",
        description="Time the global policy's decisions in process, on one core "
        "(prefixmesh bench-scheduler --live --help: the same through the scheduler service "
        "over NATS).",
    )
    ap.add_argument("--workload", choices=WORKLOADS, default="toolbench")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20_000, help="timed decisions")
    ap.add_argument("--warmup", type=int, default=5_000, help="untimed decisions first")
    ap.add_argument("--policy", choices=POLICY_NAMES, default="e2")
    ap.add_argument("--rate", type=float, default=None,
                    help="arrivals per second (virtual; default: the stream's rate for 16 "
                    "workers, times workers / 16 with --scale-rate)")
    ap.add_argument("--scale-rate", action="store_true",
                    help="scale the default rate with the workers (the same load per worker)")
    for flag, text in SWITCHES.items():
        ap.add_argument(flag, action="store_true", help=text)
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="cost-model profile")
    ap.add_argument("--message", type=int, default=MESSAGE_REQUESTS, metavar="N",
                    help="also report how long N consecutive decisions, with the feedback "
                    "taken in between, hold the loop (message_* in ms: one routing "
                    f"message of N requests; default {MESSAGE_REQUESTS}, the edge's "
                    "--route-batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here too")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.requests < 1 or args.warmup < 0:
        ap.error("--workers and --requests must be at least 1, --warmup at least 0")
    if args.message < 1:
        ap.error("--message must be at least 1 (requests a message)")
    if args.rate is not None and not args.rate > 0:
        ap.error(f"--rate must be positive, got {args.rate:g}")
    rate = args.rate
    if rate is None and args.scale_rate:
        rate = DEFAULT_RATE[args.workload] * args.workers / 16
    if args.memory:
        result = policy_memory(make_stream(args.workload, rate, args.seed), args.workers,
                               args.warmup + args.requests, args.policy,
                               workload=args.workload, profile=args.profile)
        result["rate"] = rate
        return emit(result, args.json)
    # The garbage collector as the scheduler service sets it once started: without, a
    # full collection walks every object of the tree and window now and then (tens of ms).
    settle_gc()
    result = run_bench(
        make_stream(args.workload, rate, args.seed),
        workers=args.workers,
        requests=args.requests,
        policy=args.policy,
        workload=args.workload,
        warmup=args.warmup,
        profile=args.profile,
        remote=args.remote or args.remote_wire,
        cpu_clock=args.cpu_clock,
        wire=args.remote_wire,
        message=args.message,
    )
    result["rate"] = rate
    return emit(result, args.json)


def emit(result: dict, path: str | None) -> int:
    """Print the result line, and write it to ``path`` too."""
    text = json.dumps(result)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
