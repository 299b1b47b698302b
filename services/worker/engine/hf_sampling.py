"""Choosing the next token from the hf engine's logits, and its log-probabilities.

Log-probabilities are vLLM's default ones (``raw_logprobs``): a log-softmax of the model's
logits over the whole vocabulary, before temperature, top-p or ``allowed_token_ids`` shape
the choice. So a token's reported log-probability is the model's, whatever the request's
sampling settings, and a prefill-only score (``/v1/score``) equals ``exp(logprob)`` of the
same token from an unrestricted completion of the same prompt.

- ``allowed_token_ids`` masks every other token out before sampling (greedy picks the most
  likely allowed token);
- ``logprobs: k`` reports the sampled token's log-probability and the ``k`` most likely
  tokens' (OpenAI's and vLLM's ``top_logprobs``);
- ``logprob_token_ids`` (set by ``/v1/score``) adds those tokens' log-probabilities to the
  top list whatever their rank;
- ``presence_penalty`` / ``frequency_penalty`` lower the logits of the tokens the request
  has generated so far before the choice (OpenAI's definition, as vLLM applies it); the
  reported log-probabilities stay the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixmesh.services.worker.engine.types import BadOption
from prefixmesh.shared.text.tokenizer import TextTokenizer
from prefixmesh.shared.wire import SamplingParams, TokenLogprob, TopLogprob


@dataclass(frozen=True, slots=True)
class Picked:
    """A chosen token and, when the request asked, log-probabilities (natural log)."""

    token: int
    # The chosen token's log-probability under the unrestricted distribution.
    logprob: float = 0.0
    # (token id, log-probability): the ``logprobs`` most likely first, most likely first,
    # then the ``logprob_token_ids`` not among them, in the order asked.
    top: tuple[tuple[int, float], ...] = ()


def wants_logprobs(s: SamplingParams) -> bool:
    """Whether the request asked for any log-probability."""
    return s.logprobs is not None or bool(s.logprob_token_ids)


def pick(logits: Any, s: SamplingParams, gen: Any, output: Sequence[int] = ()) -> Picked:
    """The next token from one position's logits (``[vocab]``), per ``s``; ``output``: the
    tokens the request generated before this one (for the penalties)."""
    import torch

    logits = logits.float()
    masked = shaped = penalized(logits, s, output)
    if s.allowed_token_ids:
        idx = torch.tensor(s.allowed_token_ids, dtype=torch.long)
        masked = torch.full_like(logits, float("-inf"))
        masked[idx] = shaped[idx]
    token = _sample(masked, s, gen)
    if not wants_logprobs(s):
        return Picked(token)
    lps = torch.log_softmax(logits, dim=-1)
    top: list[tuple[int, float]] = []
    if s.logprobs:
        values, ids = torch.topk(lps, min(s.logprobs, lps.shape[0]))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    seen = {t for t, _ in top}
    for t in s.logprob_token_ids:
        if t not in seen:
            seen.add(t)
            top.append((t, float(lps[t])))
    return Picked(token, float(lps[token]), tuple(top))


def penalized(logits: Any, s: SamplingParams, output: Sequence[int]) -> Any:
    """``logits`` less the presence and frequency penalties of the tokens in ``output``
    (``logits`` itself when there are none)."""
    import torch

    if not output or not (s.presence_penalty or s.frequency_penalty):
        return logits
    counts = torch.bincount(torch.tensor(output, dtype=torch.long),
                            minlength=logits.shape[0])[: logits.shape[0]].to(logits.dtype)
    return logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).to(
        logits.dtype)


def _sample(logits: Any, s: SamplingParams, gen: Any) -> int:
    import torch

    if s.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < s.top_p  # always keeps the top one
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def logprob_entry(p: Picked, tok: TextTokenizer) -> TokenLogprob:
    """The wire form of a picked token's log-probabilities (each token's own text, special
    tokens spelled out)."""
    def text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    return TokenLogprob(p.token, text(p.token), p.logprob,
                        [TopLogprob(t, text(t), lp) for t, lp in p.top])


def check_token_ids(s: SamplingParams, vocab_size: int) -> None:
    """BadOption naming the option when a token id is outside the model's vocabulary."""
    for name, ids in (("allowed_token_ids", s.allowed_token_ids),
                      ("logprob_token_ids", s.logprob_token_ids)):
        if any(not 0 <= t < vocab_size for t in ids):
            raise BadOption(name, f"{name}: token ids must be in [0, {vocab_size}) for this "
                            "model")
