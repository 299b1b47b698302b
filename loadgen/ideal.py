"""``ideal``: the simulator's reference placement, a limit no router reaches.

Two things no real router has:

- **Every GPU holds every prefix already computed anywhere.** When a request arrives, the
  longest prefix of its prompt whose blocks any GPU has computed so far (ever, whether or
  not it is still cached there) is put into the chosen GPU's prefix cache for free, as if
  KV moved between GPUs instantly and without cost. A router can only hit blocks computed
  before, on the one GPU it picks; here every request hits all of them.
- **No cache limit.** Each GPU's KV pool is ``IDEAL_KV_FACTOR`` times its profile's
  (whatever ``--num-blocks`` or ``--cache-pressure`` set), so a free copy never evicts
  what another request still needs: with the profile's pool, copies thrash the cache
  wherever the working set exceeds it, and "ideal" ran 2-3x slower than the policies.
- **Work balanced perfectly.** The request goes to the GPU with the least outstanding
  work in seconds of that GPU (the estimated prefill of what it misses plus decode of its
  output, on the GPU's own profile, with no report lag), released exactly when a request
  finishes. What it misses there counts the blocks of requests already routed there as
  present (the engine shares a prefix an earlier request is computing), so siblings of a
  burst that no GPU has computed yet join the GPU computing it.

It is a reference, not a proof: a policy could in principle come in under it (e.g. by
queueing order effects at a single rate), and the suite reports it if one does. Every run
of a policy states its distance from ``ideal`` on the same requests and arrivals
(``vs_ideal_avg``, ``vs_ideal_p99``: the policy's figure / ideal's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from prefixmesh.services.scheduler.policies.base import Decision, NoWorkerError, RouteInput
from prefixmesh.services.scheduler.policies.costs import CostTables
from prefixmesh.services.worker.engine.sim import SimEngine
from prefixmesh.services.worker.engine.types import SimEngineConfig
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.wire import BlockStored, KvEvent, LoadReportEvent, RequestDoneEvent

IDEAL = "ideal"
# KV pool of an ideal GPU, in multiples of its profile's.
IDEAL_KV_FACTOR = 8
# Running batch assumed when pricing decode work (as E2's default dt_batch_size).
_DT_BATCH = 32


def ideal_engine(cost: CostModel, base: SimEngineConfig | None) -> SimEngineConfig:
    """An ideal GPU's engine limits: ``base``'s, with ``IDEAL_KV_FACTOR`` x the profile's KV."""
    blocks = IDEAL_KV_FACTOR * (cost.kv_capacity_tokens // cost.block_size)
    return replace(base or SimEngineConfig(), num_blocks=blocks)


class IdealPolicy:
    """The ``ideal`` placement (see the module docstring), over the simulator's engines."""

    name = IDEAL

    def __init__(self, engines: Mapping[str, SimEngine]) -> None:
        self.engines = engines
        # Every block hash any GPU has stored so far.
        self.computed: set[int] = set()
        self.tables = {w: CostTables(e.cost_model, _DT_BATCH) for w, e in engines.items()}
        self.work = dict.fromkeys(engines, 0.0)
        # Every block hash routed to each GPU (computed there once its request ran).
        self.routed: dict[str, set[int]] = {w: set() for w in engines}
        self.charged: dict[str, tuple[str, float]] = {}

    def add_worker(self, worker_id: str, capacity_tokens: int, now: float) -> None:
        self.work.setdefault(worker_id, 0.0)

    def route(self, req: RouteInput, now: float) -> Decision:
        hashes = req.block_hashes
        computed = self.computed
        hit = 0
        while hit < len(hashes) and hashes[hit] in computed:
            hit += 1
        best, best_cost, best_hit = "", 0.0, 0
        for w, work in self.work.items():
            if w in req.exclude:
                continue
            # Blocks an earlier request routed here will have computed by the time this
            # one runs (the engine shares them), beyond what is free everywhere.
            routed = self.routed[w]
            got = hit
            while got < len(hashes) and hashes[got] in routed:
                got += 1
            t = self.tables[w]
            cost = (work + t.pt(req.prompt_tokens - got * self._block)
                    + t.dt(req.prompt_tokens) * req.max_tokens)
            if not best or cost < best_cost:
                best, best_cost, best_hit = w, cost, got
        if not best:
            raise NoWorkerError("no eligible worker")
        charge = best_cost - self.work[best]
        self.work[best] += charge
        self.charged[req.request_id] = (best, charge)
        self.routed[best].update(hashes)
        return Decision(best, IDEAL, best_hit * self._block)

    @property
    def _block(self) -> int:
        return next(iter(self.tables.values())).block

    def seed(self, worker_id: str, prompt: Sequence[int], hashes: list[int]) -> None:
        """Put the prompt's longest already-computed prefix into ``worker_id``'s cache."""
        engine = self.engines[worker_id]
        cache = engine.cache
        bs = cache.block_size
        # As the engine admits: never the block holding the prompt's last token.
        limit = min(len(hashes), (len(prompt) - 1) // bs)
        want = 0
        while want < limit and hashes[want] in self.computed:
            want += 1
        hits = cache.match_prefix(hashes, want)
        have = len(hits)
        if have >= want:
            return
        new = cache.acquire(hits, want - have)
        if new is None:  # no room even after evicting everything idle: no free copy
            return  # (acquire took no reference then)
        table = hits + new
        parent = hashes[have - 1] if have else None
        cache.store(table, have, hashes[have:want], parent, list(prompt[have * bs: want * bs]))
        cache.free(table)

    def on_kv_events(self, worker_id: str, events: list[KvEvent], now: float) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self.computed.update(ev.block_hashes)

    def on_load(self, report: LoadReportEvent, now: float) -> None:
        return None

    def on_done(self, done: RequestDoneEvent, now: float) -> None:
        got = self.charged.pop(done.request_id, None)
        if got is not None:
            w, charge = got
            self.work[w] = max(self.work[w] - charge, 0.0)

    def tick(self, now: float) -> None:
        return None


def annotate_ideal(rows: list[dict]) -> None:
    """Add ``vs_ideal_avg`` / ``vs_ideal_p99`` to every row that has an ``ideal`` row of the
    same workload, rate, fleet and seed (the policy's latency / ideal's)."""
    def key(r: dict) -> tuple:
        return (r.get("workload"), r.get("rate"), r.get("gpus"), r.get("gpu_profiles"),
                r.get("seed"), r.get("local_policy"), r.get("cache_pressure"),
                r.get("arrivals"))

    ideal = {key(r): r for r in rows if r.get("policy") == IDEAL}
    for r in rows:
        ref = ideal.get(key(r))
        if ref is None:
            continue
        for stat, field in (("latency_avg_s", "vs_ideal_avg"), ("latency_p99_s", "vs_ideal_p99")):
            if ref.get(stat):
                r[field] = round(r[stat] / ref[stat], 4)
