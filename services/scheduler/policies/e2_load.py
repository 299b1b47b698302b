"""E2's load accounting: per-worker windowed GPU work ``L`` and the overload signals.

``L_i`` = sum over requests routed to worker ``i`` in the last ``H`` seconds of
``PT(missed_r) + DT * output_r`` (docs/design.md section 5), in estimated GPU seconds. It is kept
incrementally: added when a request is assigned, corrected when its completion record
reports the real output length, subtracted when it leaves the window. The window is never
rescanned: expiry pops from the front of a deque ordered by assignment time.
"""

from __future__ import annotations

from collections import deque

import msgspec

from prefixmesh.services.scheduler.policies.costs import CostTables
from prefixmesh.services.scheduler.prefix_tree import Node, PrefixTree
from prefixmesh.shared.wire import RequestDoneEvent

# Completion records whose output counts towards the windowed average output length.
_FINISHED = frozenset({"stop", "length"})
# Requests in flight that one ``LoadWindow.age`` call looks at, at most: a fleet with more
# has them looked at over several calls (ticks), so no tick stalls routing for a pass over
# every request in flight.
AGE_SLICE = 1024


class QueueTrend:
    """Queueing-time samples of one worker over the window, split into two halves.

    ``doubled`` is Preble's overload test: the mean over the recent half of ``H`` is at
    least ``growth`` times the mean over the older half. O(1) amortised per sample.
    """

    __slots__ = ("recent", "old", "rsum", "osum")

    def __init__(self) -> None:
        self.recent: deque[tuple[float, float]] = deque()
        self.old: deque[tuple[float, float]] = deque()
        self.rsum = 0.0
        self.osum = 0.0

    def add(self, now: float, queue_s: float) -> None:
        """One sample (seconds waited in the worker's queue)."""
        self.recent.append((now, queue_s))
        self.rsum += queue_s

    def advance(self, now: float, half_s: float) -> None:
        """Age samples: recent -> old after ``half_s``, dropped after ``2 * half_s``."""
        cut = now - half_s
        recent, old = self.recent, self.old
        while recent and recent[0][0] < cut:
            s = recent.popleft()
            self.rsum -= s[1]
            old.append(s)
            self.osum += s[1]
        cut -= half_s
        while old and old[0][0] < cut:
            self.osum -= old.popleft()[1]
        if not recent:
            self.rsum = 0.0
        if not old:
            self.osum = 0.0

    def doubled(self, growth: float, min_queue_s: float) -> bool:
        """True when recent mean >= growth x older mean and >= ``min_queue_s``."""
        if not self.recent or not self.old:
            return False
        r = self.rsum / len(self.recent)
        return r >= min_queue_s and r >= growth * (self.osum / len(self.old))

    def shift(self, delta: float) -> None:
        """Rebase sample times by ``delta`` seconds."""
        self.recent = deque((t + delta, q) for t, q in self.recent)
        self.old = deque((t + delta, q) for t, q in self.old)


class RecentMax:
    """The largest value added in the last ``horizon_s`` seconds (a monotonic deque: each
    value is kept only while no larger one came after it)."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._q: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        q = self._q
        while q and q[-1][1] <= value:
            q.pop()
        q.append((now, value))

    def get(self, now: float) -> float:
        """The largest value added since ``now - horizon_s`` (0 when none was)."""
        q = self._q
        cut = now - self.horizon_s
        while q and q[0][0] < cut:
            q.popleft()
        return q[0][1] if q else 0.0

    def clear(self) -> None:
        self._q.clear()


class WorkerState:
    """Everything E2 tracks about one worker."""

    __slots__ = (
        "id",
        "capacity_blocks",
        "L",
        "n",
        "decode_share",
        "report_ts",
        "pd_used",
        "step_s",
        "avg_step_s",
        "avg_queue_s",
        "busy_until",
        "running",
        "inflight",
        "reports_kv",
        "queue",
        "alive",
        "profile",
        "tables",
    )

    def __init__(self, worker_id: str, capacity_blocks: int) -> None:
        self.id = worker_id
        # The worker's own cost-model profile (its load reports name it) and PT/DT tables
        # from it; None: the policy's default tables (a fleet of one GPU type).
        self.profile = ""
        self.tables: CostTables | None = None
        # KV capacity in blocks (the scheduler's cache model evicts beyond it).
        self.capacity_blocks = capacity_blocks
        # Windowed estimated GPU work (seconds) and requests in the window.
        self.L = 0.0
        self.n = 0
        # Latest load report: decode share of scheduled tokens and when it arrived.
        self.decode_share = 0.0
        self.report_ts = float("-inf")
        # A cold request was already sent here on the strength of the current report.
        self.pd_used = False
        # What each output token of a request routed there is priced at (s): its GPU's lone
        # decode step x gpu_step_weight, plus its reported mean step (at least that lone
        # step) x decode_step_weight (E2Policy._price_steps; 0 with both weights off).
        self.step_s = 0.0
        # Latest load report's mean engine step and mean queueing time (s), unweighted
        # (in-flight aging: how many tokens a request running there has produced by now).
        self.avg_step_s = 0.0
        self.avg_queue_s = 0.0
        # Prefill backlog: when the prefills routed here would be done if the worker ran
        # them one after another from their assignment (s, the policy's clock).
        self.busy_until = 0.0
        # Sequences in the worker's running batch by its latest load report.
        self.running = 0
        # Requests routed here and not done yet (the window's own count: no report lag).
        self.inflight = 0
        # The worker sends KV events: its BlockRemoved say what it evicted, so the tree
        # does not model its eviction at routing (``E2Policy._charge``).
        self.reports_kv = False
        self.queue = QueueTrend()
        # False once the worker left (its requests may still sit in the window).
        self.alive = True

    def __repr__(self) -> str:
        return f"WorkerState({self.id!r}, L={self.L:.3f}, n={self.n})"


class WindowEntry(msgspec.Struct, gc=False):
    """One routed request inside the window (untracked by the garbage collector: it is
    never part of a reference cycle)."""

    # Assignment time (s), the worker's state, estimated GPU seconds charged to its L.
    t: float
    ws: WorkerState
    cost: float
    # Node the request's path ended in (window counts are released from it upward).
    leaf: Node
    rid: str
    # DT per output token (s) and the output length charged (tokens), to correct on done.
    dt_tok: float
    out_est: float
    # Counted in its worker's ``inflight`` (routed here, not restored from a snapshot).
    counted: bool = False


class LoadWindow:
    """The sliding window: ``L`` per worker, node request counts, average output length."""

    def __init__(self, window_s: float, tree: PrefixTree, tables: CostTables) -> None:
        self.window_s = window_s
        self.tree = tree
        self.tables = tables
        self.entries: deque[WindowEntry] = deque()
        self.by_rid: dict[str, WindowEntry] = {}
        self.outputs: deque[tuple[float, int]] = deque()
        self.out_sum = 0
        # The worker with the least L, kept as L moves (None: unknown, recompute). Only an
        # increase of that worker's own L makes it unknown; any decrease is compared.
        self.light: WorkerState | None = None
        # Incremental persistence (None: off): entries added or corrected and completions
        # (time, output tokens) recorded since the last ``take_journal``.
        self.journal: list[WindowEntry | tuple[float, int]] | None = None
        # ``age``'s pass over the requests in flight: those it still has to look at.
        self._aging: list[WindowEntry] = []
        self._aged = 0

    def track(self, e: WindowEntry, in_flight: bool = True) -> None:
        """``e``'s request awaits its completion record until done or out of the window (one
        entry per request id: a later one, a request placed again, replaces it), counted
        in its worker's ``inflight`` meanwhile. ``in_flight`` False: an entry restored from
        a snapshot, which does not say whether it is done; kept, not counted."""
        prior = self.by_rid.get(e.rid)
        if prior is not None and prior.counted:
            prior.ws.inflight -= 1
        self.by_rid[e.rid] = e
        if in_flight:
            e.counted = True
            e.ws.inflight += 1

    def _untrack(self, rid: str, e: WindowEntry | None = None) -> WindowEntry | None:
        """Stop tracking ``rid`` (only if its entry is ``e``, when given); its entry."""
        tracked = self.by_rid.get(rid)
        if tracked is None or (e is not None and tracked is not e):
            return None
        del self.by_rid[rid]
        if tracked.counted:
            tracked.ws.inflight -= 1
        return tracked

    def take_journal(self) -> list[WindowEntry | tuple[float, int]]:
        """What changed since the last call (O(1)); starts tracking if it was off."""
        j = self.journal or []
        self.journal = []
        return j

    def add(
        self,
        now: float,
        ws: WorkerState,
        leaf: Node,
        rid: str,
        prefill_s: float,
        context_tokens: int,
        out_est: float,
    ) -> WindowEntry:
        """Assign a request: ``L += PT(missed) + DT(context) * output`` (GPU seconds)."""
        dt_tok = (ws.tables or self.tables).dt(context_tokens)
        cost = prefill_s + dt_tok * out_est
        e = WindowEntry(now, ws, cost, leaf, rid, dt_tok, out_est)
        self.entries.append(e)
        if rid:
            self.track(e)
        if self.journal is not None:
            self.journal.append(e)
        ws.L += cost
        ws.n += 1
        if ws is self.light:
            self.light = None
        return e

    def expire(self, now: float) -> None:
        """Drop everything older than the window (amortised O(1) per request)."""
        cut = now - self.window_s
        entries = self.entries
        if entries and entries[0].t < cut:
            release = self.tree.release
            while entries and entries[0].t < cut:
                e = entries.popleft()
                ws = e.ws
                ws.n -= 1
                # Exact zero when the window empties, so float drift never accumulates.
                ws.L = ws.L - e.cost if ws.n > 0 else 0.0
                light = self.light
                if light is not None and ws is not light and ws.alive and ws.L < light.L:
                    self.light = ws
                release(e.leaf, ws.id)
                if e.rid:
                    self._untrack(e.rid, e)
        outputs = self.outputs
        while outputs and outputs[0][0] < cut:
            self.out_sum -= outputs.popleft()[1]

    def observe_done(self, done: RequestDoneEvent, now: float) -> None:
        """A completion: feed the average output and correct the request's DT estimate."""
        if done.finish_reason in _FINISHED and done.completion_tokens > 0:
            self.outputs.append((now, done.completion_tokens))
            self.out_sum += done.completion_tokens
            if self.journal is not None:
                self.journal.append((now, done.completion_tokens))
        e = self._untrack(done.request_id)
        if e is not None and e.ws.id == done.worker_id and e.ws.n > 0:
            delta = e.dt_tok * (done.completion_tokens - e.out_est)
            e.cost += delta
            e.out_est = float(done.completion_tokens)
            e.ws.L = max(e.ws.L + delta, 0.0)
            if self.journal is not None:
                self.journal.append(e)  # re-recorded: the later record of a rid wins
            light = self.light
            if light is not None and e.ws.alive and (
                e.ws is light if delta > 0 else e.ws.L < light.L
            ):
                self.light = None if delta > 0 else e.ws

    def age(self, now: float, factor: float) -> None:
        """Raise the output charged to requests that are still running past it.

        ``L`` charges a request the window's mean output until its completion record
        arrives, so a worker busy with a few very long generations looks as cheap as one
        with short ones for their whole life (and dear only after they finished, while
        they stay in the window). A request assigned ``a`` seconds ago to a worker whose
        steps take ``s`` seconds and whose queue holds requests ``q`` seconds has produced
        about ``(a - q - its prefill) / s`` tokens; once that exceeds the charged output,
        the charge becomes ``factor`` x it (a generation that already ran long is
        expected to run about as long again). Looks at ``AGE_SLICE`` requests at most,
        going on where the last call stopped (all of them when no more are in flight).
        """
        if self._aged >= len(self._aging):
            self._aging = list(self.by_rid.values())
            self._aged = 0
        todo = self._aging[self._aged : self._aged + AGE_SLICE]
        self._aged += len(todo)
        by_rid = self.by_rid
        light = self.light
        for e in todo:
            if by_rid.get(e.rid) is not e:
                continue  # done (or placed again) since this pass began
            ws = e.ws
            step = ws.avg_step_s
            if step <= 0.0 or not ws.alive:
                continue
            run_s = now - e.t - ws.avg_queue_s - (e.cost - e.dt_tok * e.out_est)
            produced = run_s / step
            if produced <= e.out_est:
                continue
            new = factor * produced
            delta = e.dt_tok * (new - e.out_est)
            e.cost += delta
            e.out_est = new
            ws.L += delta
            if ws is light:
                light = self.light = None
            if self.journal is not None:
                self.journal.append(e)

    def avg_output(self) -> float:
        """Mean completion tokens over the window (0 when none finished yet)."""
        return self.out_sum / len(self.outputs) if self.outputs else 0.0

    def shift(self, delta: float) -> None:
        """Rebase every time by ``delta`` seconds."""
        for e in self.entries:
            e.t += delta
        self.outputs = deque((t + delta, n) for t, n in self.outputs)
