"""Chaos: faults injected mid-load into the whole mesh as processes (docs/design.md section 12).

4 sim workers, 3 active-active schedulers, 2 edges, a 3-node NATS cluster (JetStream
replicated) and this test's own redis-server. A steady asyncio client spreads a mix of
streamed and non-streamed requests over both edges while, one after another, a worker is
SIGKILLed, a routing scheduler is SIGKILLed, one NATS node is SIGKILLed and later restarted
on its ports, redis-server is restarted, and one edge is SIGKILLed (the client stops sending
to it, as a load balancer would). Every request must end completed or with an explicit
retriable error (429/503/504, or an error event in its stream); only the killed edge's
in-flight requests may lose their connection. None may go unanswered (the client gives up
well past the edge's deadline: a hang, not a speed limit), and the client's count per status
on the surviving edge must equal that edge's own ``prefixmesh_edge_requests_total``.
After the faults, a final burst must succeed in full: every service recovered on its own.

``CHAOS_LOAD_S`` (default 40) sets the length of the loaded phase; ``CHAOS_JSON`` names a
file for the figures (docs/reliability.md reports them; ``make chaos`` writes one).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from prefixmesh.services.up import LocalMesh
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve
from prefixmesh.shared.runtime.servers import (
    ManagedProcess,
    NatsCluster,
    free_port,
    start_redis,
)
from tests.helpers import mesh_options

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

LOAD_S = float(os.environ.get("CHAOS_LOAD_S", "40"))
RATE_PER_S = 6.0  # request arrivals per second (steady, jittered)
# Edge request deadline (seconds); the client waits this much longer (plus 5 s) for an
# answer before it counts the request as hanging.
DEADLINE_S = 15.0
DEADLINE_SLACK_S = 3.0
# Fault times, as fractions of the loaded phase.
FAULTS = (("kill worker", 0.1), ("kill scheduler", 0.22), ("kill nats node", 0.34),
          ("restart nats node", 0.5), ("restart redis-server", 0.62), ("kill edge", 0.75))
# The NATS node and the edge the faults kill (edge 0 survives: its counters are compared).
NATS_VICTIM = 1
EDGE_VICTIM = 1
# What the client records for a request whose edge was killed under it.
EDGE_LOST = "edge_lost"
RETRIABLE_STATUSES = {429, 503, 504}
RETRIABLE_CODES = {"worker_lost", "service_unavailable", "worker_error", "timeout"}
FINAL_BURST = 12


@dataclass
class Outcome:
    """What the client saw of one request."""

    stream: bool
    edge: int = 0  # which edge it was sent to
    status: int = 0  # 0: no HTTP answer at all
    took_s: float = 0.0
    completed: bool = False
    error_code: str = ""  # of an error body or an error event
    problem: str = ""  # anything that breaks the contract


@dataclass
class Servers:
    """The NATS cluster and the redis-server of this test, restartable on their ports;
    the edges the client may still send to."""

    root: Path
    nats: NatsCluster
    edges: list[str] = field(default_factory=list)
    live_edges: list[int] = field(default_factory=list)
    redis_port: int = field(default_factory=free_port)
    redis: ManagedProcess | None = None

    def start_redis(self) -> str:
        self.redis, url = start_redis(self.redis_port, self.root,
                                      self.root / "redis-server.log")
        return url

    def stop(self) -> None:
        if self.redis is not None:
            self.redis.stop()


def _body(rng: random.Random, stream: bool) -> dict:
    """A completion with a prompt from one of a few shared prefixes (token ids)."""
    family = rng.randrange(8)
    prompt = [200 + family * 97 + i for i in range(64)] + [rng.randrange(100, 40000)
                                                         for _ in range(rng.randrange(8, 32))]
    return {"model": MODEL, "prompt": prompt, "max_tokens": rng.choice((16, 32, 64)),
            "ignore_eos": True, "stream": stream}


async def _one(session: aiohttp.ClientSession, servers: Servers, edge: int,
               body: dict) -> Outcome:
    out = Outcome(stream=body["stream"], edge=edge)
    started = time.monotonic()
    try:
        async with session.post(servers.edges[edge] + "/v1/completions", json=body) as r:
            out.status = r.status
            if not body["stream"] or r.status != 200:
                data = await r.json()
                if r.status == 200:
                    tokens = data["usage"]["completion_tokens"]
                    out.completed = tokens == body["max_tokens"]
                    if not out.completed:
                        out.problem = f"short answer: {tokens} tokens"
                else:
                    out.error_code = data["error"]["code"] or ""
                    if r.status not in RETRIABLE_STATUSES:
                        out.problem = f"status {r.status}: {data['error']['message']}"
            else:
                await _read_stream(r, body, out)
    except (aiohttp.ClientError, TimeoutError) as exc:
        if edge in servers.live_edges or isinstance(exc, TimeoutError):
            out.problem = f"no answer: {type(exc).__name__} {exc}"
        else:  # its edge was killed under it: the client retries elsewhere
            out.completed, out.error_code = False, EDGE_LOST
    out.took_s = time.monotonic() - started  # reported (max_took_s), not a pass mark
    return out


async def _read_stream(r: aiohttp.ClientResponse, body: dict, out: Outcome) -> None:
    """An SSE stream must end with [DONE] after a finish_reason or an error event."""
    tokens, finished, done = 0, False, False
    async for line in r.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            continue  # read on to the end, so the edge has finished the request too
        event = json.loads(data)
        if "error" in event:
            out.error_code = event["error"]["code"] or ""
            if out.error_code not in RETRIABLE_CODES:
                out.problem = f"error event {event['error']}"
            continue
        for choice in event["choices"]:
            tokens += 1 if choice["text"] else 0
            finished = finished or choice["finish_reason"] is not None
    out.completed = finished and not out.error_code
    if not done:
        out.problem = "stream ended without [DONE]"
    elif not finished and not out.error_code:
        out.problem = "stream ended with neither a finish_reason nor an error event"


def _edge_counts(url: str) -> Counter:
    """The edge's own count of /v1/completions answers, by status."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    counts: Counter = Counter()
    pattern = r'prefixmesh_edge_requests_total\{route="/v1/completions",status="(\d+)"\} (\S+)'
    for status, value in re.findall(pattern, text):
        counts[int(status)] += int(float(value))
    return counts


async def _inject(name: str, mesh: LocalMesh, servers: Servers, log: list[dict],
                  t0: float) -> None:
    """One fault; what was done is appended to ``log``."""
    loop = asyncio.get_running_loop()
    entry = {"fault": name, "at_s": round(time.monotonic() - t0, 1)}
    if name == "kill worker":
        victim = next(p for p in mesh.services if p.name == "worker-1")
        victim.signal(signal.SIGKILL)
        entry["pid"] = victim.pid
    elif name == "kill scheduler":
        routing = await loop.run_in_executor(None, mesh.routing_schedulers)
        assert len(routing) == 3, "not every scheduler replica routes"
        victim = routing[-1]
        victim.signal(signal.SIGKILL)
        entry.update(pid=victim.pid, name=victim.name)
    elif name == "kill nats node":
        servers.nats.nodes[NATS_VICTIM].signal(signal.SIGKILL)
        entry["node"] = servers.nats.nodes[NATS_VICTIM].name
    elif name == "kill edge":
        servers.live_edges.remove(EDGE_VICTIM)  # no new requests: its in-flight ones fail
        victim = next(p for p in mesh.services if p.name == f"edge-{EDGE_VICTIM}")
        victim.signal(signal.SIGKILL)
        entry.update(pid=victim.pid, name=victim.name)
    # Restarts block the client's loop for a moment, on purpose: a server started from an
    # executor thread would get SIGTERM when that thread exits (PR_SET_PDEATHSIG follows
    # the parent thread, shared/runtime/servers.py).
    elif name == "restart nats node":
        servers.nats.nodes[NATS_VICTIM].stop()
        servers.nats.restart(NATS_VICTIM)
    elif name == "restart redis-server":
        servers.redis.stop()
        servers.start_redis()
    entry["done_at_s"] = round(time.monotonic() - t0, 1)
    log.append(entry)


async def _load(mesh: LocalMesh, servers: Servers) -> tuple[list[Outcome], list[dict]]:
    rng = random.Random(7)
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S + DEADLINE_SLACK_S + 5)
    faults: list[dict] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.monotonic()
        pending: list[asyncio.Task] = []
        schedule = list(FAULTS)
        fault_tasks: list[asyncio.Task] = []
        while (now := time.monotonic() - t0) < LOAD_S:
            if schedule and now >= schedule[0][1] * LOAD_S:
                name, _ = schedule.pop(0)
                fault_tasks.append(asyncio.create_task(_inject(name, mesh, servers, faults, t0)))
            body = _body(rng, stream=rng.random() < 0.4)
            edge = servers.live_edges[len(pending) % len(servers.live_edges)]
            pending.append(asyncio.create_task(_one(session, servers, edge, body)))
            await asyncio.sleep(rng.expovariate(RATE_PER_S))
        await asyncio.gather(*fault_tasks)
        outcomes = list(await asyncio.gather(*pending))
        # Recovery: with every fault over, a burst must succeed in full.
        await asyncio.sleep(3)
        final = await asyncio.gather(*(_one(session, servers, 0, _body(rng, stream=i % 2 == 0))
                                       for i in range(FINAL_BURST)))
    return outcomes + list(final), faults


def test_chaos(tmp_path: Path, nats_cluster: NatsCluster) -> None:
    servers = Servers(tmp_path, nats_cluster)
    redis_url = servers.start_redis()
    opts = mesh_options(nats_cluster.url, redis_url, tmp_path / "logs", workers=4,
                        schedulers=3, edges=2, subject_prefix="chaos",
                        extra_env={"PM_REQUEST_TIMEOUT_S": str(DEADLINE_S),
                                   "PM_BATCH_REPLICAS": "3"})
    try:
        with LocalMesh(opts) as mesh:
            servers.edges = mesh.edge_urls
            servers.live_edges = list(range(len(mesh.edge_urls)))
            assert len(mesh.routing_schedulers()) == 3  # ready means every replica routes
            started = time.monotonic()
            outcomes, faults = asyncio.run(_load(mesh, servers))
            wall = time.monotonic() - started
            # The surviving edge's answers, as it counted them and as the client saw them.
            client = Counter(o.status for o in outcomes if o.edge == 0)
            edge = _edge_counts(mesh.edge_urls[0])
            for _ in range(50):  # the edge counts an answer just after its last byte
                if edge == client:
                    break
                time.sleep(0.1)
                edge = _edge_counts(mesh.edge_urls[0])
            alive = {p.name: p.alive() for p in mesh.services}
            nats_alive = [n.alive() for n in nats_cluster.nodes]
    finally:
        servers.stop()
    final = outcomes[-FINAL_BURST:]
    lost = [o for o in outcomes if o.error_code == EDGE_LOST]
    summary = {
        "load_s": LOAD_S, "rate_per_s": RATE_PER_S, "deadline_s": DEADLINE_S,
        "wall_s": round(wall, 1), "faults": faults, "requests": len(outcomes),
        "streamed": sum(o.stream for o in outcomes),
        "completed": sum(o.completed for o in outcomes),
        "retriable_errors": Counter(f"{o.status}:{o.error_code}" for o in outcomes
                                    if not o.completed and not o.problem),
        "problems": [o.problem for o in outcomes if o.problem],
        "client_by_status_edge0": dict(sorted(client.items())),
        "edge0_by_status": dict(sorted(edge.items())),
        "lost_with_killed_edge": len(lost),
        "max_took_s": round(max(o.took_s for o in outcomes), 2),
        "final_burst_completed": sum(o.completed for o in final),
        "services_alive": alive,
        "nats_nodes_alive": nats_alive,
    }
    print(json.dumps(summary, indent=2))
    if path := os.environ.get("CHAOS_JSON"):
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    assert len(faults) == len(FAULTS)
    assert summary["problems"] == []
    # Only requests on the killed edge lost their connection.
    assert all(o.edge == EDGE_VICTIM for o in lost)
    assert client == edge, "client and edge disagree on what happened"
    assert summary["final_burst_completed"] == FINAL_BURST
    dead = {n for n, ok in alive.items() if not ok}
    assert dead == {"worker-1", faults[1]["name"], f"edge-{EDGE_VICTIM}"}
    assert all(nats_alive)  # the killed node is back
