"""PrefillOnly's workloads: long per-user profiles, one output token.

``postrec`` (post recommendation): 20 users x 50 posts; prompt = an instruction + the
user's profile (~N(14000, 3000) tokens) + a 150-token post + the question; one output
token (the yes/no score). ``creditver`` (credit verification): 60 users with 40k-60k-token
profiles; prompt = instruction + profile + a verification question; one output token.

No profile data exists in the data folder, so a profile is real text standing in for one:
a window of the LooGLE documents' token stream (end to end, wrapping), at an offset and
of a length fixed by the user and seed. Lengths are the quantiles of the target
distribution assigned to users in seeded order, so the user population has the target
mean and spread whatever its size. Posts are 150-token windows of the same stream.
Requests are spread equally over users (Zipf-popular with ``zipf``), in seeded order, so a
user's profile must stay cached between that user's requests - PrefillOnly's setting.
"""

from __future__ import annotations

import random
import statistics

from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    encode,
    numbered,
    pick_prefixes,
    stable_seed,
)
from prefixmesh.loadgen.workloads.sources import loogle_token_stream

POSTREC_INSTRUCTION = (
    "You are a recommendation system. Below is a user's profile and reading history, then a "
    "post. Decide whether the user will engage with the post; answer Yes or No.\n"
    "User profile:\n")
POSTREC_POST = "\nPost:\n"
POSTREC_QUESTION = "\nWill the user engage with this post? Answer:"
POSTREC_USERS = 20
POSTREC_PROFILE_MEAN = 14_000
POSTREC_PROFILE_STD = 3_000
POSTREC_PROFILE_MIN = 1_000
POST_TOKENS = 150

CREDIT_INSTRUCTION = (
    "You are a credit analyst. Below is an applicant's credit history. Answer the question "
    "with Yes or No.\nCredit history:\n")
# The question asked of a profile; a user's successive requests cycle through these.
CREDIT_QUESTIONS = (
    "\nShould this applicant's credit line be approved? Answer:",
    "\nIs this applicant likely to default within a year? Answer:",
    "\nDoes this history show identity or fraud risk? Answer:",
    "\nCan the applicant's stated income be verified from this history? Answer:",
)
CREDIT_USERS = 60
CREDIT_PROFILE_MIN = 40_000
CREDIT_PROFILE_MAX = 60_000


def token_window(stream: list[int], start: int, n: int) -> list[int]:
    """``n`` tokens of ``stream`` from ``start``, wrapping around its end."""
    out: list[int] = []
    while len(out) < n:
        piece = stream[start: start + n - len(out)]
        out.extend(piece)
        start = 0
    return out


def _profiles(kind: str, seed: int, lengths: list[int]) -> list[list[int]]:
    stream = loogle_token_stream()
    out = []
    for u, n in enumerate(lengths):
        start = random.Random(stable_seed(kind, "profile", seed, u)).randrange(len(stream))
        out.append(token_window(stream, start, n))
    return out


def build_postrec(count: int, seed: int, opts: WorkloadOptions) -> list[WorkloadRequest]:
    """``count`` post-recommendation requests (one output token) as token ids."""
    # Options: ``prefixes``, users (default 20); ``zipf``, user popularity (default equal).
    rng = random.Random(stable_seed("postrec", seed))
    users = opts.prefixes or POSTREC_USERS
    dist = statistics.NormalDist(POSTREC_PROFILE_MEAN, POSTREC_PROFILE_STD)
    lengths = [max(POSTREC_PROFILE_MIN, round(dist.inv_cdf((k + 0.5) / users)))
               for k in range(users)]
    rng.shuffle(lengths)
    profiles = _profiles("postrec", seed, lengths)
    head = encode(POSTREC_INSTRUCTION)
    post_open, question = encode(POSTREC_POST), encode(POSTREC_QUESTION)
    stream = loogle_token_stream()
    shared: dict[int, list[int]] = {}
    out = []
    for u, k in numbered(pick_prefixes(rng, count, users, opts.zipf)):
        if u not in shared:
            shared[u] = head + profiles[u] + post_open
        start = random.Random(stable_seed("postrec", "post", seed, u, k)).randrange(len(stream))
        post = token_window(stream, start, POST_TOKENS)
        out.append(WorkloadRequest(prompt=shared[u] + post + question, max_tokens=1,
                                   prefix_id=f"user{u}", output_len=1, tenant=opts.tenant,
                                   shared_tokens=len(shared[u])))
    return out


def build_creditver(count: int, seed: int, opts: WorkloadOptions) -> list[WorkloadRequest]:
    """``count`` credit-verification requests (one output token) as token ids."""
    # Options: ``prefixes``, users (default 60); ``zipf``, user popularity (default equal).
    rng = random.Random(stable_seed("creditver", seed))
    users = opts.prefixes or CREDIT_USERS
    span = CREDIT_PROFILE_MAX - CREDIT_PROFILE_MIN
    lengths = [CREDIT_PROFILE_MIN + round(span * (k + 0.5) / users) for k in range(users)]
    rng.shuffle(lengths)
    profiles = _profiles("creditver", seed, lengths)
    head = encode(CREDIT_INSTRUCTION)
    questions = [encode(q) for q in CREDIT_QUESTIONS]
    shared: dict[int, list[int]] = {}
    out = []
    for u, k in numbered(pick_prefixes(rng, count, users, opts.zipf)):
        if u not in shared:
            shared[u] = head + profiles[u]
        out.append(WorkloadRequest(
            prompt=shared[u] + questions[k % len(questions)], max_tokens=1,
            prefix_id=f"user{u}", output_len=1, tenant=opts.tenant,
            shared_tokens=len(shared[u])))
    return out
