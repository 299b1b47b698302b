"""What every workload shares: the request record, options, the tokenizer, prompt helpers
and the ways requests are spread over shared prefixes.

Workloads build prompts as lists of SmolLM2 token ids by concatenating pieces that were
tokenized once per process (see ``sources``). Joining separately tokenized pieces is not
byte-for-byte what tokenizing the joined text would give (BPE may merge across a seam);
seams are put at newlines and special tokens, where SmolLM2 almost never merges, and the
ids are valid either way, which is what an engine needs.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from itertools import accumulate

from prefixmesh.shared.text.tokenizer import IM_END, IM_START, TextTokenizer

# SmolLM2's vocabulary: 49,152 ids, the first 17 of them special tokens.
VOCAB_SIZE = 49_152
FIRST_REGULAR_ID = 17


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload."""

    # Token ids (SmolLM2, < VOCAB_SIZE) for token workloads; text for ``toolbench_text``.
    prompt: str | list[int]
    max_tokens: int
    # Which shared prefix this request uses (for statistics, tests and oracle routers).
    prefix_id: str
    # Output tokens to generate: the simulator generates exactly this many; the HTTP bench
    # sends max_tokens=output_len with ignore_eos. 0 for old text workloads (use max_tokens).
    output_len: int = 0
    tenant: str = ""
    # Leading prompt tokens shared with other requests by construction (system prompt, tool
    # instructions, document, video, agent history); the rest is this request's own.
    shared_tokens: int = 0
    # Multi-turn conversation, agent episode or parallel-sample group this request belongs to.
    session: str = ""
    # Offline batch job (BatchLLM) this request belongs to; "" for online requests.
    batch_id: str = ""


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """Options every workload accepts; each workload subclasses it with its own.

    ``None`` means "the workload's default", which each workload documents.
    """

    # Popularity skew of shared prefixes: prefix of rank k is chosen with weight 1/k**zipf.
    # None: the workload's own structure (toolbench: 1.1; others: each prefix gets its real
    # share of requests, e.g. all questions of a video).
    zipf: float | None = None
    # Distinct shared prefixes (tool sets, videos, documents, users, demo sets). More than
    # the data holds are made as salted variants (a per-variant header), so a simulator can
    # scale prefixes with the GPU count.
    prefixes: int | None = None
    # Tenant every request is tagged with ("" = the shared default tenant).
    tenant: str = ""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Names of the options this class accepts."""
        return tuple(f.name for f in fields(cls))


@functools.cache
def tokenizer() -> TextTokenizer:
    """SmolLM2's tokenizer, loaded once per process."""
    return TextTokenizer.load()


@functools.lru_cache(maxsize=4096)
def _encode_cached(text: str) -> tuple[int, ...]:
    return tuple(tokenizer().encode(text, add_special_tokens=False))


def encode(text: str) -> list[int]:
    """Token ids of a short fixed text (framing, headers), memoized per process."""
    return list(_encode_cached(text))


def encode_many(texts: Sequence[str]) -> list[list[int]]:
    """Token ids of many texts at once (the tokenizer's parallel batch path)."""
    return tokenizer().encode_batch(list(texts), add_special_tokens=False)


class LazyTokens:
    """Token ids of a fixed list of texts, each tokenized on first use and then kept.

    A build touches a fraction of a data set (100 of 535 tool sets, 120 of 1,570 videos);
    tokenizing only those keeps small builds fast, and each text is still tokenized at
    most once per process. ``prefetch`` batches the texts a build is about to use.
    """

    def __init__(self, texts: Sequence[str]) -> None:
        self._texts = list(texts)
        self._ids: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._texts)

    def __getitem__(self, i: int) -> list[int]:
        ids = self._ids.get(i)
        if ids is None:
            ids = self._ids[i] = tokenizer().encode(self._texts[i], add_special_tokens=False)
        return ids

    def text(self, i: int) -> str:
        """The text of item ``i``."""
        return self._texts[i]

    def prefetch(self, indices: Iterable[int]) -> None:
        """Tokenize the items among ``indices`` not tokenized yet, in one batch."""
        missing = sorted({i for i in indices if i not in self._ids})
        if missing:
            for i, ids in zip(missing, encode_many([self._texts[i] for i in missing])):
                self._ids[i] = ids


def chat_open(role: str) -> list[int]:
    """``<|im_start|>role\\n`` of SmolLM2's ChatML template."""
    return encode(f"{IM_START}{role}\n")


def chat_close() -> list[int]:
    """``<|im_end|>\\n``: the end of one ChatML turn."""
    return encode(f"{IM_END}\n")


def system_turn(text: str) -> list[int]:
    """``<|im_start|>system\\n`` + ``text``: a prompt's start, its system turn left open for
    what the workload adds to it (tool list, demonstrations) before ``next_turn("user")``."""
    return chat_open("system") + encode(text)


def next_turn(role: str) -> list[int]:
    """``<|im_end|>\\n<|im_start|>role\\n``: closes the open turn and opens ``role``'s;
    ``next_turn("assistant")`` ends a prompt with SmolLM2's generation prompt.

    The two are tokenized apart (each memoized), like every other piece (see above), so a
    seed's prompts keep the token ids they always had."""
    return chat_close() + chat_open(role)


def zipf_weights(n: int, s: float) -> list[float]:
    """Cumulative Zipf(s) weights over ranks 1..n (for ``random.choices(cum_weights=)``)."""
    return list(accumulate(1.0 / (k**s) for k in range(1, n + 1)))


def stable_seed(*parts: object) -> int:
    """A seed derived from ``parts`` that is the same in every process (no ``hash()``)."""
    return zlib.crc32("\x1f".join(map(str, parts)).encode())


def pick_prefixes(rng: random.Random, count: int, n: int, zipf: float | None) -> list[int]:
    """Prefix index (0..n-1) of each of ``count`` requests.

    With ``zipf`` set, each request draws rank k with weight 1/k**zipf (Preble's tool
    popularity); with None every prefix gets an equal share (count/n, the rest spread),
    in a seeded random order.
    """
    if n < 1:
        raise ValueError("need at least one prefix")
    if zipf is not None:
        cum = zipf_weights(n, zipf)
        return rng.choices(range(n), cum_weights=cum, k=count)
    out = [i % n for i in range(count)]
    rng.shuffle(out)
    return out


def variant_header(kind: str, variant: int, real: int) -> str:
    """Header that makes variant ``variant`` of ``real`` real prefixes a distinct prefix.

    Variants below ``real`` are the data as it is (""); past it, a short line naming the
    copy is put at the start of the shared part, so its blocks hash differently.
    """
    if variant < real:
        return ""
    return f"[{kind} collection {variant // real}, item {variant % real}]\n"


def variant_tokens(kind: str, variant: int, real: int) -> list[int]:
    """Token ids of ``variant_header`` (none for a real prefix), to put before the shared
    part of a prefix."""
    header = variant_header(kind, variant, real)
    return encode(header) if header else []


def numbered(picks: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Each pick with how often the same value came before it (0 the first time).

    A workload cycles through a prefix's own items (questions, queries) by this number, or
    seeds the next one with it (posts), so a prefix's successive requests ask different
    things whichever prefixes the other requests draw."""
    seen: dict[int, int] = {}
    for p in picks:
        k = seen.get(p, 0)
        seen[p] = k + 1
        yield p, k


def prefix_items(rng: random.Random, count: int, items: Callable[[int], int],
                 prefixes: int | None, zipf: float | None, real: int
                 ) -> list[tuple[int, int]]:
    """(prefix, item) of ``count`` requests to prefixes that own a list of items (a video's
    or a document's questions); ``items(p)`` is how many prefix ``p`` owns.

    With ``prefixes`` and ``zipf`` both None, prefixes 0, 1, 2, ... each bring all of their
    items in turn until ``count`` is reached and the pairs are shuffled: every prefix gets
    its real share, as in the data. Otherwise ``pick_prefixes`` spreads the requests over
    ``prefixes`` (default ``real``) prefixes and each cycles through its items.
    """
    picks: list[tuple[int, int]] = []
    if prefixes is None and zipf is None:
        p = 0
        while len(picks) < count:
            picks.extend((p, k) for k in range(min(items(p), count - len(picks))))
            p += 1
        rng.shuffle(picks)
        return picks
    return [(p, k % items(p))
            for p, k in numbered(pick_prefixes(rng, count, prefixes or real, zipf))]


def rescale_lengths(real: Sequence[int], mean: float, std: float, lo: int = 1,
                    hi: int | None = None) -> list[int]:
    """Map lengths onto Normal(mean, std) by rank (quantile mapping), clipped to [lo, hi].

    Keeps the real order (a longer real answer stays longer, which a length predictor
    needs) while matching a target mean and spread. Ties keep their input order.
    """
    n = len(real)
    if n == 0:
        return []
    dist = statistics.NormalDist(mean, std)
    order = sorted(range(n), key=lambda i: real[i])
    out = [0] * n
    for rank, i in enumerate(order):
        v = round(dist.inv_cdf((rank + 0.5) / n))
        out[i] = max(lo, v if hi is None else min(hi, v))
    return out


def lognormal_quantiles(real: Sequence[int], mean: float, std: float, lo: int = 1,
                        hi: int | None = None) -> list[int]:
    """As ``rescale_lengths`` but onto a lognormal with that mean and std (heavy tail)."""
    n = len(real)
    if n == 0:
        return []
    sigma2 = math.log1p((std / mean) ** 2)
    dist = statistics.NormalDist(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
    order = sorted(range(n), key=lambda i: real[i])
    out = [0] * n
    for rank, i in enumerate(order):
        v = round(math.exp(dist.inv_cdf((rank + 0.5) / n)))
        out[i] = max(lo, v if hi is None else min(hi, v))
    return out


def interleave_sessions(rng: random.Random, sessions: Sequence[Sequence[WorkloadRequest]],
                        concurrency: int) -> list[WorkloadRequest]:
    """Merge per-session request chains: ``concurrency`` sessions active at once, the next
    request drawn from a random active one, so each session's steps stay in order."""
    pending = list(sessions)
    pending.reverse()
    active: list[list[WorkloadRequest]] = []
    out: list[WorkloadRequest] = []
    while pending or active:
        while pending and len(active) < concurrency:
            active.append(list(reversed(pending.pop())))
        i = rng.randrange(len(active))
        out.append(active[i].pop())
        if not active[i]:
            active[i] = active[-1]
            active.pop()
    return out
