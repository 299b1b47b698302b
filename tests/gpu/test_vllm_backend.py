"""The vllm backend on a real GPU: submit, stream, abort, cached tokens, KV events, logprobs.

Needs CUDA and the [gpu] extra; skipped elsewhere. The model is small and public
(``PM_VLLM_TEST_MODEL``, default facebook/opt-125m, vLLM's own test model) and must be in the
Hugging Face cache or downloadable.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("zmq")

from prefixmesh.services.worker.engine.types import EngineRequest, StepOutput  # noqa: E402
from prefixmesh.services.worker.engine.vllm_engine import VllmEngine, VllmEngineConfig  # noqa: E402
from prefixmesh.services.worker.local import make_local_policy  # noqa: E402
from prefixmesh.shared.blocks import block_hashes  # noqa: E402
from prefixmesh.shared.wire import BlockStored, KvEvent, SamplingParams  # noqa: E402
from tests.helpers import eventually  # noqa: E402

# vLLM and torch warn about their own internals; those are not ours to turn into errors.
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

MODEL = os.environ.get("PM_VLLM_TEST_MODEL", "facebook/opt-125m")
PROMPT = list(range(1000, 1064))  # 4 full blocks


class Sink:
    """Records what the engine emits and publishes."""

    def __init__(self) -> None:
        self.outputs: list[tuple[StepOutput, str]] = []
        self.kv: list[KvEvent] = []
        self.logprobs: dict[str, list] = {}

    async def emit(self, out: StepOutput, text: str, logprobs=None) -> None:
        self.outputs.append((out, text))
        self.logprobs.setdefault(out.request_id, []).extend(logprobs or [])

    async def publish(self, events: list[KvEvent]) -> None:
        self.kv.extend(events)

    def of(self, rid: str) -> list[StepOutput]:
        return [o for o, _ in self.outputs if o.request_id == rid]

    def done(self, rid: str) -> bool:
        return any(o.finished for o in self.of(rid))


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[tuple[VllmEngine, Sink]]:
    eng = VllmEngine(VllmEngineConfig(model=MODEL, gpu_memory_utilization=0.3,
                                      max_model_len=1024, enforce_eager=True),
                     make_local_policy("fcfs"))
    eng.start()
    sink = Sink()
    task = asyncio.create_task(eng.run(sink.emit, sink.publish))
    try:
        yield eng, sink
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        eng.close()


def _submit(eng: VllmEngine, rid: str, prompt: list[int], max_tokens: int) -> None:
    eng.add(EngineRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens),
            asyncio.get_running_loop().time(),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


async def test_streams_tokens_and_reports_cached_prefix(engine) -> None:
    eng, sink = engine
    assert eng.num_blocks > 0
    _submit(eng, "a", PROMPT, 8)
    await eventually(lambda: sink.done("a"), timeout=120)
    outs = sink.of("a")
    assert sum(len(o.new_token_ids) for o in outs) == 8
    assert outs[-1].finish_reason == "length" and outs[0].first_token
    # vLLM's BlockStored, re-hashed, names the prompt's prefixmesh blocks.
    want = block_hashes(PROMPT)
    await eventually(lambda: {h for e in sink.kv if isinstance(e, BlockStored)
                              for h in e.block_hashes} >= set(want[:3]), timeout=30)
    assert eng.cached_prefix_tokens(want) >= 48

    _submit(eng, "b", PROMPT, 4)
    await eventually(lambda: sink.done("b"), timeout=120)
    assert sink.of("b")[-1].num_cached_tokens >= 48
    stats = eng.stats(asyncio.get_running_loop().time())
    assert stats.total_blocks > 0 and stats.hit_ratio > 0


async def test_abort_stops_the_stream(engine) -> None:
    eng, sink = engine
    _submit(eng, "long", list(range(2000, 2032)), 900)
    await eventually(lambda: sink.of("long"), timeout=120)
    assert eng.abort("long", 0.0)
    await eventually(lambda: eng.num_running == 0, timeout=30)
    n = len(sink.of("long"))
    await asyncio.sleep(0.5)
    assert len(sink.of("long")) == n and not sink.done("long")


async def test_allowed_tokens_and_logprobs(engine) -> None:
    eng, sink = engine
    allowed = [PROMPT[5], PROMPT[9]]
    eng.add(EngineRequest(request_id="lp", prompt_token_ids=PROMPT, max_tokens=1),
            asyncio.get_running_loop().time(),
            SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, allowed_token_ids=allowed,
                           logprob_token_ids=allowed))
    await eventually(lambda: sink.done("lp"), timeout=120)
    (entry,) = sink.logprobs["lp"]
    assert entry.token_id in allowed and entry.logprob <= 0.0
    top = [t.logprob for t in entry.top[:3]]
    assert len(top) == 3 and top == sorted(top, reverse=True)
