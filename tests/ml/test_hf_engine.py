"""The hf backend on the real SmolLM2-135M-Instruct ([ml] extra): prefix KV reuse, KV events,
hidden states, abort. Behaviour only (tokens computed, cached tokens), never wall-clock speed."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers import HfHarness, need  # noqa: E402

need("ml", "torch", "transformers")

from prefixmesh.services.worker.engine.types import EngineRequest  # noqa: E402
from prefixmesh.shared.text.tokenizer import TextTokenizer  # noqa: E402
from prefixmesh.shared.wire import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    ChatMessage,
    SamplingParams,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DOC = ("The lighthouse keeper kept a log of every ship that passed the northern cape. "
       "Each entry named the ship, its flag, its cargo and the weather at the time. ") * 14


def chat(tok: TextTokenizer, question: str) -> list[int]:
    return tok.encode_chat([ChatMessage(role="system", content=DOC),
                            ChatMessage(role="user", content=question)],
                           add_generation_prompt=True)


async def test_shared_prefix_is_reused_not_recomputed(h: HfHarness, tok: TextTokenizer) -> None:
    a, b = chat(tok, "Who kept the log?"), chat(tok, "What did each entry name?")
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common > 300
    first = await h.run("a", a)
    computed_a = h.engine.prefill_tokens_computed
    assert first.num_cached_tokens == 0 and computed_a == len(a)
    second = await h.run("b", b)
    cached = second.num_cached_tokens
    assert cached == common // 16 * 16  # every full block of the shared prefix
    assert h.engine.prefill_tokens_computed - computed_a == len(b) - cached
    assert h.text["a"].strip() and h.text["b"].strip()  # real text came out
    # BlockStored chains in vLLM's schema: parents first, 16 tokens a block.
    stored = [e for e in h.events if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].block_size == 16
    assert stored[0].token_ids[:16] == a[:16]
    assert set(second.request.block_hashes[: cached // 16]) <= {
        x for e in stored for x in e.block_hashes}


async def test_reused_kv_gives_the_same_tokens(h: HfHarness, tok: TextTokenizer) -> None:
    ids = chat(tok, "Name one thing the log recorded.")
    cold = await h.run("cold", ids, max_tokens=12)
    warm = await h.run("warm", ids, max_tokens=12)
    assert warm.num_cached_tokens == (len(ids) - 1) // 16 * 16
    assert warm.request.output_token_ids == cold.request.output_token_ids
    assert h.text["warm"] == h.text["cold"]


async def test_hidden_states_each_step(h: HfHarness, tok: TextTokenizer) -> None:
    out = await h.run("hs", tok.encode("Once upon a time"), max_tokens=5, ignore_eos=True)
    assert out.finish_reason == "length"
    steps = [(k, dim) for rid, k, dim in h.hidden if rid == "hs"]
    assert steps == [(k, 576) for k in range(1, 6)]


async def test_abort_frees_blocks_and_eviction_reports_removed(h: HfHarness,
                                                                tok: TextTokenizer) -> None:
    eng = h.engine
    req = EngineRequest(request_id="x", prompt_token_ids=chat(tok, "Abort me."), max_tokens=50)
    eng.add(req, time.monotonic(), SamplingParams(max_tokens=50, temperature=0.0))
    while req.num_output_tokens < 2:
        await asyncio.sleep(0.01)
    assert eng.abort("x", time.monotonic())
    assert eng.num_free_blocks == eng.num_blocks  # all cached, none referenced
    # A different long prompt overflows the 96-block pool: LRU blocks are evicted.
    other = tok.encode("Weather report for the coast. " * 200)[:1500]
    await h.run("y", other, max_tokens=1)
    assert any(isinstance(e, BlockRemoved) for e in h.events)
    assert eng.cache.num_cached <= eng.num_blocks


