"""The hf engine's log-probabilities, ``allowed_token_ids`` and prefill-only path on the real
SmolLM2-135M-Instruct ([ml] extra), checked against a plain transformers forward pass of
the same prompt (no cache, no chunks): values within float tolerance, never speed."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers import HfHarness, eventually, need  # noqa: E402

need("ml", "torch", "transformers")

import torch  # noqa: E402

from prefixmesh.services.worker.engine.types import BadOption, EngineRequest  # noqa: E402
from prefixmesh.shared.text.tokenizer import TextTokenizer  # noqa: E402
from prefixmesh.shared.wire import ChatMessage, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Log-probabilities (nats) of the engine's paths and of the reference pass differ by float
# rounding only (other chunkings of the same sums): ~1e-5 seen.
TOL = 2e-4
DOC = ("The harbour master wrote down every boat that entered the bay, its flag and its "
       "cargo, and whether the sea was calm. ") * 12


def yes_no(tok: TextTokenizer, question: str) -> list[int]:
    return tok.encode_chat([ChatMessage(role="system", content=DOC),
                            ChatMessage(role="user", content=question + " Answer Yes or No.")],
                           add_generation_prompt=True)


def reference(h: HfHarness, ids: list[int]) -> torch.Tensor:
    """Log-softmax of the next token after ``ids``: one plain forward pass."""
    with torch.inference_mode():
        logits = h.engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def one_token(tok: TextTokenizer, text: str) -> int:
    (tid,) = tok.encode(text, add_special_tokens=False)
    return tid


async def test_logprobs_are_the_models_whatever_the_sampling(h: HfHarness,
                                                             tok: TextTokenizer) -> None:
    ids = yes_no(tok, "Did the harbour master write down the boats?")
    ref = reference(h, ids)
    out = await h.run("free", ids, max_tokens=3, logprobs=5, ignore_eos=True)
    first = h.logprobs["free"][0]
    assert len(h.logprobs["free"]) == 3 and out.request.output_token_ids[0] == first.token_id
    values, top_ids = torch.topk(ref, 5)
    assert [t.token_id for t in first.top] == top_ids.tolist()  # greedy: the top one
    assert [t.logprob for t in first.top] == pytest.approx(values.tolist(), abs=TOL)
    assert first.logprob == pytest.approx(float(ref[first.token_id]), abs=TOL)
    assert first.token == tok.decode([first.token_id], skip_special_tokens=False)
    # Restricted to two candidates: the pick is one of them, and its log-probability is
    # still the unrestricted one (vLLM's raw logprobs), not renormalised over the two.
    yes, no = one_token(tok, "Yes"), one_token(tok, "No")
    await h.run("only", ids, max_tokens=1, logprobs=0, allowed_token_ids=[yes, no],
                logprob_token_ids=[yes, no])
    entry = h.logprobs["only"][0]
    best = yes if ref[yes] >= ref[no] else no
    assert entry.token_id == best and entry.logprob == pytest.approx(float(ref[best]), abs=TOL)
    assert {t.token_id: t.logprob for t in entry.top} == pytest.approx(
        {yes: float(ref[yes]), no: float(ref[no])}, abs=TOL)


async def test_prefill_only_pass_equals_the_plain_forward(h: HfHarness,
                                                          tok: TextTokenizer) -> None:
    eng = h.engine
    assert eng.hybrid is not None
    passes: list[int] = []
    run = eng.hybrid.run

    def spy(ids, start, prefix, store, layer):
        # Suffix discarding: the request holds no DynamicCache while its pass runs.
        assert all(s.past is None for s in eng._running if s.prefill_only)
        passes.append(len(ids))
        return run(ids, start, prefix, store, layer)

    eng.hybrid.run = spy  # type: ignore[method-assign]
    ids = yes_no(tok, "Was the sea calm?")
    ref = reference(h, ids)
    cold = await h.run("cold", ids, max_tokens=1, logprobs=5)
    assert passes == [len(ids)] and cold.num_cached_tokens == 0
    entry = h.logprobs["cold"][0]
    assert entry.logprob == pytest.approx(float(ref[entry.token_id]), abs=TOL)
    assert [t.logprob for t in entry.top] == pytest.approx(torch.topk(ref, 5).values.tolist(),
                                                           abs=TOL)
    # What the pass keeps: its full prompt blocks, as prefix blocks, and no reference.
    assert eng.cache.num_cached == len(ids) // 16 and eng.num_free_blocks == eng.num_blocks
    assert h.hidden[-1] == ("cold", 1, 576)
    # A second pass reuses those blocks (gathered a layer at a time) and agrees.
    computed = eng.prefill_tokens_computed
    warm = await h.run("warm", ids, max_tokens=1, logprobs=5)
    cached = (len(ids) - 1) // 16 * 16
    assert warm.num_cached_tokens == cached and passes[-1] == len(ids) - cached
    assert eng.prefill_tokens_computed - computed == len(ids) - cached
    assert h.logprobs["warm"][0].logprob == pytest.approx(entry.logprob, abs=TOL)
    # The ordinary path (two tokens) reads the same blocks: the KV the pass wrote is the
    # model's.
    await h.run("decode", ids, max_tokens=2, logprobs=5)
    assert h.done["decode"].num_cached_tokens == cached
    assert h.logprobs["decode"][0].logprob == pytest.approx(entry.logprob, abs=TOL)


async def test_a_waiting_pass_reuses_the_prefix_a_pass_before_it_wrote(
        h: HfHarness, tok: TextTokenizer) -> None:
    eng = h.engine
    a = tok.encode("Profile of reader A: sailing, tides, harbours and old maps. " * 30)
    b = tok.encode("Profile of reader B: gardens, bees and the weather. " * 20)
    posts = [tok.encode(f" Post {i}: a new chart of the bay. Engage? Answer:") for i in (1, 2)]
    # Admitted together (fcfs takes all three at once); each takes its cached prefix at its
    # own pass, so the second one of reader A finds the first one's blocks.
    for rid, ids in (("a1", a + posts[0]), ("b1", b + posts[0]), ("a2", a + posts[1])):
        eng.add(EngineRequest(request_id=rid, prompt_token_ids=ids, max_tokens=1),
                time.monotonic(), SamplingParams(max_tokens=1, temperature=0.0))
    await eventually(lambda: len(h.done) == 3, timeout=120)
    assert h.done["a1"].num_cached_tokens == h.done["b1"].num_cached_tokens == 0
    assert h.done["a2"].num_cached_tokens == len(a) // 16 * 16


async def test_prompt_longer_than_the_pool_still_scores(h: HfHarness, tok: TextTokenizer) -> None:
    eng = h.engine
    ids = tok.encode("Tide tables for the northern coast, hour by hour. " * 160)[:2000]
    assert len(ids) // 16 > eng.num_blocks  # 125 full blocks, a pool of 96
    ref = reference(h, ids)
    await h.run("long", ids, max_tokens=1, logprobs=1)
    entry = h.logprobs["long"][0]
    assert entry.logprob == pytest.approx(float(ref[entry.token_id]), abs=TOL)
    # Its chain stopped where the pool was full; nothing beyond it was kept.
    assert eng.cache.num_cached == eng.num_blocks and eng.num_free_blocks == eng.num_blocks


async def test_abort_mid_pass_frees_the_blocks_it_was_writing(h: HfHarness,
                                                              tok: TextTokenizer) -> None:
    eng = h.engine
    ids = tok.encode("Notes on the lighthouse lamp and its keeper. " * 80)[:800]
    req = EngineRequest(request_id="gone", prompt_token_ids=ids, max_tokens=1)
    eng.add(req, time.monotonic(), SamplingParams(max_tokens=1, temperature=0.0))
    await eventually(lambda: bool(eng._running), timeout=10)
    assert eng._running[0].pending  # its blocks, not yet registered
    assert eng.abort("gone", time.monotonic())
    await asyncio.sleep(0)  # the pass in flight finishes in the executor and is dropped
    await h.run("next", ids[:40], max_tokens=1)  # the loop has moved past it
    assert "gone" not in h.done and eng.cache.num_cached == 40 // 16
    assert eng.num_free_blocks == eng.num_blocks


def test_token_ids_outside_the_vocabulary_are_refused(h: HfHarness) -> None:
    req = EngineRequest(request_id="bad", prompt_token_ids=[1, 2, 3], max_tokens=1)
    with pytest.raises(BadOption) as info:
        h.engine.add(req, 0.0, SamplingParams(max_tokens=1, allowed_token_ids=[10**7]))
    assert info.value.param == "allowed_token_ids"
