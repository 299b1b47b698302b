"""TRAIL's limited preemption on the hf backend (real SmolLM2-135M on the CPU): a running
request preempted for a shorter one resumes from its cached blocks and writes exactly what
it would have written unpreempted; a refined prediction alone can make it the victim.
Behaviour only (order of completion, tokens, cached tokens), never wall-clock speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from tests.helpers import need  # noqa: E402

need("ml", "torch", "transformers")

from prefixmesh.services.worker.engine.hf_engine import HfEngine, HfEngineConfig  # noqa: E402
from prefixmesh.services.worker.engine.types import (  # noqa: E402
    EngineRequest,
    RequestStatus,
    StepOutput,
)
from prefixmesh.services.worker.local import make_local_policy  # noqa: E402
from prefixmesh.shared.blocks import BLOCK_SIZE  # noqa: E402
from prefixmesh.shared.text.tokenizer import TextTokenizer  # noqa: E402
from prefixmesh.shared.wire import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STORY = ("Write a long story about a lighthouse keeper who records every ship that passes "
         "the northern cape, the weather of each day and the cargo each ship carries.")


class Loop:
    """An hf engine (one sequence slot, ``sprpt_limited``) running its loop, recording the
    text each request got and the order requests finished in."""

    def __init__(self, engine: HfEngine) -> None:
        self.engine = engine
        self.text: dict[str, str] = {}
        self.finished: list[str] = []
        # Called with each finished request's id, inside the engine loop (before it goes on).
        self.on_finish: Callable[[str], None] = lambda rid: None

    async def emit(self, out: StepOutput, text: str = "", logprobs: object = None) -> None:
        self.text[out.request_id] = self.text.get(out.request_id, "") + text
        if out.finished:
            self.finished.append(out.request_id)
            self.on_finish(out.request_id)

    async def publish(self, events: list) -> None:
        return None

    def add(self, rid: str, ids: list[int], max_tokens: int, predicted: float) -> EngineRequest:
        req = EngineRequest(request_id=rid, prompt_token_ids=ids, max_tokens=max_tokens,
                            predicted_output=predicted)
        self.engine.add(req, time.monotonic(), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return req

    async def until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
async def loaded(tok: TextTokenizer) -> HfEngine:
    engine = HfEngine(HfEngineConfig(num_blocks=96), make_local_policy("fcfs"), tok)
    await asyncio.get_running_loop().run_in_executor(None, engine.load)
    return engine


@pytest.fixture
async def loop(loaded: HfEngine, tok: TextTokenizer) -> AsyncIterator[Loop]:
    # A fresh engine (empty cache and queue) around the loaded model for each test.
    engine = HfEngine(HfEngineConfig(num_blocks=96, max_num_seqs=1),
                      make_local_policy("sprpt_limited"), tok)
    engine.model, engine.pool = loaded.model, loaded.pool
    harness = Loop(engine)
    runner = asyncio.create_task(engine.run(harness.emit, harness.publish))
    try:
        yield harness
    finally:  # stop the loop, then its forward-pass thread
        runner.cancel()
        await asyncio.wait([runner])
        engine.close()
    assert runner.cancelled()  # the loop ran until stopped; it never failed


async def test_preempted_request_resumes_from_cache_with_the_same_output(
        loop: Loop, tok: TextTokenizer) -> None:
    eng = loop.engine
    ids = tok.encode(STORY)
    # The unpreempted greedy run, then a cold cache for the run that gets preempted.
    loop.add("ref", ids, max_tokens=60, predicted=60)
    await loop.until(lambda: "ref" in loop.finished)
    assert eng.reset_cache()
    # 60 tokens predicted: preemptable during its first floor(0.8 * 60) = 48 tokens. Past
    # 16 tokens out, at least one block of output is full and cached.
    long = loop.add("long", ids, max_tokens=60, predicted=60)
    await loop.until(lambda: long.num_output_tokens > BLOCK_SIZE)
    seen: dict[str, int] = {}

    def at_finish(rid: str) -> None:  # the short one done: the long one still waits
        if rid == "short":
            seen["status_waiting"] = long.status is RequestStatus.WAITING
            seen["known"] = long.num_tokens
            seen["resumed"] = long.num_resumed_cached_tokens

    loop.on_finish = at_finish
    loop.add("short", tok.encode("Say hello."), max_tokens=3, predicted=3)
    await loop.until(lambda: "long" in loop.finished)
    assert loop.finished == ["ref", "short", "long"]
    assert long.num_preemptions == 1 and eng.stats(time.monotonic()).preemptions == 1
    assert seen["status_waiting"] and seen["resumed"] == -1
    # Resumed from the prefix cache: every full block of the tokens it had computed (all
    # known tokens but the last sampled one); only the tail block was recomputed.
    assert BLOCK_SIZE < seen["known"] - len(ids) < 48
    assert long.num_resumed_cached_tokens == (seen["known"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert long.num_resumed_cached_tokens > len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert long.num_cached_tokens == 0  # its first admission found a cold cache
    # The same tokens and text as the unpreempted run.
    ref = loop.text["ref"]
    assert long.num_output_tokens == 60 and loop.text["long"] == ref and ref.strip()


async def test_a_refined_prediction_makes_a_running_request_the_victim(
        loop: Loop, tok: TextTokenizer) -> None:
    eng = loop.engine
    # Initially predicted at 10 tokens (preemptable for its first 8), so a waiting request
    # predicted at 20 does not preempt it ...
    long = loop.add("long", tok.encode(STORY), max_tokens=60, predicted=10)
    await loop.until(lambda: long.num_output_tokens >= 2)
    loop.add("short", tok.encode("Say hello."), max_tokens=20, predicted=20)
    await loop.until(lambda: long.num_output_tokens >= 4)
    assert long.num_preemptions == 0 and long.status is RequestStatus.RUNNING
    # ... until a reading (what the worker's TRAIL refiner passes on) says it has 200 left:
    # 60 - 4 at most (its budget), longer than the waiting one's 20.
    assert eng.update_prediction("long", 200.0)
    await loop.until(lambda: "long" in loop.finished)
    assert loop.finished == ["short", "long"]
    assert long.num_preemptions == 1 and long.num_output_tokens == 60
