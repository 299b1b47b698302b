"""Deterministic pseudo log-probabilities for the simulated engine (pure, no I/O).

The sim backend has no model, so it cannot know real probabilities. What it offers instead
is shaped like a model's output and stable, so that clients, tests and the scoring path can
be exercised end to end:

- every output token gets a log-probability in [-LOGPROB_SPAN, 0), a function of the
  request's sampling key and the token's position only;
- the ``top`` alternatives are other pool tokens with strictly lower log-probabilities, the
  sampled token first (as a model sampled at temperature 0 would report);
- over a restricted candidate set (``allowed_token_ids``: prefill-only scoring), pseudo
  logits are a function of the prompt and the candidate id, normalised with a softmax, so
  the probabilities sum to 1 and the same prompt always scores the same.

None of these numbers mean anything about the text; docs/api.md says so.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

from prefixmesh.shared.wire import TokenLogprob, TopLogprob

# Pseudo log-probabilities of sampled tokens fall in [-LOGPROB_SPAN, 0) (nats).
LOGPROB_SPAN = 3.0
# Each alternative in ``top`` is at least this much less likely than the one before (nats).
ALT_STEP = 0.5
# Pseudo logits of scoring candidates fall in [0, LOGIT_SPAN) before the softmax.
LOGIT_SPAN = 4.0


def _unit(*parts: int | str) -> float:
    """A deterministic number in [0, 1) from the parts."""
    key = "|".join(str(p) for p in parts).encode()
    return zlib.crc32(key) / 2**32


def prompt_key(token_ids: Sequence[int]) -> int:
    """A stable 32-bit digest of a prompt."""
    return zlib.crc32(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))


def token_logprobs(key: str, position: int, token_id: int, pool: Sequence[int], k: int,
                   token_text: Callable[[int], str]) -> TokenLogprob:
    """The pseudo log-probability of output token ``position`` and ``k`` alternatives."""
    lp = -LOGPROB_SPAN * _unit(key, position) - 1e-3
    top = [TopLogprob(token_id, token_text(token_id), lp)] if k > 0 else []
    start = int(_unit(key, position, "alt") * len(pool))
    j = 0
    while len(top) < k and j < len(pool):
        alt = pool[(start + j) % len(pool)]
        j += 1
        if alt != token_id:
            top.append(TopLogprob(alt, token_text(alt), lp - ALT_STEP * len(top)))
    return TokenLogprob(token_id, token_text(token_id), lp, top)


def candidate_logprobs(prompt: Sequence[int], candidates: Sequence[int]) -> list[float]:
    """Softmax-normalised pseudo log-probabilities of ``candidates`` as the next token."""
    pk = prompt_key(prompt)
    logits = [LOGIT_SPAN * _unit(pk, c) for c in candidates]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def scored_token(prompt: Sequence[int], candidates: Sequence[int], k: int,
                 token_text: Callable[[int], str]) -> TokenLogprob:
    """The most likely candidate as the generated token, with up to ``k`` candidates (all of
    them when ``k`` is larger) in ``top``, most likely first."""
    lps = candidate_logprobs(prompt, candidates)
    ranked = sorted(zip(candidates, lps, strict=True), key=lambda p: -p[1])
    best, best_lp = ranked[0]
    top = [TopLogprob(t, token_text(t), lp) for t, lp in ranked[:max(k, 1)]]
    return TokenLogprob(best, token_text(best), best_lp, top)
