"""``toolbench``: tool-use agents (Preble Table 1: prompt 1835/742, output 43/16, 85% shared).

Prompt = ToolBench's own system prompt + one tool set's function list (the real
``available_tools`` of a ToolBench query, as JSON, with ToolBench's Finish function) + a
real user query, in SmolLM2's chat format. The system prompt and tool list are the shared
prefix; tool-set popularity is Zipf(1.1) over ``prefixes`` tool sets (Preble's ToolBench
setup). A tool set's own queries come first; a hot tool set with more requests than it has
queries takes the other rows' queries, in a seeded order, so prompts rarely repeat exactly.

Output length: the real answer (the final answer the run gave, else the steps it wrote) in
SmolLM2 tokens, rank-mapped onto Normal(43, 16): the real answers (89/141 tokens, a third of
them empty) are not the next-step outputs Preble measured, so their order is kept and their
scale replaced.
"""

from __future__ import annotations

import json
import random

from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    encode,
    next_turn,
    numbered,
    pick_prefixes,
    rescale_lengths,
    stable_seed,
    system_turn,
    variant_tokens,
    zipf_weights,
)
from prefixmesh.loadgen.workloads.sources import toolbench_data, toolbench_rows

TOOLBENCH_SYSTEM = (
    "You are AutoGPT, you can use many tools (functions) to do the following task. "
    "First I will give you the task description, and your task start. At each step, you "
    "need to give your thought to analyze the status now and what to do next, with a "
    "function call to actually execute your step. After the call, you will get the call "
    "result, and you are now in a new state. Then you will analyze your status now, then "
    "decide what to do next. After many (thought, call) pairs, you finally perform the task, "
    "then you can give your final answer. Remember: the state change is irreversible, you "
    "can't go back to one of the former states; if you want to restart the task, say \"I "
    "give up and restart\". All the thoughts are short, at most 5 sentences. You can do more "
    "than one try, so if your plan is to continuously try some conditions, you can do one "
    "of the conditions per try. Let's begin!\n\nTask description: You should use functions "
    "to help handle the real time user queries.\n"
)
TOOLBENCH_APIS = "Specifically, you have access to the following APIs: "
TOOLBENCH_BEGIN = "\nBegin!\n"
# Output length of ToolBench requests (Preble Table 1: mean 43, std 16 tokens).
TOOLBENCH_OUTPUT_MEAN = 43
TOOLBENCH_OUTPUT_STD = 16
# Upper clip of output lengths (mean + 5 std): a rank map onto a normal has thin tails anyway.
TOOLBENCH_OUTPUT_MAX = TOOLBENCH_OUTPUT_MEAN + 5 * TOOLBENCH_OUTPUT_STD
DEFAULT_ZIPF = 1.1
# Distinct tool sets by default. Preble's ToolBench runs used ~150 tool prefixes per GPU;
# 100 keeps a 1,000-request build's sharing near Table 1 and fits one GPU's KV cache.
DEFAULT_TOOL_SETS = 100


def build(count: int, seed: int, opts: WorkloadOptions) -> list[WorkloadRequest]:
    # Options: ``zipf``, tool-set popularity (default 1.1); ``prefixes``, tool sets
    # (default 100; the data holds 535, more are salted variants).
    """``count`` ToolBench requests as token ids."""
    data = toolbench_data()
    rng = random.Random(stable_seed("toolbench", seed))
    n_real = len(data.tool_sets)
    n_prefixes = opts.prefixes or DEFAULT_TOOL_SETS
    order = list(range(n_real))
    rng.shuffle(order)  # which real tool sets are the hot ones depends on the seed
    outputs = rescale_lengths(data.answer_tokens, TOOLBENCH_OUTPUT_MEAN, TOOLBENCH_OUTPUT_STD,
                              hi=TOOLBENCH_OUTPUT_MAX)
    rows_of_set: dict[int, list[int]] = {}
    for row, s in enumerate(data.row_tool_set):
        rows_of_set.setdefault(s, []).append(row)
    zipf = DEFAULT_ZIPF if opts.zipf is None else opts.zipf
    chosen = pick_prefixes(rng, count, n_prefixes, zipf)
    data.tool_sets.prefetch(order[p % n_real] for p in set(chosen))

    head = system_turn(TOOLBENCH_SYSTEM)
    apis = encode(TOOLBENCH_APIS)
    tail = encode(TOOLBENCH_BEGIN) + next_turn("assistant")
    user = next_turn("user")
    shared: dict[int, list[int]] = {}
    query_order: dict[int, list[int]] = {}
    out: list[WorkloadRequest] = []
    for p, k in numbered(chosen):
        real = order[p % n_real]
        if p not in shared:
            shared[p] = (head + variant_tokens("tool", p, n_real) + apis
                         + data.tool_sets[real] + user)
            own = rows_of_set[real]
            rest = [r for r in range(len(data.queries)) if data.row_tool_set[r] != real]
            random.Random(stable_seed("toolbench-queries", seed, p)).shuffle(rest)
            query_order[p] = own + rest
        rows = query_order[p]
        row = rows[k % len(rows)]
        prefix = shared[p]
        out.append(WorkloadRequest(
            prompt=prefix + data.queries[row] + tail, max_tokens=outputs[row],
            prefix_id=f"tool{p}", output_len=outputs[row], tenant=opts.tenant,
            shared_tokens=len(prefix)))
    return out


def toolbench_text(count: int, seed: int = 0, tools: int = 24, zipf: float = 1.1
                   ) -> list[WorkloadRequest]:
    """``count`` ToolBench requests as text over ``tools`` distinct tool sets, Zipf(``zipf``)
    popular (the demo's workload: the HTTP API tokenizes them)."""
    rng = random.Random(seed)
    rows = toolbench_rows()
    tool_sets: list[str] = []
    seen: set[str] = set()
    for row in rows:
        spec = json.dumps(row["available_tools"], indent=1, ensure_ascii=False)
        if spec not in seen:
            seen.add(spec)
            tool_sets.append(spec)
        if len(tool_sets) == tools:
            break
    queries = [row["query"] for row in rows]
    cum = zipf_weights(len(tool_sets), zipf)
    out = []
    for _ in range(count):
        t = rng.choices(range(len(tool_sets)), cum_weights=cum)[0]
        q = rng.choice(queries)
        prompt = f"{TOOLBENCH_SYSTEM}\nAvailable tools:\n{tool_sets[t]}\n\nUser query: {q}\n"
        max_tokens = max(1, round(rng.gauss(TOOLBENCH_OUTPUT_MEAN, TOOLBENCH_OUTPUT_STD)))
        out.append(WorkloadRequest(prompt=prompt, max_tokens=max_tokens, prefix_id=f"tool{t}",
                                   output_len=max_tokens))
    return out
