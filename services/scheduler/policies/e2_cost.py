"""E2's load cost of a request on a worker: ``L + M + P`` in estimated GPU seconds.

- ``L``: the worker's windowed work (``e2_load.LoadWindow``); with ``load_wait`` (the
  default) the load term is the queueing delay ``L`` implies instead, at most
  ``load_wait_cap_s`` (``LoadCost.load``).
- ``M``: for each tree node ``j`` the worker would evict (LRU, in the scheduler's model of
  its cache) to fit R's missing tokens, ``PT(len_j) * N_j`` with ``N_j`` = window requests
  through ``j`` on the worker / all window requests on the worker. Evicting a prefix that
  most of the worker's traffic shares is expensive; evicting a one-off is nearly free.
- ``P``: ``PT(tokens of R not cached on the worker)``; with ``pt_after_cached``, computed
  after the ones it caches (each chunk attends to the cached prefix).
- Prefill backlog (added to ``L``; not in Preble's formula; default weight 1.0): weight x
  the seconds until the prefills already routed to the worker would be done, run one
  after another from their assignment (``WorkerState.busy_until``). ``L`` is work over
  the whole window, so a worker that prefilled a long prompt two minutes ago and one
  that started one a second ago look alike; only the second delays R now.
- Interference (default 0.5): weight x P x the worker's running sequences (latest
  load report). Under chunked prefill, R's prefill lengthens every step of the requests
  already decoding there, each by about P in total.
- Per-worker GPU: every term is in seconds of the worker's own GPU, priced with its own
  profile (``WorkerState.tables``, from its load reports), so in a fleet that mixes GPU
  types a fast GPU's ``L`` and ``P`` are smaller for the same work.
- Decode speed and pressure (added to ``L``; not in Preble's formula): R's expected
  output tokens x ``WorkerState.step_s``: 0.5 x its GPU's lone decode step
  (``gpu_step_weight``: what a token takes on that GPU, 4x longer on an A6000 than on an
  H100), plus, when ``decode_step_weight`` is on, the worker's mean engine step from its
  load report. ``L``
  prices decode as the marginal cost of one more sequence in a batch, which makes a worker
  busy with long generations look cheap; every output token of R will wait one of its
  steps, and those steps are long there (programming: ~4k-token outputs).
"""

from __future__ import annotations

from prefixmesh.services.scheduler.policies.costs import CostTables
from prefixmesh.services.scheduler.policies.e2_load import WorkerState
from prefixmesh.services.scheduler.prefix_tree import Node, PrefixTree


class LoadCost:
    """Prices one request on candidate workers; ``begin`` it once per decision."""

    def __init__(self, tree: PrefixTree, tables: CostTables) -> None:
        self.tree = tree
        self.tables = tables
        self.block = tables.block
        # The request being priced: the node its match ends in, and its path as a set
        # (computed once, only when M needs it). Set both when starting a request.
        self.node: Node = tree.root
        self.path: set[Node] | None = None
        # Output tokens expected of the request being priced (decode pressure).
        self.out = 0.0
        # Prefill backlog term: weight x (worker's busy_until - now) when positive.
        self.backlog_weight = 0.0
        self.now = 0.0
        # Interference term: weight x P x the worker's running sequences (its report's, or
        # with ``by_inflight`` its requests routed and not done).
        self.interference = 0.0
        self.by_inflight = False
        # Load term: the queueing delay ``L`` implies (window ``H`` seconds), or 0: ``L``.
        self.wait_window = 0.0
        # ... capped at this many seconds (0: no cap).
        self.wait_cap = 0.0
        # P priced after the worker's cached blocks of the request (else from scratch).
        self.after_cached = False

    def pt(self, tables: CostTables, missing: int, cached_blocks: int) -> float:
        """P: seconds to prefill ``missing`` tokens on a worker caching ``cached_blocks``
        blocks of the request, with ``tables`` (that worker's GPU)."""
        if self.after_cached:
            return tables.pt_after(missing, cached_blocks * self.block)
        return tables.pt(missing)

    def load(self, ws: WorkerState) -> float:
        """The load term of ``ws``: ``L``, or the queueing delay it implies (M/M/1 at the
        window's utilisation ``u = L / H``, capped by ``L`` and by ``wait_cap``)."""
        h = self.wait_window
        if not h or ws.n <= 0:
            return ws.L
        u = ws.L / h
        w = u / (1.0 - u) * ws.L / ws.n if u < 1.0 else ws.L
        if w > ws.L:
            w = ws.L
        cap = self.wait_cap
        return cap if cap and w > cap else w

    def begin(self, node: Node) -> None:
        """Start pricing a request whose match ends in ``node``."""
        self.node = node
        self.path = None

    def terms(self, ws: WorkerState, cached_blocks: int, prompt: int) -> tuple[float, float, float]:
        """``(L, M, P)`` of the request on ``ws`` given the blocks of it ``ws`` caches."""
        missing = prompt - cached_blocks * self.block
        p = self.pt(ws.tables or self.tables, missing, cached_blocks)
        return self.load(ws), self.evict_cost(ws, missing), p

    def cost(self, ws: WorkerState, cached_blocks: int, prompt: int) -> float:
        """``L + M + P`` (seconds)."""
        missing = prompt - cached_blocks * self.block
        p = self.pt(ws.tables or self.tables, missing, cached_blocks)
        if self.interference:
            p += self.interference * p * (ws.inflight if self.by_inflight else ws.running)
        c = self.load(ws) + ws.step_s * self.out + p + self.evict_cost(ws, missing)
        if self.backlog_weight and ws.busy_until > self.now:
            c += self.backlog_weight * (ws.busy_until - self.now)
        return c

    def evict_cost(self, ws: WorkerState, missing: int) -> float:
        """M for fitting ``missing`` more tokens on ``ws``; 0 while they fit in free capacity."""
        w = ws.id
        over = self.tree.worker_blocks.get(w, 0) + -(-missing // self.block) - ws.capacity_blocks
        if over <= 0 or ws.n <= 0:
            return 0.0
        path = self.path
        if path is None:  # R's own path: computed once per decision, only when needed
            path = self.path = set(self.tree.path(self.node))
        pt = (ws.tables or self.tables).pt
        block = self.block
        freed = 0
        m = 0.0
        for n in self.tree.worker_lru(w):
            if n in path:
                continue  # R itself refreshes these; the LRU will not pick them
            size = len(n.hashes)
            c = n.counts.get(w)
            if c:
                m += pt(size * block) * c
            freed += size
            if freed >= over:
                break
        return m / ws.n

    def cheapest(
        self, workers: list[WorkerState], cached: list[int], prompt: int
    ) -> tuple[int, float]:
        """Index and cost of the argmin of ``L + M + P`` over ``workers`` (``cached[i]`` =
        blocks of the request ``workers[i]`` caches); the earliest wins ties.

        Branch and bound: load + ``P`` is a lower bound (M >= 0), so M, the one term that walks
        an LRU list, is computed only for workers whose bound beats the best cost so far.
        """
        default = self.tables
        block = self.block
        # P by (cost tables, cached blocks): most workers share a few values.
        p_of: dict[tuple[CostTables, int], float] = {}
        bounds = []
        out = self.out
        bw, now = self.backlog_weight, self.now
        iw = self.interference
        by_inflight = self.by_inflight
        load = self.load
        for ws, got in zip(workers, cached):
            tables = ws.tables or default
            p = p_of.get((tables, got))
            if p is None:
                p = p_of[tables, got] = self.pt(tables, prompt - got * block, got)
            if iw:
                p += iw * p * (ws.inflight if by_inflight else ws.running)
            if bw and ws.busy_until > now:
                p += bw * (ws.busy_until - now)
            bounds.append(load(ws) + ws.step_s * out + p)
        first = bounds.index(min(bounds))
        best_i = first
        best = bounds[first] + self.evict_cost(workers[first], prompt - cached[first] * block)
        for i, lb in enumerate(bounds):
            if lb < best and i != first:  # rare: M of the first pick exceeded a gap in L + P
                c = lb + self.evict_cost(workers[i], prompt - cached[i] * block)
                if c < best or (c == best and i < best_i):
                    best_i, best = i, c
        return best_i, best
