"""Helpers shared by the tests (a helper module, not a test module: tests import it, and it
imports no test module).

- services in-process with their real lifecycle (``running``), waiting for a condition
  (``eventually``), skipping on a missing extra (``need``);
- token ids, block hashes and routing inputs (``span``, ``toks``, ``route_input``);
- KV-cache fakes and replays (``FakeView``, ``replay_kv_events``) and a virtual-time driver
  for engines (``SimDriver``);
- the options of a whole mesh as processes (``mesh_options``; tests/e2e/conftest.py's
  ``mesh`` fixture starts one);
- the tiny predictor artifact of tests/ml (``build_tiny_artifact``), and an hf engine's
  outputs (``HfHarness``).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes
from prefixmesh.shared.runtime.lifecycle import Service, run_service
from prefixmesh.shared.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from prefixmesh.services.scheduler.policies.base import PolicyConfig, RouteInput
    from prefixmesh.services.scheduler.policies.e2 import E2Policy
    from prefixmesh.services.up import MeshOptions
    from prefixmesh.services.worker.engine.hf_engine import HfEngine
    from prefixmesh.services.worker.engine.sim import SimEngine
    from prefixmesh.services.worker.engine.types import (
        EngineRequest,
        StepOutput,
        StepPlan,
    )
    from prefixmesh.shared.costmodel import CostModel
    from prefixmesh.shared.trail.artifact import PredictorArtifact

START_TIMEOUT_S = 30.0
# A service still stopping after this long has its tasks' stacks printed (it is stuck).
STOP_WATCH_S = 15.0
# Load-report interval of workers in service tests (seconds): fast, so load views and
# failover settle in a fraction of a second.
FAST_LOAD_INTERVAL_S = 0.05
# Set by ``pytest --require-extras`` (tests/conftest.py; ``make test`` passes it).
REQUIRE_EXTRAS_ENV = "PREFIXMESH_REQUIRE_EXTRAS"


def need(extra: str, *modules: str) -> None:
    """Skip the calling test module when a module of an optional extra is missing; under
    ``--require-extras`` (where every extra is installed) fail it instead."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    why = f"{', '.join(missing)} not installed (pip install '.[{extra}]')"
    if os.environ.get(REQUIRE_EXTRAS_ENV):
        raise ImportError(f"--require-extras: {why}")
    pytest.skip(why, allow_module_level=True)


def index_table(kind: str) -> type:
    """The block index's table of ``kind``: "c" (the C extension; skipped where it was not
    built, failed under ``--require-extras``, where the install had a compiler) or "dict"."""
    from prefixmesh.services.scheduler import block_index

    if kind == "dict":
        return block_index.DictTable
    if block_index.HashTable is block_index.DictTable:
        why = "the C extension _hashtable is not built (no C compiler at install)"
        if os.environ.get(REQUIRE_EXTRAS_ENV):
            pytest.fail(f"--require-extras: {why}")
        pytest.skip(why)
    return block_index.HashTable


@asynccontextmanager
async def running(service: Service, drain_timeout_s: float = 5.0) -> AsyncIterator[Service]:
    """Start ``service`` as ``python -m`` would, yield it ready, then shut it down in order."""
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(run_service(service, stop, drain_timeout_s, ready=ready.set))
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=START_TIMEOUT_S,
                                 return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        waiter.cancel()
        task.result()  # raises the start failure
        raise RuntimeError(f"{service.name} stopped during start")
    if waiter not in done:
        waiter.cancel()
        stop.set()
        await task
        raise TimeoutError(f"{service.name} not ready in {START_TIMEOUT_S}s")
    try:
        yield service
    finally:
        stop.set()
        done, _ = await asyncio.wait({task}, timeout=STOP_WATCH_S)
        if not done:  # say where it is stuck before the test's own timeout ends the run
            _print_tasks(f"{service.name} not stopped after {STOP_WATCH_S}s")
        await task


def _print_tasks(why: str) -> None:
    """Every task's stack, for a test that hangs (pytest shows what a test prints)."""
    print(f"--- {why}; tasks:", file=sys.stderr)
    for t in asyncio.all_tasks():
        t.print_stack(file=sys.stderr)


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.05) -> None:
    """Wait until ``predicate()`` is true; fail the test on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


async def eventually_async(predicate: Callable[[], Any], timeout: float = 10.0,
                           interval: float = 0.05) -> None:
    """``eventually`` for a predicate that must be awaited (a Redis read, say)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------- a whole mesh


def mesh_options(nats_url: str, redis_url: str, log_dir: Path, **fields: Any) -> MeshOptions:
    """Options of a test mesh (``prefixmesh up`` in-process): 2 sim workers behind E2, the
    edge and metrics service on free ports, WARNING logs; ``fields`` set any other
    ``MeshOptions`` field (``subject_prefix``, ``extra_env``, ...)."""
    from prefixmesh.services.up import MeshOptions

    defaults: dict[str, Any] = dict(workers=2, policy="e2", port=0, metrics_port=0,
                                    log_level="WARNING")
    return MeshOptions(nats_url=nats_url, redis_url=redis_url, log_dir=log_dir,
                       **{**defaults, **fields})


# --------------------------------------------------------------------------- tokens and routing


def span(base: int, n: int) -> list[int]:
    """``n`` consecutive token ids from ``base`` (distinct bases: distinct prompts)."""
    return list(range(base, base + n))


def toks(seed: int, n_blocks: int) -> list[int]:
    """``n_blocks`` full blocks of deterministic pseudo-random token ids."""
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n_blocks * BLOCK_SIZE)]


def route_input(rid: str, *parts: list[int], out: float = 0.0, exclude: Collection[str] = (),
                max_tokens: int = 64) -> RouteInput:
    """A routing request for the concatenation of ``parts``."""
    from prefixmesh.services.scheduler.policies.base import RouteInput

    tokens = [t for p in parts for t in p]
    return RouteInput(request_id=rid, block_hashes=block_hashes(tokens),
                      prompt_tokens=len(tokens), max_tokens=max_tokens,
                      predicted_output=out, exclude=frozenset(exclude))


@functools.cache
def shared_prefix_requests(n: int, docs: int = 4, doc_tokens: int = 2048) -> list:
    """``n`` simulator requests cycling over ``docs`` shared documents (8 output tokens)."""
    from prefixmesh.loadgen.workloads import WorkloadRequest

    out = []
    for i in range(n):
        d = i % docs
        doc = list(range(1000 * (d + 1) * 10, 1000 * (d + 1) * 10 + doc_tokens))
        out.append(WorkloadRequest(prompt=doc + [5 + i % 7] * 40, max_tokens=8,
                                   prefix_id=f"doc{d}", output_len=8))
    return out


def default_cost() -> CostModel:
    """The cost model of the default profile (loaded once)."""
    from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel

    return CostModel.load(DEFAULT_PROFILE)


def e2_policy(n: int = 4, cfg: PolicyConfig | None = None, capacity: int = 0) -> E2Policy:
    """An E2 policy with workers ``w0 .. w<n-1>`` of ``capacity`` tokens, at time 0."""
    from prefixmesh.services.scheduler.policies.base import PolicyConfig
    from prefixmesh.services.scheduler.policies.e2 import E2Policy

    p = E2Policy(cfg or PolicyConfig(), default_cost())
    for i in range(n):
        p.add_worker(f"w{i}", capacity, 0.0)
    return p


def request_ids(reqs: Sequence[EngineRequest]) -> list[str]:
    return [r.request_id for r in reqs]


# --------------------------------------------------------------------------- KV caches


@dataclass
class FakeView:
    """An EngineView (and CacheProbe) whose cache holds exactly the hashes in ``cached``
    (nothing, unless a test adds some), with settable capacity."""

    num_blocks: int = 1000
    num_free_blocks: int = 1000
    max_num_seqs: int = 256
    block_size: int = BLOCK_SIZE
    cached: set[int] = field(default_factory=set)

    def cached_prefix_tokens(self, block_hashes: Sequence[int]) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.cached:
                break
            n += 1
        return n * self.block_size

    def cache(self, req: EngineRequest) -> None:
        """``req``'s prompt blocks are cached now (its prefill finished)."""
        self.cached.update(req.block_hashes)


def replay_kv_events(events: Sequence[KvEvent]) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """What a consumer of KV events believes is cached: hash -> (parent hash, tokens).

    Fails if an event names a parent not known yet or removes a block that is not cached.
    """
    view: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            view.clear()
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert h in view, f"removal of block {h} that is not cached"
                del view[h]
        else:
            assert isinstance(ev, BlockStored)
            parent, bs = ev.parent_block_hash, ev.block_size
            for i, h in enumerate(ev.block_hashes):
                assert parent is None or parent in view, "parent must be known first"
                view[h] = (parent, tuple(ev.token_ids[i * bs : (i + 1) * bs]))
                parent = h
    return view


class SimDriver:
    """Runs an engine in virtual time, keeping every plan, output and KV event."""

    def __init__(self, engine: SimEngine, now: float = 0.0) -> None:
        self.engine = engine
        self.now = now
        self.plans: list[StepPlan] = []
        self.outputs: dict[str, list[StepOutput]] = {}
        self.events: list[KvEvent] = []

    def step(self) -> StepPlan | None:
        plan = self.engine.plan_step(self.now)
        if plan is None:
            return None
        self.plans.append(plan)
        self.now += plan.duration
        for out in self.engine.finish_step(plan, self.now):
            self.outputs.setdefault(out.request_id, []).append(out)
        self.events += self.engine.take_kv_events()
        return plan

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("engine did not drain")

    def step_until(self, done: Callable[[], bool]) -> None:
        """Step until ``done()``; the engine must still have work until then."""
        while not done():
            assert self.step() is not None, "engine drained first"

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] for t in out.new_token_ids]

    def finished(self) -> dict[str, EngineRequest]:
        """Requests that finished, by id, in the order they finished."""
        done = [(outs[-1].request.finish_time, rid, outs[-1].request)
                for rid, outs in self.outputs.items() if outs[-1].finished]
        return {rid: req for _, rid, req in sorted(done, key=lambda x: x[0])}

    def started(self) -> list[EngineRequest]:
        """Requests in the order they were first scheduled."""
        seen: dict[str, EngineRequest] = {}
        for plan in self.plans:
            for r in plan.requests:
                seen.setdefault(r.request_id, r)
        return list(seen.values())

    def removed(self) -> list[int]:
        """Hashes of every block reported evicted, in order."""
        return [h for ev in self.events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


# ------------------------------------------------------------------ tiny predictor artifact
# Trained in seconds on the real MiniLM encoder (tests/ml). The head learns to tell a few
# short-answer prompts (bin 0) from long-answer ones (last bin); the probe is fitted to
# random vectors of SmolLM2's hidden size (its readings only need to be distributions that
# move, for the refinement tests).

TINY_SHORT = ["Say yes or no: is water wet?", "What is 2+2?", "Reply with one word: hello.",
              "Is the sky blue? Answer yes or no.", "Give me a number between 1 and 9.",
              "Spell the word cat.", "True or false: fire is cold.", "Name one colour."]
TINY_LONG = ["Write a detailed 2000-word essay on the history of the Roman Empire.",
             "Write a long story about a dragon, with many chapters and characters.",
             "Explain in depth, step by step, how a compiler works, with code examples.",
             "Write a complete tutorial on machine learning covering every major algorithm.",
             "Draft a full business plan with market analysis, finances and strategy.",
             "Write a long poem of fifty stanzas about the sea and its sailors.",
             "Describe in great detail the plot of every Shakespeare play.",
             "Produce an exhaustive guide to cooking Italian food, with many recipes."]
TINY_HIDDEN = 576  # SmolLM2-135M's hidden size
TINY_LAYER = 8
TINY_TOKENS_PER_UPDATE = 2


def build_tiny_artifact(folder: Path, encoder: str = "full") -> PredictorArtifact:
    """Train and save the tiny artifact into ``folder``; returns it ([ml] extra)."""
    import numpy as np

    from prefixmesh.loadgen.predictor.fit import train_classifier
    from prefixmesh.services.predictor.encoder import PromptEncoder
    from prefixmesh.shared.trail.artifact import (
        HEAD_HIDDEN,
        PROBE_HIDDEN,
        PredictorArtifact,
        mlp,
    )
    from prefixmesh.shared.trail.lengths import LengthBins

    bins = LengthBins.make(8, 512)
    enc = PromptEncoder(threads=1, mode=encoder)
    x = enc.encode(TINY_SHORT + TINY_LONG)
    y = np.array([0] * len(TINY_SHORT) + [bins.num_bins - 1] * len(TINY_LONG))
    head = train_classifier(x, y, mlp(enc.dim, HEAD_HIDDEN, bins.num_bins), epochs=40, seed=0)
    rng = np.random.default_rng(0)
    hx = rng.normal(size=(256, TINY_HIDDEN)).astype(np.float32)
    hy = bins.bin_of(np.abs(hx[:, 0]) * 200)  # any rule: readings differ by input
    probe = train_classifier(hx, hy, mlp(TINY_HIDDEN, PROBE_HIDDEN, bins.num_bins), epochs=5,
                             seed=0)
    art = PredictorArtifact(bins, enc.dim, TINY_HIDDEN, TINY_LAYER,
                            float(TINY_TOKENS_PER_UPDATE), {"encoder": encoder, "seed": 0}, {},
                            head, probe)
    art.save(folder)
    return art


class HfHarness:
    """An HfEngine running its loop (tests/ml's ``h`` fixture), with what it emitted and
    published."""

    def __init__(self, engine: HfEngine) -> None:
        self.engine = engine
        self.text: dict[str, str] = {}
        self.done: dict[str, StepOutput] = {}
        self.logprobs: dict[str, list[TokenLogprob]] = {}
        self.events: list = []
        self.hidden: list[tuple[str, int, int]] = []

    async def emit(self, out: StepOutput, text: str,
                   logprobs: list[TokenLogprob] | None = None) -> None:
        self.text[out.request_id] = self.text.get(out.request_id, "") + text
        if logprobs:
            self.logprobs.setdefault(out.request_id, []).extend(logprobs)
        if out.finished:
            self.done[out.request_id] = out

    async def publish(self, events: list) -> None:
        self.events.extend(events)

    async def run(self, rid: str, ids: list[int], max_tokens: int = 8, **kw) -> StepOutput:
        """Run one request to its end (greedy unless ``kw`` says otherwise)."""
        from prefixmesh.services.worker.engine.types import EngineRequest

        req = EngineRequest(request_id=rid, prompt_token_ids=ids, max_tokens=max_tokens)
        self.engine.add(req, time.monotonic(),
                        SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **kw}))
        while rid not in self.done:
            await asyncio.sleep(0.01)
        return self.done[rid]
