"""``loogle``: questions on long documents (Preble Table 1: 23474/6105, 16/9.9 output, 91%).

Prompt = Preble's LooGLE format, "Please answer the question based on the long texts
below.", a real LooGLE document (12k-27k SmolLM2 tokens), then one of that document's real
questions. The instruction and document are the shared prefix; each document has 6-25
questions (the two files hold 9 distinct documents; questions of the one document in both
are merged). Output = the real answer's tokens, cut at 35 as Preble's generator does.

By default each document brings all of its questions until ``count`` is reached, and the
requests are shuffled. The data holds only 9 documents, so document ``p`` past them is a
variant: the same document and questions behind a header line naming the copy
("[document collection 1, item 3]"), which makes it a distinct prefix of the same length.
With ``prefixes`` or ``zipf`` set, requests are spread over that many documents (equally or
Zipf-popular), each cycling through its questions.
"""

from __future__ import annotations

import random

from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    encode,
    prefix_items,
    stable_seed,
    variant_tokens,
)
from prefixmesh.loadgen.workloads.sources import loogle_documents

LOOGLE_INSTRUCTION = "Please answer the question based on the long texts below. \n"
LOOGLE_QUESTION = "\nQuestion: "
LOOGLE_ANSWER = "\nAnswer: "
# Preble crops LooGLE answers at 35 tokens (short-dependency QA; 1.5 IQR above the median).
MAX_ANSWER_TOKENS = 35


def build(count: int, seed: int, opts: WorkloadOptions) -> list[WorkloadRequest]:
    """``count`` LooGLE requests as token ids."""
    # Options: ``prefixes``, documents (default: as many as ``count`` needs, all questions
    # of each; past 9 they are salted variants); ``zipf``, document popularity when set.
    docs = loogle_documents()
    n_real = len(docs)
    rng = random.Random(stable_seed("loogle", seed))
    order = list(range(n_real))
    rng.shuffle(order)
    instruction = encode(LOOGLE_INSTRUCTION)
    question = encode(LOOGLE_QUESTION)
    answer = encode(LOOGLE_ANSWER)
    shared: dict[int, list[int]] = {}

    def request(p: int, q: int) -> WorkloadRequest:
        doc = docs[order[p % n_real]]
        if p not in shared:
            shared[p] = instruction + variant_tokens("document", p, n_real) + doc.text + question
        pre = shared[p]
        out_len = min(doc.answer_tokens[q], MAX_ANSWER_TOKENS)
        return WorkloadRequest(prompt=pre + doc.questions[q] + answer, max_tokens=out_len,
                               prefix_id=f"doc{p}", output_len=out_len, tenant=opts.tenant,
                               shared_tokens=len(pre))

    return [request(p, q) for p, q in prefix_items(
        rng, count, lambda p: len(docs[order[p % n_real]].questions), opts.prefixes,
        opts.zipf, n_real)]
