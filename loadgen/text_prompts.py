"""Token-id workload prompts as text, for endpoints that take text only.

sglang-router (0.3.2) rejects a ``/v1/completions`` prompt given as token ids, and its
cache_aware policy matches prefixes on characters. To give every contender of a comparison
the very same requests, prompts are decoded once with the workload's tokenizer (SmolLM2's,
special tokens kept), and every server tokenizes that text with the same tokenizer. The
round trip need not return the original ids, but every contender sees the same text and
therefore the same tokens, and shared prefixes stay shared (only the token at a piece
boundary can merge differently).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prefixmesh.loadgen.workloads import WorkloadRequest
from prefixmesh.shared.text.tokenizer import TextTokenizer


def as_text(requests: Sequence[WorkloadRequest],
            tok: TextTokenizer | None = None) -> list[WorkloadRequest]:
    """The requests with token-id prompts replaced by their decoded text."""
    tok = tok or TextTokenizer.load()
    out = []
    for r in requests:
        if isinstance(r.prompt, list):
            r = dataclasses.replace(r, prompt=tok.decode(r.prompt, skip_special_tokens=False))
        out.append(r)
    return out
