"""Preble's E2 global policy, with GPU-time load estimates, the eviction term and working
replication (docs/design.md section 5).

For request R: ``cached`` = tokens of the deepest matched tree node that an eligible
worker caches, ``missed`` = prompt - cached.

- Exploit (``missed < cached``): among the workers caching that node, the lowest load cost
  ``L + M + P``. If that worker is heavy (``L > th_bal x`` the lightest worker's ``L``) and
  the lightest worker is cheaper even after prefilling what it misses, R goes there
  instead (``rebalance``); the tree then records the prefix on both and later requests
  split by load. A hot prefix in the replication registry with a replica that does not
  cache it yet sends R to that replica (``replicate``).
- Explore: a decode-dominated worker (decode share > IMBALR in its fresh load report)
  takes the cold request (``pd_balance``) unless it is much costlier than the best;
  otherwise the lowest ``L + M + P`` over all workers.

``L`` is kept by ``e2_load.LoadWindow``, ``M`` and ``P`` are priced by ``e2_cost.LoadCost``.
The decision is recorded in the tree at once, so the next request sees it before any KV
event arrives; KV events then confirm or evict.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from operator import attrgetter

from prefixmesh.services.scheduler.policies import e2_state
from prefixmesh.services.scheduler.policies.base import (
    Decision,
    NoWorkerError,
    PolicyConfig,
    PolicySummary,
    RouteInput,
)
from prefixmesh.services.scheduler.policies.costs import CostTables
from prefixmesh.services.scheduler.policies.e2_cost import LoadCost
from prefixmesh.services.scheduler.policies.e2_load import LoadWindow, RecentMax, WorkerState
from prefixmesh.services.scheduler.policies.e2_replicate import Replicator
from prefixmesh.services.scheduler.prefix_tree import Node, PrefixTree
from prefixmesh.shared.costmodel import CostModel
from prefixmesh.shared.wire import (
    BlockRemoved,
    BlockStored,
    KvEvent,
    LoadReportEvent,
    RequestDoneEvent,
    RoutedRequest,
)

_LOAD = attrgetter("L")
log = logging.getLogger(__name__)


class E2Policy:
    """E2: exploit cached prefixes, explore by prompt-aware GPU-time load cost."""

    name = "e2"

    def __init__(self, config: PolicyConfig, cost: CostModel) -> None:
        self.cfg = config
        self.cost = cost
        self.block = cost.block_size
        self.tree = PrefixTree(config.tree_max_nodes, config.tree_max_tokens, cost.block_size)
        self.tables = CostTables(cost, config.dt_batch_size)
        self.window = LoadWindow(config.window_s, self.tree, self.tables)
        self.replicator = Replicator(config, self.tree)
        self._ws: dict[str, WorkerState] = {}
        self._decode_heavy: set[str] = set()
        self._rot = 0
        self._now = 0.0
        self._rebase = False
        self.state = e2_state.E2Persistence(self._parts, self._restored)
        self.price = LoadCost(self.tree, self.tables)
        self.price.backlog_weight = config.prefill_backlog_weight
        self.price.interference = config.interference_weight
        self.price.by_inflight = config.interference_inflight
        self.price.wait_window = config.window_s if config.load_wait else 0.0
        self.price.after_cached = config.pt_after_cached
        # The cap bounds the queueing-delay load term; Preble's L (load_wait off) is uncapped.
        self.price.wait_cap = config.load_wait_cap_s if config.load_wait else 0.0
        # Config values read on every decision, kept as plain attributes.
        self._window_s = config.window_s
        self._busy_l = config.rebalance_min_util * config.window_s  # L of a busy worker (s)
        self._th_bal = config.th_bal
        self._rebalance = math.isfinite(config.th_bal)  # th_bal = inf turns rebalancing off
        self._backlog_exploit = config.backlog_exploit
        self._explore_wait = config.explore_wait
        self._explore_wait_fleet = config.explore_wait_fleet
        self._pd_ratio = config.pd_max_cost_ratio
        self._default_out = float(config.default_output_tokens)
        self._affinity = config.affinity_prefill_slack
        self._affinity_sat = config.affinity_saturated_ratio
        self._step_weight = config.decode_step_weight
        self._gpu_step = config.gpu_step_weight
        self._aging = config.inflight_aging
        self._model_eviction_queue_s = config.model_eviction_queue_s
        # The longest prefills charged lately (interference_mix_*).
        self._mix_ratio = config.interference_mix_ratio
        self._mix_min_s = config.interference_mix_min_s
        self._long_prefill = RecentMax(config.interference_mix_window_s)
        # Cost tables per profile named in load reports (a fleet mixing GPU types).
        self._profile_tables: dict[str, CostTables] = {cost.name: self.tables}

    # ------------------------------------------------------------------ membership

    @property
    def workers(self) -> Collection[str]:
        """Registered worker ids."""
        return self._ws.keys()

    def worker_state(self, worker_id: str) -> WorkerState:
        """E2's bookkeeping of one worker (read-only use: tests, metrics)."""
        return self._ws[worker_id]

    def add_worker(self, worker_id: str, capacity_tokens: int, now: float) -> None:
        """Register a worker; a known one only gets its KV capacity updated."""
        self._clock(now)
        cap = capacity_tokens if capacity_tokens > 0 else self.cost.kv_capacity_tokens
        ws = self._ws.get(worker_id)
        if ws is None:
            ws = self._ws[worker_id] = WorkerState(worker_id, cap // self.block)
            self._price_steps(ws, 0.0)
            self.window.light = None
            self.tree.add_worker(worker_id)
        else:
            ws.capacity_blocks = cap // self.block
        self._size_tree()

    def _size_tree(self) -> None:
        """Tree budget = max(configured, tree_budget_factor x the cluster's KV capacity).

        A budget below what the workers cache makes the tree prune prefixes they still
        hold (loogle at 64+ A6000 GPUs with the 8.4M-token default), so E2 stops seeing
        them. The node bound grows in proportion to the token bound.
        """
        cfg = self.cfg
        cluster = sum(ws.capacity_blocks for ws in self._ws.values()) * self.block
        tokens = max(cfg.tree_max_tokens, int(cfg.tree_budget_factor * cluster))
        nodes = cfg.tree_max_nodes
        if tokens > cfg.tree_max_tokens > 0:
            nodes = int(nodes * tokens / cfg.tree_max_tokens)
        self.tree.set_budget(nodes, tokens)

    def remove_worker(self, worker_id: str, now: float) -> None:
        """Forget a worker: out of routing, out of every caching set and replica set."""
        self._clock(now)
        ws = self._ws.pop(worker_id, None)
        if ws is None:
            return
        ws.alive = False
        self.window.light = None
        self._decode_heavy.discard(worker_id)
        self.tree.clear_worker(worker_id, forget=True)
        self.replicator.forget_worker(worker_id)
        self._size_tree()

    # ------------------------------------------------------------------ routing

    def route(self, req: RouteInput, now: float) -> Decision:
        """Choose a worker for ``req`` and record the decision in the tree."""
        if self._rebase:
            self._clock(now)
        self._now = now
        win = self.window
        cut = now - self._window_s
        if (win.entries and win.entries[0].t < cut) or (win.outputs and win.outputs[0][0] < cut):
            win.expire(now)
        workers = self._ws
        if req.exclude:
            workers = {w: s for w, s in workers.items() if w not in req.exclude}
        if not workers:
            raise NoWorkerError("no eligible worker")
        tree = self.tree
        root = tree.root
        hashes = req.block_hashes
        node, m = tree.match(hashes)
        block = self.block
        prompt = req.prompt_tokens
        if prompt < len(hashes) * block:
            prompt = len(hashes) * block
        # Deepest matched node cached by an eligible worker.
        d, depth = node, m
        while d is not root:
            if d.workers and (workers is self._ws or any(w in workers for w in d.workers)):
                break
            depth = d.start
            d = d.parent  # type: ignore[assignment]
        out = self._expected_output(req)
        price = self.price
        price.node, price.path, price.out = node, None, out  # start pricing this request
        price.now = now
        # Exploit when missed < cached, i.e. prompt - cached < cached.
        if d is not root and prompt < 2 * depth * block:
            ws, kind, got = self._exploit(workers, node, m, d, depth, prompt)
        else:
            ws, kind, got = self._explore(workers, node, m, prompt, now)
        self._record(req, ws, node, m, prompt, got, out, now)
        matched = got * block
        return Decision(ws.id, kind, matched if matched < req.prompt_tokens else req.prompt_tokens)

    def _expected_output(self, req: RouteInput) -> float:
        """Output tokens charged to ``req``: its prediction, else the window's mean (capped
        by ``max_tokens``)."""
        out = req.predicted_output
        if out <= 0:
            win = self.window
            outputs = win.outputs
            out = win.out_sum / len(outputs) if outputs else self._default_out
        if 0 < req.max_tokens < out:
            out = req.max_tokens
        return out

    def apply_remote_decision(self, req: RouteInput, decision: Decision, now: float) -> None:
        """Book another replica's decision as ``route`` books its own (``_record``): the
        prompt predicted on the chosen worker in the tree (evicting by its capacity), the
        prefill of what that replica believed missed (``decision.matched_tokens``) on its
        backlog, and the request in the window (``L``, node counts), so ``on_done``
        corrects it here too. A ``pd_balance`` decision uses up the worker's load report
        here as well, and a request under a hot prefix sent to a worker still pending in
        its replica set seeds it here too (else every replica would send its own first
        request there). Idempotent per (request id, worker).

        Only what later requests may share goes into the tree. When the tree already
        holds at least half of the prompt (the exploit shape: missed < cached), the rest
        is this request's own tail: its siblings share the matched path, which is
        recorded on the worker, and the tail's KV events confirm it within a prefill.
        Skipping it spares the new leaf (and its later eviction and pruning), about half
        the cost of a remote decision. A colder prompt is recorded whole: its unmatched
        part may be a new shared prefix that a burst's siblings must find on that worker
        before any KV event arrives."""
        self._book_remote(req.request_id, decision.worker_id, decision.kind,
                          decision.matched_tokens, req.block_hashes, req.prompt_tokens,
                          req.max_tokens, req.predicted_output, now)

    def apply_routed(self, d: RoutedRequest, hashes: Sequence[int], now: float) -> None:
        """``apply_remote_decision`` of a peer's decision as it comes off the wire (its
        block hashes unpacked by the caller), without building a ``RouteInput`` and a
        ``Decision`` for it first: a replica applies every other replica's decisions."""
        self._book_remote(d.request_id, d.worker_id, d.kind, d.matched_tokens, hashes,
                          d.prompt_tokens, d.max_tokens, d.predicted_output, now)

    def _book_remote(self, rid: str, worker_id: str, kind: str, matched_tokens: int,
                     hashes: Sequence[int], prompt_tokens: int, max_tokens: int,
                     predicted_output: float, now: float) -> None:
        """The body of ``apply_remote_decision``, on the decision's fields (a peer's
        decision is a hot path: ``_clock`` and ``_expected_output`` are inlined)."""
        if self._rebase:
            self._clock(now)
        self._now = now
        ws = self._ws.get(worker_id)
        if ws is None:
            return
        win = self.window
        prior = win.by_rid.get(rid)
        if prior is not None and prior.ws is ws:
            return
        tree = self.tree
        block = self.block
        n = len(hashes)
        node, m = tree.match(hashes)
        prompt = prompt_tokens if prompt_tokens > n * block else n * block
        got = matched_tokens // block
        if got > n:
            got = n
        if kind == "pd_balance":
            ws.pd_used = True
        if self.replicator.entries:
            rep = self.replicator.lookup(node)
            if rep is not None:
                self.replicator.seeded(rep, ws.id)
        # As _expected_output: the prediction, else the window's mean, capped by max_tokens.
        out = predicted_output
        if out <= 0:
            outputs = win.outputs
            out = win.out_sum / len(outputs) if outputs else self._default_out
        if 0 < max_tokens < out:
            out = max_tokens
        if m == n or 2 * m < n:
            leaf = tree.record(node, m, hashes, ws.id, now)
        else:
            # The matched path only (split where the match ends inside a node, as routing does).
            leaf = tree.record_path(node, m, ws.id, now)
        self._charge(rid, ws, leaf, prompt, got, out, now)

    def explain(self, req: RouteInput, now: float) -> dict[str, tuple[float, float, float]]:
        """``(L, M, P)`` of every eligible worker for ``req``, in seconds, without routing
        it (for debugging, dashboards and tests)."""
        if self._rebase:
            self._clock(now)
        self.window.expire(now)
        node, m = self.tree.match(req.block_hashes)
        self.price.begin(node)
        prompt = max(req.prompt_tokens, len(req.block_hashes) * self.block)
        depths = self.tree.cached_depths(node, m) if m else {}
        out = {}
        for w, ws in self._ws.items():
            if w not in req.exclude:
                out[w] = self.price.terms(ws, depths.get(w, 0), prompt)
        return out

    def costs(self, req: RouteInput, now: float) -> dict[str, float]:
        """The full cost ``route`` compares (load term, ``M``, ``P``, prefill backlog,
        interference as an explored request is charged it) of every eligible worker for
        ``req``, without routing it (for audits of single decisions: loadgen/route_audit.py)."""
        terms = self.explain(req, now)  # also expires the window and begins pricing
        price = self.price
        price.now, price.out = now, self._expected_output(req)
        node, m = self.tree.match(req.block_hashes)
        depths = self.tree.cached_depths(node, m) if m else {}
        prompt = max(req.prompt_tokens, len(req.block_hashes) * self.block)
        interference = price.interference
        if self._short_in_mix(prompt, depths.values(), now):
            price.interference = 0.0  # as an explored request is priced
        out = {w: price.cost(self._ws[w], depths.get(w, 0), prompt) for w in terms}
        price.interference = interference
        return out

    def _exploit(
        self,
        workers: Mapping[str, WorkerState],
        node: Node,
        m: int,
        d: Node,
        depth: int,
        prompt: int,
    ) -> tuple[WorkerState, str, int]:
        if self.replicator.entries:
            rep = self.replicator.lookup(d)
            if rep is not None and rep.pending:
                target = self.replicator.take_pending(rep, workers)
                if target is not None:
                    self.replicator.seeded(rep, target.id)
                    return target, "replicate", self._depth_on(target.id, node, m)
        holders = d.workers
        best_cost = -1.0  # computed only if needed
        if len(holders) == 1 and workers is self._ws:
            best = workers[next(iter(holders))]
        else:
            cands = [workers[w] for w in holders if w in workers]
            if len(cands) == 1:
                best = cands[0]
            else:
                i, best_cost = self.price.cheapest(cands, [depth] * len(cands), prompt)
                best = cands[i]
        # A hit behind a queue of prefills longer than the one it saves may not pay: then
        # the cheapest worker by the full cost gets it, if cheaper (a long cold prefill
        # just sent to the worker holding a popular prefix would hold its hits for seconds).
        if self._backlog_exploit and best.busy_until - self.price.now > self._backlog_exploit * (
                best.tables or self.price.tables).pt(depth * self.block):
            if best_cost < 0:
                best_cost = self.price.cost(best, depth, prompt)
            depths = self.tree.cached_depths(node, m)
            everyone = list(workers.values())
            i, cost = self.price.cheapest(everyone, [depths.get(w.id, 0) for w in everyone],
                                          prompt)
            if cost < best_cost:
                return everyone[i], "rebalance", depths.get(everyone[i].id, 0)
        # Rebalance: direct a heavy worker's exploit traffic to the lightest worker while
        # that is cheaper even counting the prefill it has to do (the gap closes as L moves).
        if not self._rebalance:
            return best, "exploit", depth
        light = self.window.light if workers is self._ws else None
        if light is None:
            light = self._lightest(workers)
        if light is not best and best.L > self._busy_l and best.L > self._th_bal * light.L:
            if best_cost < 0:
                best_cost = self.price.cost(best, depth, prompt)
            got = self._depth_on(light.id, node, m)
            if self.price.cost(light, got, prompt) < best_cost:
                return light, "rebalance", got
        return best, "exploit", depth

    def _lightest(self, workers: Mapping[str, WorkerState]) -> WorkerState:
        """The worker with the least L (kept by the window; rescanned when unknown)."""
        if workers is not self._ws:
            return min(workers.values(), key=_LOAD)
        light = self.window.light
        if light is None:
            light = self.window.light = min(workers.values(), key=_LOAD)
        return light

    def _explore(
        self,
        workers: Mapping[str, WorkerState],
        node: Node,
        m: int,
        prompt: int,
        now: float,
    ) -> tuple[WorkerState, str, int]:
        depths = self.tree.cached_depths(node, m) if m else {}
        ws_list = list(workers.values())
        # Rotating start: among equal costs the choice moves on instead of piling up.
        self._rot = rot = (self._rot + 1) % len(ws_list)
        order = ws_list[rot:] + ws_list[:rot]
        get = depths.get
        cached = [get(ws.id, 0) for ws in order] if depths else [0] * len(order)
        price = self.price
        interference = price.interference
        if self._short_in_mix(prompt, cached, now):
            price.interference = 0.0
        i, best_cost = price.cheapest(order, cached, prompt)
        price.interference = interference
        best, got = order[i], cached[i]
        if self._explore_wait:
            best, got = self._bound_wait(order, cached, prompt, now, best, got)
        if self._affinity > 0 and m:
            home = self._affinity_home(workers, node, m, prompt, depths, best, best_cost)
            if home is not None:
                return home, "affinity", get(home.id, 0)
        pd = self._pd_candidate(workers, now) if self._decode_heavy else None
        if pd is not None:
            pd_got = get(pd.id, 0)
            if pd is best or self.price.cost(pd, pd_got, prompt) <= self._pd_ratio * best_cost:
                pd.pd_used = True
                return pd, "pd_balance", pd_got
        return best, "explore", got

    def _short_in_mix(self, prompt: int, cached_blocks: Iterable[int], now: float) -> bool:
        """Whether R's prefill (on the default GPU, after the most any worker caches of it,
        ``cached_blocks`` per worker) is under 1/``interference_mix_ratio`` of the longest
        prefill charged lately, and that one at least ``interference_mix_min_s`` long: then
        R is priced without the interference term (PolicyConfig). Off, it costs nothing."""
        if not self._mix_ratio:
            return False
        longest = self._long_prefill.get(now)
        if longest < self._mix_min_s:
            return False
        own = self.price.pt(self.tables, prompt - max(cached_blocks, default=0) * self.block, 0)
        return own * self._mix_ratio < longest

    def _bound_wait(self, order: list[WorkerState], cached: list[int], prompt: int,
                    now: float, best: WorkerState, got: int) -> tuple[WorkerState, int]:
        """``best`` (caching ``got`` blocks of R), unless its prefill backlog exceeds both
        ``explore_wait`` x R's prefill there and ``explore_wait_fleet`` x the other
        workers' mean backlog; then the cheapest of the workers whose backlog is within
        the first bound (``best`` when there is none)."""
        bound, block = self._explore_wait, self.block

        def within(ws: WorkerState, blocks: int) -> bool:
            return ws.busy_until - now <= bound * self.price.pt(
                ws.tables or self.tables, prompt - blocks * block, blocks)

        if within(best, got) or not self._behind_fleet(best, order, now):
            return best, got  # not far behind, or the fleet is too: nowhere starts R sooner
        ok = [j for j, ws in enumerate(order) if within(ws, cached[j])]
        if not ok:
            return best, got
        j, _ = self.price.cheapest([order[j] for j in ok], [cached[j] for j in ok], prompt)
        return order[ok[j]], cached[ok[j]]

    def _behind_fleet(self, ws: WorkerState, fleet: list[WorkerState], now: float) -> bool:
        """``ws``'s prefill backlog exceeds ``explore_wait_fleet`` x the mean of the others'
        in ``fleet`` (a worker alone is never behind)."""
        if len(fleet) < 2:
            return False
        others = sum(w.busy_until - now for w in fleet if w is not ws and w.busy_until > now)
        return ws.busy_until - now > self._explore_wait_fleet * others / (len(fleet) - 1)

    def _affinity_home(
        self,
        workers: Mapping[str, WorkerState],
        node: Node,
        m: int,
        prompt: int,
        depths: Mapping[str, int],
        best: WorkerState,
        best_cost: float,
    ) -> WorkerState | None:
        """The worker that recently served R's prefix, if it is nearly as cheap as ``best``.

        The prefix is the deepest matched node with window counts whose matched path
        (``m`` blocks in ``node``, then ancestors) covers at least half the prompt (were it
        cached, R would be an exploit); its home is the cheapest worker with requests
        through it in the window. None: no such node or worker, ``best`` is already one of
        them, or the home costs more than ``best_cost``
        + ``affinity_prefill_slack`` x PT(the prefix) (saturated cluster: or more than
        ``affinity_saturated_ratio`` x ``best_cost``; saturated: ``best``'s ``L`` fills the
        window or its cost reaches ``load_wait_cap_s``) while it is busy (``L`` above
        ``rebalance_min_util`` x H; below that nothing queues there, as for rebalancing).
        """
        root = self.tree.root
        half = prompt / (2 * self.block)  # blocks
        end = m  # matched blocks through ``node``
        while node is not root and end >= half:
            counts = node.counts
            if counts:
                if best.id in counts:
                    return None
                home = None
                home_cost = math.inf
                # Affinity may cost up to a multiple of the prefill it can save later; on a
                # saturated cluster (even the cheapest worker's L fills the window, or its
                # cost is a full capped wait) work saved is what matters, and it may cost
                # a fraction of the load too.
                limit = best_cost + self._affinity * self.tables.pt(end * self.block)
                if (best.L >= self._window_s or 0 < self.price.wait_cap <= best_cost) and (
                        self._affinity_sat * best_cost > limit):
                    limit = self._affinity_sat * best_cost
                busy = self._busy_l
                for w in counts:
                    ws = workers.get(w)
                    if ws is None:
                        continue
                    c = self.price.cost(ws, depths.get(w, 0), prompt)
                    if c < home_cost and (c <= limit or ws.L <= busy):
                        home, home_cost = ws, c
                return home
            end = node.start
            node = node.parent  # type: ignore[assignment]
        return None

    def _pd_candidate(self, workers: Mapping[str, WorkerState], now: float) -> WorkerState | None:
        """The lightest decode-dominated worker with a fresh, unused load report (and, with
        ``prefill_backlog_weight`` on, no prefill backlog)."""
        stale = now - self.cfg.load_report_stale_s
        backlog = self.price.backlog_weight > 0
        best = None
        for w in self._decode_heavy:
            ws = workers.get(w)
            if ws is None or ws.pd_used or ws.report_ts < stale:
                continue
            if backlog and ws.busy_until > now:
                # Still prefilling what was routed there since (the decode share of a
                # report lags by its window): not the spare prefill capacity it reports.
                continue
            # Ties go to the smaller id: the set's order varies with the process's string
            # hashing, the decision must not.
            if best is None or ws.L < best.L or (ws.L == best.L and ws.id < best.id):
                best = ws
        return best

    def _depth_on(self, worker: str, node: Node, m: int) -> int:
        """Blocks of R's matched path cached on ``worker``."""
        root = self.tree.root
        depth = m
        while node is not root:
            if worker in node.workers:
                return depth
            depth = node.start
            node = node.parent  # type: ignore[assignment]
        return 0

    def _record(
        self,
        req: RouteInput,
        ws: WorkerState,
        node: Node,
        m: int,
        prompt: int,
        got: int,
        out: float,
        now: float,
    ) -> None:
        """Put the decision in the tree at once, charge L, model the worker's eviction."""
        leaf = self.tree.record(node, m, req.block_hashes, ws.id, now)
        self._charge(req.request_id, ws, leaf, prompt, got, out, now)

    def _charge(self, rid: str, ws: WorkerState, leaf: Node, prompt: int, got: int,
                out: float, now: float) -> None:
        """The worker's side of a decision recorded up to ``leaf``: its modelled eviction
        (for a worker that sends KV events only while its reported queueing time is under
        ``model_eviction_queue_s``), prefill backlog and window ``L``.

        A worker's own BlockRemoved events are what it evicted. The model evicts in
        routing order for every prompt routed there, queued ones too; behind minutes of
        queue, a worker that runs cache hits first (``prefix_fair``) still held much of
        what the model dropped, and E2 priced those prefills again and moved their
        prefixes. Behind a short queue the model only runs ahead of the events
        (docs/sim-results.md, "What the tree evicts")."""
        tree = self.tree
        over = tree.worker_blocks[ws.id] - ws.capacity_blocks
        if over > 0 and (not ws.reports_kv or ws.avg_queue_s < self._model_eviction_queue_s):
            tree.evict_lru(ws.id, over, protect=leaf)
        prefill = self.price.pt(ws.tables or self.tables, prompt - got * self.block, got)
        ws.busy_until = (ws.busy_until if ws.busy_until > now else now) + prefill
        if self._mix_ratio:
            self._long_prefill.add(now, prefill)
        self.window.add(now, ws, leaf, rid, prefill, prompt, out)

    # ------------------------------------------------------------------ feedback

    def on_kv_events(self, worker_id: str, events: list[KvEvent], now: float) -> None:
        """BlockStored adds the worker to caching sets, BlockRemoved / AllBlocksCleared drop it."""
        self._clock(now)
        ws = self._ws.get(worker_id)
        if ws is None:
            return
        # Only the worker's own block events say it reports them: the service also passes
        # AllBlocksCleared on its behalf when it sees the engine restart.
        if not ws.reports_kv and any(isinstance(e, (BlockStored, BlockRemoved)) for e in events):
            ws.reports_kv = True
        self.tree.apply_events(worker_id, events, now)

    def on_load(self, report: LoadReportEvent, now: float) -> None:
        """Decode share (prefill/decode balancing) and queueing time (overload signal)."""
        self._clock(now)
        ws = self._ws.get(report.worker_id)
        if ws is None:
            return
        ws.decode_share = report.decode_share
        ws.report_ts = now
        ws.pd_used = False
        ws.avg_step_s = report.avg_step_s
        ws.avg_queue_s = report.avg_queue_s
        ws.running = report.running
        if report.profile != ws.profile:
            self._set_profile(ws, report.profile)
        self._price_steps(ws, report.avg_step_s)
        if report.decode_share > self.cfg.imbalance_ratio and not (
                self.cfg.pd_needs_room and report.waiting):
            self._decode_heavy.add(ws.id)
        else:
            self._decode_heavy.discard(ws.id)
        ws.queue.add(now, report.avg_queue_s)

    def _price_steps(self, ws: WorkerState, reported_step: float) -> None:
        """``ws.step_s``: what each output token of a request routed there is priced at
        (``decode_step_weight`` x its reported mean step, ``gpu_step_weight`` x its GPU's
        lone decode step). An idle worker reports no step, not a free one: a token waits
        at least a lone decode step of its GPU."""
        if self._step_weight or self._gpu_step:
            lone = (ws.tables or self.tables).lone_step
            ws.step_s = (self._step_weight * max(reported_step, lone)
                         + self._gpu_step * lone)

    def _set_profile(self, ws: WorkerState, profile: str) -> None:
        """Price ``ws``'s GPU time with ``profile`` (unknown or empty: the policy's own)."""
        ws.profile = profile
        tables = self._profile_tables.get(profile)
        if tables is None and profile:
            try:
                tables = CostTables(CostModel.load(profile), self.cfg.dt_batch_size)
            except ValueError:
                log.warning("worker %s: unknown profile %r, priced as %s", ws.id, profile,
                            self.cost.name)
            else:
                self._profile_tables[profile] = tables
        ws.tables = None if tables is self.tables else tables

    def on_done(self, done: RequestDoneEvent, now: float) -> None:
        """Real output length into the window average and the request's L; queueing time."""
        self._clock(now)
        self.window.observe_done(done, now)
        ws = self._ws.get(done.worker_id)
        if ws is not None and done.finish_reason != "abort":
            ws.queue.add(now, done.queue_s)

    def tick(self, now: float) -> None:
        """Window expiry, overload detection, hot-prefix replication and shrinking."""
        self._clock(now)
        self.window.expire(now)
        if self._aging > 0:
            self.window.age(now, self._aging)
        self.tree.maintain()
        half = self.cfg.window_s / 2
        for ws in self._ws.values():
            ws.queue.advance(now, half)
        if self._ws:
            self.replicator.tick(now, self._ws, self._overload_test())

    def _overload_test(self) -> Callable[[WorkerState], bool]:
        """Predicate: queueing time doubled over H, or L well above the cluster mean."""
        cfg = self.cfg
        mean_l = sum(ws.L for ws in self._ws.values()) / len(self._ws)
        busy = cfg.rebalance_min_util * cfg.window_s

        def overloaded(ws: WorkerState) -> bool:
            if ws.queue.doubled(cfg.replicate_queue_growth, cfg.replicate_min_queue_s):
                return True
            return ws.L > busy and ws.L > cfg.th_bal * mean_l  # never true for th_bal = inf

        return overloaded

    # ------------------------------------------------------------------ persistence

    def _parts(self) -> e2_state.E2Parts:
        return e2_state.E2Parts(self.tree, self._ws, self._decode_heavy, self.window,
                                self.replicator, self.cfg.window_s, self._now)

    def _clock(self, now: float) -> None:
        if self._rebase:
            e2_state.rebase(self._parts(), now)
            self._rebase = False
        self._now = now

    def _restored(self, now: float | None) -> None:
        """The state was replaced: its times are rebased on the next call (``now`` None),
        or they already read on ``now``'s clock."""
        for ws in self._ws.values():  # priced on their GPUs before any load report
            self._price_steps(ws, 0.0)
        self._long_prefill.clear()  # times of the state replaced
        if now is None:
            self._rebase = True
            return
        self._size_tree()
        self._rebase = False
        self._now = now

    def summary(self) -> PolicySummary:
        """The tree and the replicator's counts."""
        return PolicySummary(tree=self.tree, replicas_added=self.replicator.grown,
                             replicas_dropped=self.replicator.shrunk)
