"""``lowshare``: about a quarter of each prompt shared, the case where cache-aware routing is
known to lose to round robin.

Each request is one of ``prefixes`` (default 4) application preambles of 256 tokens,
then 768 tokens of its own, then the generation prompt: 25% of the prompt is shared. Both
are windows of the LooGLE documents' token stream (real text; preambles and own parts at
seeded offsets, as ``postrec`` takes its profiles), preambles picked uniformly (``zipf``
skews them). The output is a real ShareGPT reply's length (``sharegpt``'s requests, in
their order). A router that follows the shared head sends a whole preamble's traffic to
one GPU to save a quarter of its prefill, while three quarters of the work could spread.
"""

from __future__ import annotations

import random

from prefixmesh.loadgen.workloads import sharegpt
from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    next_turn,
    pick_prefixes,
    stable_seed,
)
from prefixmesh.loadgen.workloads.prefillonly import token_window
from prefixmesh.loadgen.workloads.sources import loogle_token_stream

SHARED_TOKENS = 256
OWN_TOKENS = 768
DEFAULT_PREFIXES = 4


def build(count: int, seed: int, opts: WorkloadOptions) -> list[WorkloadRequest]:
    """``count`` requests, a 256-token preamble of ``prefixes`` and 768 tokens of their own."""
    stream = loogle_token_stream()
    n = opts.prefixes or DEFAULT_PREFIXES
    rng = random.Random(stable_seed("lowshare", seed))
    preambles = [token_window(stream, rng.randrange(len(stream)), SHARED_TOKENS)
                 for _ in range(n)]
    tail = next_turn("assistant")
    replies = sharegpt.build(count, seed, WorkloadOptions())
    out = []
    for i, p in enumerate(pick_prefixes(rng, count, n, opts.zipf)):
        own = token_window(stream, rng.randrange(len(stream)), OWN_TOKENS)
        reply = replies[i].output_len
        out.append(WorkloadRequest(
            prompt=preambles[p] + own + tail, max_tokens=reply, prefix_id=f"app{p}",
            output_len=reply, tenant=opts.tenant, shared_tokens=SHARED_TOKENS))
    return out
