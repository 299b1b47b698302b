"""The hf backend's token choice (``hf_sampling``): penalties on the tokens generated so
far, on hand-made logits and on the real SmolLM2-135M-Instruct ([ml] extra)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tests.helpers import HfHarness, need  # noqa: E402

need("ml", "torch", "transformers")

import torch  # noqa: E402

from prefixmesh.services.worker.engine.hf_sampling import pick  # noqa: E402
from prefixmesh.shared.text.tokenizer import TextTokenizer  # noqa: E402
from prefixmesh.shared.wire import ChatMessage, SamplingParams  # noqa: E402

LOGITS = torch.tensor([0.0, 3.0, 2.9, 1.0, 0.0])


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_presence_and_frequency_penalties_lower_the_tokens_already_generated() -> None:
    gen = torch.Generator().manual_seed(0)
    assert pick(LOGITS, greedy(), gen, [1]).token == 1  # no penalty: the most likely
    assert pick(LOGITS, greedy(presence_penalty=0.5), gen, [1]).token == 2
    assert pick(LOGITS, greedy(presence_penalty=0.5), gen, []).token == 1  # nothing yet
    # Frequency counts occurrences: once 0.08 is not enough to pass 2.9, twice it is.
    assert pick(LOGITS, greedy(frequency_penalty=0.08), gen, [1]).token == 1
    assert pick(LOGITS, greedy(frequency_penalty=0.08), gen, [1, 1]).token == 2
    # A negative penalty favours repeating.
    assert pick(LOGITS, greedy(presence_penalty=-0.5), gen, [2]).token == 2
    # Within allowed_token_ids the penalised logits decide.
    allowed = greedy(presence_penalty=2.5, allowed_token_ids=[1, 3])
    assert pick(LOGITS, allowed, gen, [1]).token == 3
    # The reported log-probability is the model's, not the penalised one.
    got = pick(LOGITS, greedy(presence_penalty=0.5, logprobs=1), gen, [1])
    assert got.token == 2
    assert got.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[2]))
    assert got.top[0][0] == 1 and math.isclose(got.top[0][1],
                                               float(torch.log_softmax(LOGITS, -1)[1]),
                                               rel_tol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_frequency_penalty_makes_greedy_decoding_repeat_itself_less(
        h: HfHarness, tok: TextTokenizer) -> None:
    ids = tok.encode_chat([ChatMessage(role="user", content="Count: one one one one one")],
                          add_generation_prompt=True)
    plain = await h.run("plain", ids, max_tokens=24)
    penalised = await h.run("penalised", ids, max_tokens=24, frequency_penalty=2.0)
    first, second = plain.request.output_token_ids, penalised.request.output_token_ids
    most = Counter(first).most_common(1)[0]
    assert most[1] >= 3  # greedy repeats a token here
    assert Counter(second)[most[0]] < most[1] and second != first
