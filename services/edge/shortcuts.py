"""The hops the edge saves, and their settings: short text tokenized in place, short prompts
placed through the scheduler in one hop, routing requests batched (``pipeline.MeshClient``)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.shared.bus import BatchLimits
from prefixmesh.shared.text.tokenizer import TextTokenizer

# Seconds ``sched.place`` is left alone after it went unanswered (no scheduler serves it,
# as one from before it, or none answered in time): meanwhile requests take the two steps.
PLACE_BACKOFF_S = 10.0


@dataclass(frozen=True, slots=True)
class LocalTokenizer:
    """The edge's own copy of the tokenizer, for prompts of at most ``max_chars``
    characters (text, or all messages' contents): below a few hundred microseconds of
    encoding, a round trip to the tokenizer service costs more than the work."""

    tok: TextTokenizer
    max_chars: int


@dataclass(frozen=True, slots=True)
class Shortcuts:
    """The hops the edge saves (docs/architecture.md, "A request, file by file")."""

    # Routing requests asked in one turn of the event loop go together (max_batch 1: one
    # message each).
    route_batch: BatchLimits
    # Prompts of at most this many tokens go to the scheduler whole (``sched.place``): it
    # hands them to the chosen worker itself, one hop less than route, then submit; longer
    # ones are routed by their block hashes alone, in batches (0: always the two steps).
    # The hop matters where the request is short; the ids cost the scheduler little there.
    place_max_tokens: int
    # Short text prompts tokenized by the edge itself (None: all by the tokenizer service).
    local_tokenizer: LocalTokenizer | None = None
