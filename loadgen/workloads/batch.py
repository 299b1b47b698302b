"""``batch``: an offline batch job with global prefix sharing (BatchLLM).

A batch of prompts in which groups share a document: prompt = an instruction + a document
+ a question about it. Documents are ``doc_tokens``-token sections of the real LooGLE
documents; the questions are that document's real LooGLE questions (so they concern the
text, if not always that section), and outputs are their real answers (cut at 35 tokens,
as ``loogle``). Each document has a group of 4-16 prompts (seeded), the sharing degree
BatchLLM's scheduler exploits. Every request carries a ``batch_id`` (``jobs`` jobs, groups
dealt to them in turn), and the list is shuffled: finding the groups again is the batch
scheduler's job, not the submitter's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    encode,
    stable_seed,
    variant_tokens,
)
from prefixmesh.loadgen.workloads.sources import loogle_documents

BATCH_INSTRUCTION = "Read the document and answer the question that follows.\n\n"
BATCH_QUESTION = "\n\nQuestion: "
BATCH_ANSWER = "\nAnswer: "
MIN_GROUP = 4
MAX_GROUP = 16
MAX_ANSWER_TOKENS = 35


@dataclass(frozen=True, slots=True)
class BatchOptions(WorkloadOptions):
    """``prefixes``: shared documents (default: as many as ``count`` needs at 4-16 prompts
    each); ``doc_tokens``: document length; ``jobs``: batch jobs the groups are dealt to.
    ``zipf`` does not apply (group sizes are the skew)."""

    doc_tokens: int = 2000  # tokens
    jobs: int = 1


def build(count: int, seed: int, opts: BatchOptions) -> list[WorkloadRequest]:
    """``count`` batch prompts as token ids, in shuffled order."""
    if opts.doc_tokens < 16 or opts.jobs < 1:
        raise ValueError("doc_tokens must be at least 16 and jobs at least 1")
    docs = loogle_documents()
    # (document index, start token) of every full section of every document.
    sections = [(d, start) for d, doc in enumerate(docs)
                for start in range(0, len(doc.text) - opts.doc_tokens + 1, opts.doc_tokens)]
    rng = random.Random(stable_seed("batch", seed))
    rng.shuffle(sections)
    n_real = len(sections)
    if opts.prefixes is not None:
        # Exactly ``prefixes`` groups, count spread evenly (questions repeat if need be).
        sizes = [count // opts.prefixes + (1 if g < count % opts.prefixes else 0)
                 for g in range(opts.prefixes)]
    else:
        # 4-16 prompts per document, at most one per real question of it.
        sizes = []
        while sum(sizes) < count:
            n_q = len(docs[sections[len(sizes) % n_real][0]].questions)
            sizes.append(min(rng.randint(MIN_GROUP, MAX_GROUP), n_q))
    instruction = encode(BATCH_INSTRUCTION)
    question, answer = encode(BATCH_QUESTION), encode(BATCH_ANSWER)
    out: list[WorkloadRequest] = []
    for g, size in enumerate(sizes):
        d, start = sections[g % n_real]
        doc = docs[d]
        pre = (instruction + variant_tokens("section", g, n_real)
               + doc.text[start: start + opts.doc_tokens] + question)
        q_order = list(range(len(doc.questions)))
        random.Random(stable_seed("batch-questions", seed, g)).shuffle(q_order)
        for k in range(min(size, count - len(out))):
            q = q_order[k % len(q_order)]
            n_out = min(doc.answer_tokens[q], MAX_ANSWER_TOKENS)
            out.append(WorkloadRequest(
                prompt=pre + doc.questions[q] + answer, max_tokens=n_out, prefix_id=f"sec{g}",
                output_len=n_out, tenant=opts.tenant, shared_tokens=len(pre),
                batch_id=f"batch{seed}-{g % opts.jobs}"))
    rng.shuffle(out)
    return out
