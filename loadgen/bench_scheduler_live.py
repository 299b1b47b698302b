"""``prefixmesh bench-scheduler --live``: routing decisions through the scheduler service.

Starts its own nats-server and redis-server (free ports) unless ``--nats-url`` /
``--redis-url`` name running ones, and a scheduler process unless ``--external-scheduler``
says one already serves ``--prefix`` on that NATS. It registers
``--workers`` workers by publishing their load reports, then sends the same prompt stream as
the in-process benchmark as TokenizedRequests over NATS with ``--in-flight`` outstanding, and
reports decisions per second and client-side latency percentiles (request/reply round
trip: msgpack encode, NATS hop, decision, reply).

With ``--step-ms MS``, each routed request's completion record goes to the scheduler
(subject ``done``) once its output would have been generated, MS a token after its answer,
in one ``RequestDoneBatch`` per worker every step, as workers send theirs: the scheduler's
load window then holds the requests in flight, as in a fleet, and the scheduler pays for
reading the records. By default none is sent (as the figures in docs/benchmarks.md were
measured): every request stays in the window until it expires.

``--schedulers N`` spawns N active-active replicas (one routing queue group, each charging
the others' decisions): the result adds each replica's share of the decisions and the CPU
all of them spent per decision.

The client routes as the edge does (``shared/bus.py`` ``RequestBatcher``): while
``--route-inflight`` messages are unanswered, new requests wait and go together in the
next one, ``--route-batch`` at most (``--route-batch 1``: one message per request). Each
request's latency runs from its own send to its own answer. ``--in-flight`` client loops
each send the next request as soon as theirs is answered, the ``--warmup`` requests and
the timed ones in one run (the timed part starts with its first request, the pipeline
full and steady, not drained and refilled at once); the prepared messages are moved
out of the garbage collector's sight (``gc.freeze``) so that the client's own collections
do not stall it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from prefixmesh.loadgen import stalls
from prefixmesh.loadgen.bench_scheduler import WORKLOADS, emit, make_stream
from prefixmesh.loadgen.procstat import CpuMeter
from prefixmesh.services.scheduler.policies import POLICY_NAMES
from prefixmesh.shared.bus import BatchLimits, Bus, BusUnavailable
from prefixmesh.shared.runtime.servers import (
    STOP_TIMEOUT_S,
    ManagedProcess,
    child_env,
    start_nats,
    start_redis,
)
from prefixmesh.shared.subjects import Subjects
from prefixmesh.shared.wire import (
    ROUTE_REPLY,
    ErrorInfo,
    LoadReportEvent,
    RequestDoneBatch,
    RequestDoneEvent,
    RouteReply,
    SamplingParams,
    TokenizedRequest,
    route_message,
    route_replies,
    routing_copy,
)

PREFIX = "benchlive"
# What --stalls times in the scheduler (those the code run lacks are skipped): its periodic
# steps and what they spend most in.
STALL_TIMED = (
    "prefixmesh.services.scheduler.policies.e2:E2Policy.tick",
    "prefixmesh.services.scheduler.prefix_tree:PrefixTree._evict_lru_leaves",
    "prefixmesh.services.scheduler.stats:build_stats",
    "prefixmesh.services.scheduler.stats:HotPrefixWalk.step",
    "prefixmesh.services.scheduler.store:StateStore.flush",
)
REPORT_INTERVAL_S = 0.25
# How long a scheduler run under --profile may take to stop (it writes the profile last).
PROFILE_STOP_TIMEOUT_S = 120.0
BLOCKS_PER_WORKER = 12_407  # mistral-7b-a6000: 198,516 tokens / 16


class Completions:
    """The routed requests' completion records, each due ``step_s`` a token after its
    answer, sent every ``step_s`` as one ``RequestDoneBatch`` per worker."""

    def __init__(self, bus: Bus, step_s: float) -> None:
        self.bus = bus
        self.step_s = step_s
        self._due: list[tuple[float, str, str, int]] = []  # (due, request, worker, tokens)
        self.sent = 0

    def routed(self, request_id: str, worker_id: str, output_tokens: int) -> None:
        heapq.heappush(self._due, (time.monotonic() + output_tokens * self.step_s,
                                   request_id, worker_id, output_tokens))

    async def run(self) -> None:
        due = self._due
        while True:
            await asyncio.sleep(self.step_s)
            now = time.monotonic()
            ready: dict[str, list[RequestDoneEvent]] = {}
            while due and due[0][0] <= now:
                _, rid, worker, tokens = heapq.heappop(due)
                ready.setdefault(worker, []).append(RequestDoneEvent(
                    request_id=rid, worker_id=worker, completion_tokens=tokens))
            for events in ready.values():
                await self.bus.publish(self.bus.subjects.done, RequestDoneBatch(events=events))
                self.sent += len(events)


async def _report_loop(bus: Bus, workers: list[str]) -> None:
    while True:
        for w in workers:
            await bus.publish(bus.subjects.load(w), LoadReportEvent(
                worker_id=w, ts=time.time(), total_blocks=BLOCKS_PER_WORKER,
                free_blocks=BLOCKS_PER_WORKER))
        await asyncio.sleep(REPORT_INTERVAL_S)


async def _all_route(logs: list[Path], timeout_s: float = 60.0) -> None:
    """Wait until every spawned replica has joined the routing queue group (its log says)."""
    deadline = time.monotonic() + timeout_s
    while not all(log.exists() and "routes (policy" in log.read_text() for log in logs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"schedulers not routing after {timeout_s}s (logs {logs})")
        await asyncio.sleep(0.2)


async def _run(nats_url: str, args: argparse.Namespace, pids: dict[str, list[int]],
               logs: list[Path]) -> dict:
    bus = await Bus.connect(nats_url, Subjects(args.prefix), "bench-live")
    workers = [f"w{i}" for i in range(args.workers)]
    reporter = asyncio.create_task(_report_loop(bus, workers))
    completions = Completions(bus, args.step_ms / 1000) if args.step_ms > 0 else None
    finisher = asyncio.create_task(completions.run()) if completions is not None else None
    # With --stalls, this client's loop is watched too (``client_loop_lag``): a late wake-up
    # with little CPU run meanwhile is time the client waited for a core.
    lag_out = args.stalls.open("a") if args.stalls is not None else None
    watcher = None
    if lag_out is not None:
        watcher = asyncio.create_task(stalls.monitor(stalls.Recorder(lag_out, stalls.MIN_MS),
                                                     "client_loop_lag"))
    await _all_route(logs)
    try:
        stream = make_stream(args.workload, None, args.seed)
        bench = [next(stream) for _ in range(args.warmup + args.requests)]
        output = {b.route.request_id: b.output_tokens for b in bench}
        # What the edge sends the scheduler: hashes (packed) and length, no token ids.
        msgs = [routing_copy(TokenizedRequest(
            request_id=r.request_id, token_ids=[],
            sampling=SamplingParams(max_tokens=r.max_tokens),
            block_hashes=list(r.block_hashes), prompt_tokens=r.prompt_tokens))
            for r in (b.route for b in bench)]
        del bench
        # Wait until the scheduler routes (it has seen the workers' reports).
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = await bus.request(bus.subjects.route, msgs[0], ROUTE_REPLY, 5)
            except BusUnavailable:  # not in the routing queue group yet (catching up)
                reply = RouteReply(request_id="", error=ErrorInfo("no scheduler routes yet"))
            if reply.worker_id:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"scheduler never routed: {reply.error}")
            await asyncio.sleep(0.1)
        gc.freeze()  # the prepared messages live all run long: keep them out of collections
        limits = BatchLimits(max_batch=args.route_batch, max_inflight=args.route_inflight)
        async with bus.batcher(bus.subjects.route, route_message, route_replies, 10,
                               limits) as router:
            latencies: list[float] = []

            async def route(msg: TokenizedRequest) -> RouteReply:
                if args.route_batch == 1:  # one message per request, as an unbatched edge
                    return await bus.request(bus.subjects.route, msg, ROUTE_REPLY, 10)
                return await router.request(msg)

            # One closed loop from the first warmup request to the last timed one: the
            # pipeline is not drained between them (drained, it would refill with every
            # loop's request at once, a burst the steady state never sees), and the timed
            # part starts when its first request is taken.
            meter: CpuMeter | None = None
            sent, t0, wall0 = 0, 0.0, 0.0

            async def loop(pending: Iterator[tuple[int, TokenizedRequest]]) -> None:
                nonlocal meter, sent, t0, wall0
                for i, msg in pending:  # shared by every loop: each message is sent once
                    timed = i >= args.warmup
                    if timed and meter is None:
                        meter, sent = CpuMeter(pids), router.batches
                        t0, wall0 = time.perf_counter(), time.time()
                    start = time.perf_counter()
                    r = await route(msg)
                    if not r.worker_id:
                        raise RuntimeError(f"routing failed: {r.error}")
                    if completions is not None:
                        completions.routed(msg.request_id, r.worker_id, output[msg.request_id])
                    if timed:
                        latencies.append(time.perf_counter() - start)

            pending = enumerate(msgs)
            await asyncio.gather(*(loop(pending) for _ in range(args.in_flight)))
            if meter is None:
                raise RuntimeError("no timed request was sent")
            elapsed = time.perf_counter() - t0
            window = (wall0, time.time())
            cpu = meter.read()
            messages = router.batches - sent if args.route_batch > 1 else len(latencies)
    finally:
        for task in (reporter, finisher, watcher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if lag_out is not None:
            lag_out.close()
        await bus.close()
    latencies.sort()
    sched_cpu = sum(v for k, v in cpu.items() if k.startswith("scheduler"))
    stall_sums = stalls.summarize(args.stalls, *window) if args.stalls is not None else None
    return {
        "workload": args.workload, "workers": args.workers, "policy": args.policy,
        "mode": "live", "in_flight": args.in_flight, "route_batch": args.route_batch,
        "route_inflight": args.route_inflight, "step_ms": args.step_ms,
        "completion_records": completions.sent if completions is not None else 0,
        "timed_requests": len(latencies),
        "requests_per_message": round(len(latencies) / max(messages, 1), 2),
        "decisions_per_s": round(len(latencies) / elapsed, 1),
        # CPU per decision of each process: what other load on the machine does not
        # inflate the way it inflates latency (empty with an external scheduler).
        "cpu_us_per_decision": {k: round(v / len(latencies) * 1e6, 1) for k, v in cpu.items()},
        "schedulers": args.schedulers,
        # Every replica's CPU together, per decision of the whole fleet.
        "scheduler_cpu_us_per_decision": round(sched_cpu / len(latencies) * 1e6, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        **({"stalls": stall_sums} if stall_sums is not None else {}),
        "p50_us": round(latencies[len(latencies) // 2] * 1e6, 1),
        "p99_us": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e6, 1),
    }


def _pin(procs: list[ManagedProcess], cores: list[int], schedulers: int) -> None:
    """Scheduler ``i`` on ``cores[-1 - i]`` alone; this process and the other spawned ones
    (nats-server, redis-server) on the cores left."""
    rest = set(cores[:-schedulers])
    for p in procs:
        if p.name.startswith("scheduler-"):
            os.sched_setaffinity(p.pid, {cores[-1 - int(p.name.split("-")[1])]})
        else:
            os.sched_setaffinity(p.pid, rest)
    os.sched_setaffinity(0, rest)


# Options naming a file or folder (none by default) and what each does (docs/benchmarks.md).
PATH_OPTIONS = {
    "--stalls": "run it under loadgen/stalls.py: GCs, loop lag, slow steps to this file "
                "(and this client's own loop lag, as client_loop_lag)",
    "--profile": "run each spawned scheduler under cProfile: DIR/scheduler-I.prof at its stop",
    "--baseline": "run the spawned scheduler from the prefixmesh package in this folder",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="prefixmesh bench-scheduler --live",
        description="Time routing decisions through a scheduler process over NATS.")
    ap.add_argument("--workload", choices=WORKLOADS, default="toolbench")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20_000, help="timed decisions")
    ap.add_argument("--warmup", type=int, default=5_000, help="untimed decisions first")
    ap.add_argument("--policy", choices=POLICY_NAMES, default="e2")
    ap.add_argument("--in-flight", type=int, default=100, help="outstanding requests")
    ap.add_argument("--route-batch", type=int, default=BatchLimits().max_batch,
                    help="requests per routing message at most, as the edge's --route-batch "
                    "(1 = one message per request)")
    ap.add_argument("--route-inflight", type=int, default=BatchLimits().max_inflight,
                    help="routing messages awaiting their answer at once, as the edge's "
                    "--route-inflight")
    ap.add_argument("--schedulers", type=int, default=1,
                    help="scheduler replicas to spawn (active-active)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="send each routed request's completion record to the scheduler "
                    "this many ms a token after its answer, as a worker's step would (25: "
                    "a mistral-7b-a6000 decode step; default 0: none, every request stays "
                    "in the scheduler's window)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nats-url", default="", help="use this NATS server (default: start one)")
    ap.add_argument("--redis-url", default="",
                    help="Redis for the spawned scheduler (default: start one)")
    ap.add_argument("--prefix", default=PREFIX, help="subject / Redis key prefix")
    ap.add_argument("--external-scheduler", action="store_true",
                    help="a scheduler already serves --prefix on --nats-url: do not spawn one")
    ap.add_argument("--pin", action="store_true",
                    help="give each spawned scheduler a core of its own (the last ones) and "
                    "this client and the servers it starts the other cores, as a deployment "
                    "that runs the scheduler on its own core would (Linux)")
    for flag, text in PATH_OPTIONS.items():
        ap.add_argument(flag, type=Path, default=None, help=text)
    ap.add_argument("--json", default=None, help="write the result here too")
    args = ap.parse_args(argv)
    if args.step_ms < 0:
        ap.error("--step-ms must be at least 0 (0: no completion records)")
    if (args.requests < 1 or args.warmup < 0 or args.in_flight < 1 or args.workers < 1
            or args.schedulers < 1):
        ap.error("--requests, --in-flight, --workers and --schedulers must be at least 1, "
                 "--warmup at least 0")
    if args.external_scheduler and not args.nats_url:
        ap.error("--external-scheduler needs --nats-url")
    if args.external_scheduler and (args.stalls or args.baseline or args.profile):
        ap.error("--stalls, --profile and --baseline concern the schedulers this command "
                 "spawns")
    if args.stalls and args.profile:
        ap.error("--stalls and --profile each wrap the scheduler: pick one")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pin and (args.external_scheduler or len(cores) <= args.schedulers):
        ap.error(f"--pin needs spawned schedulers and more cores than them ({len(cores)} "
                 f"usable here, {args.schedulers} scheduler(s))")
    tmp = Path(tempfile.mkdtemp(prefix="bench-live-"))
    procs: list[ManagedProcess] = []
    # Logs of spawned replicas to wait on (an older --baseline package logs no such line).
    routing_logs: list[Path] = []
    try:
        nats_url = args.nats_url
        if not nats_url:
            proc, nats_url = start_nats(log_path=tmp / "nats.log")
            procs.append(proc)
        if not args.external_scheduler:
            redis_url = args.redis_url
            if not redis_url:
                proc, redis_url = start_redis(data_dir=tmp, log_path=tmp / "redis.log")
                procs.append(proc)
            argv_sched = [sys.executable, "-m", "prefixmesh.services.scheduler"]
            if args.stalls is not None:
                args.stalls.parent.mkdir(parents=True, exist_ok=True)
                args.stalls.write_text("")  # this run's events only
                timed = [a for t in STALL_TIMED for a in ("--time", t)]
                argv_sched = [sys.executable, stalls.__file__, "--out", str(args.stalls), *timed,
                              "--", "prefixmesh.services.scheduler"]
            extra = {"PYTHONPATH": str(args.baseline.resolve())} if args.baseline else {}
            logs = [tmp / f"scheduler-{i}.log" for i in range(args.schedulers)]
            if args.profile is not None:
                args.profile.mkdir(parents=True, exist_ok=True)
            for i, log in enumerate(logs):
                argv_i = argv_sched
                if args.profile is not None:
                    argv_i = [sys.executable, "-m", "cProfile", "-o",
                              str(args.profile / f"scheduler-{i}.prof"), *argv_sched[1:]]
                procs.append(ManagedProcess(
                    f"scheduler-{i}", argv_i,
                    env=child_env(PM_NATS_URL=nats_url, PM_REDIS_URL=redis_url,
                                  PM_SUBJECT_PREFIX=args.prefix, PM_REDIS_PREFIX=args.prefix,
                                  PM_POLICY=args.policy, PM_LOG_LEVEL="INFO",
                                  # The fake workers' reports share this client's busy event
                                  # loop: be lenient about their timing.
                                  PM_MISSED_REPORTS="40", PM_CATCHUP_TIMEOUT_S="5", **extra),
                    log_path=log).start())
            # (A --baseline of several replicas is code that logs it too.)
            routing_logs = [] if args.baseline and args.schedulers == 1 else logs
        import uvloop  # the client's own loop must not be the bottleneck

        pids = {p.name: [p.pid] for p in procs}
        if args.pin:
            _pin(procs, cores, args.schedulers)
        result = uvloop.run(_run(nats_url, args, pids, routing_logs))
    finally:
        for proc in reversed(procs):  # scheduler first, then the servers
            # A profiled scheduler drains slowly and writes its profile only once stopped.
            proc.stop(PROFILE_STOP_TIMEOUT_S if args.profile else STOP_TIMEOUT_S)
    if args.profile is not None:
        for i in range(args.schedulers):
            prof = args.profile / f"scheduler-{i}.prof"
            if not prof.exists():
                print(f"no profile written to {prof} (see {tmp / f'scheduler-{i}.log'})",
                      file=sys.stderr)
    result["pinned"] = args.pin
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
