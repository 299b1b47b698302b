"""The scheduler's write-behind to Redis, timed: the CPU its flushes cost a decision.

``python -m prefixmesh.loadgen.bench_persist --workload toolbench --workers 16
--decisions 60000 --every 20000 --json OUT`` starts its own redis-server (or writes to
``--redis-url`` under ``--prefix``), warms the policy with ``bench-scheduler``'s stream
and simulated cluster, then routes ``--decisions`` more with change tracking on and
flushes to Redis (``StateStore.flush``, what the live scheduler's persist loop runs every
``persist_interval_s``) after every ``--every`` decisions; ``--every`` is the decisions of
one persist period (20,000: 2 s at 10,000 a second). Each request's hashes reach the
policy as the live scheduler reads them off the wire, packed (an int64 array over the
edge's bytes); ``--hashes listed`` routes them as lists of ints instead, as in-process
callers (the simulator) do. Reported: the flushes' CPU (this
thread's clock: encoding, packing and the socket calls; not redis-server's) per
decision, the nodes, log segments and bytes they wrote per decision, and the CPU of one
full rewrite of the state at the end (what a new leader writes first).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import redis.asyncio as aioredis

from prefixmesh.loadgen.bench_scheduler import (
    DEFAULT_PROFILE,
    WORKLOADS,
    emit,
    make_stream,
    setup_policy,
)
from prefixmesh.services.scheduler.policies.e2 import E2Policy
from prefixmesh.services.scheduler.store import StateStore
from prefixmesh.shared.blocks import pack_hashes, unpack_hashes
from prefixmesh.shared.runtime.servers import start_redis


async def run(url: str, base: str, workload: str = "toolbench", workers: int = 16,
              warmup: int = 20_000, decisions: int = 60_000, every: int = 20_000,
              seed: int = 0, packed: bool = True) -> dict:
    """Warm, then route ``decisions`` flushing to ``url`` under ``base`` every ``every``;
    the figures of the module's docstring, and the tree's node count at the end."""
    pol, cluster, _ = setup_policy("e2", workers, None, DEFAULT_PROFILE)
    if not isinstance(pol, E2Policy):
        raise TypeError(f"expected the E2 policy, got {type(pol).__name__}")
    stream = make_stream(workload, None, seed)

    def route(n: int) -> None:
        for _ in range(n):
            br = next(stream)
            cluster.advance(br.t)
            inp = br.route
            if packed:  # untimed: the edge packs, the scheduler reads the bytes in place
                inp = msgspec.structs.replace(
                    inp, block_hashes=unpack_hashes(pack_hashes(inp.block_hashes)))
            d = pol.route(inp, br.t)
            cluster.routed(br, d.worker_id, d.matched_tokens)

    client = aioredis.from_url(url)
    try:
        store = StateStore(client, base)
        route(warmup)
        await store.flush(pol)  # the first flush is a full one; tracking starts with it
        cpu_ns = nodes = segments = written = 0
        done = 0
        while done < decisions:
            n = min(every, decisions - done)
            route(n)
            done += n
            t0 = time.thread_time_ns()
            stats = await store.flush(pol)
            cpu_ns += time.thread_time_ns() - t0
            nodes += stats.nodes
            segments += stats.segments
            written += stats.bytes
        store.need_full()
        t0 = time.thread_time_ns()
        full = await store.flush(pol)
        full_ns = time.thread_time_ns() - t0
    finally:
        await client.aclose()
    return {
        "workload": workload, "workers": workers, "decisions": decisions, "every": every,
        "hashes": "packed" if packed else "listed",
        "persist_us_per_decision": round(cpu_ns / 1e3 / decisions, 3),
        "nodes_per_decision": round(nodes / decisions, 3),
        "segments": segments,
        "bytes_per_decision": round(written / decisions, 1),
        "full_rewrite_ms": round(full_ns / 1e6, 1),
        "full_rewrite_nodes": full.nodes,
        "tree_nodes": pol.tree.n_nodes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m prefixmesh.loadgen.bench_persist",
        description="CPU the scheduler's write-behind to Redis costs a decision (against a "
        "redis-server this command starts), and one full rewrite's.")
    ap.add_argument("--workload", choices=WORKLOADS, default="toolbench")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=20_000, help="decisions before tracking")
    ap.add_argument("--decisions", type=int, default=60_000, help="timed decisions")
    ap.add_argument("--every", type=int, default=20_000,
                    help="decisions between flushes (one persist period)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hashes", choices=("packed", "listed"), default="packed",
                    help="how requests' hashes reach the policy: packed as off the wire "
                    "(the live scheduler), or listed as in process (the simulator)")
    ap.add_argument("--redis-url", default="",
                    help="a Redis to write to (default: start a redis-server for the run)")
    ap.add_argument("--prefix", default="bench", help="Redis key prefix")
    ap.add_argument("--json", default=None, help="write the result here too")
    args = ap.parse_args(argv)
    if args.decisions <= 0 or args.every <= 0 or args.warmup < 0:
        ap.error("--decisions and --every must be > 0, --warmup >= 0")

    def bench(url: str) -> dict:
        return asyncio.run(run(url, f"{args.prefix}:e2", args.workload, args.workers,
                               args.warmup, args.decisions, args.every, args.seed,
                               args.hashes == "packed"))

    if args.redis_url:
        result = bench(args.redis_url)
    else:
        with tempfile.TemporaryDirectory(prefix="pm-bench-persist-") as tmp:
            proc, url = start_redis(data_dir=Path(tmp))
            try:
                result = bench(url)
            finally:
                proc.stop()
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
