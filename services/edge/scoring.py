"""``POST /v1/score``: prefill-only scoring (PrefillOnly), e.g. P(Yes) vs P(No) after a prompt.

A score request is one output token restricted to the candidates' token ids, with every
candidate's log-probability reported (``logprob_token_ids``): all the engine does is the
prefill (plus one sampling step), which is what the ``srjf_calibrated`` local policy
schedules best and what the hf engine runs on its prefill-only path (hybrid prefilling,
suffix KV discarding: docs/design.md section 7). A candidate's probability is the model's
probability of that token at the next position, over the whole vocabulary: ``exp`` of the
log-probability an unrestricted ``/v1/completions`` call (``max_tokens: 1``, ``logprobs``)
reports for it. The sim backend has no model: its pseudo-probabilities are normalised over
the candidates, and the response says ``"simulated": true``.

Each candidate must be one token (tokenized without special tokens); longer candidates are
refused with 400 rather than scored by their first token, which would silently mislead.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import msgspec

from prefixmesh.services.edge.completion import run_choice, token_prompts
from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.pipeline import MeshClient
from prefixmesh.shared.openai.choices import check_context, fan_out
from prefixmesh.shared.openai.responses import ChoiceResult, Usage
from prefixmesh.shared.openai.schema import (
    MAX_ALLOWED_TOKENS,
    ApiError,
    ParsedRequest,
    allowed_tokens,
    check_choices,
    check_model,
    decode_body,
    parse_prompts,
)
from prefixmesh.shared.wire import SamplingParams


class _ScoreBody(msgspec.Struct):
    model: str
    prompt: Any = None
    # Continuations to score, each one token: strings, or token ids directly.
    candidates: list[str] | None = None
    candidate_token_ids: list[int] | None = None
    user: str | None = None


class ScoreRequest(msgspec.Struct):
    """A validated score request (candidates not yet tokenized)."""

    model: str
    prompts: list[str | list[int]]
    candidates: list[str] | None
    candidate_token_ids: list[int] | None


def parse_score(body: bytes, models: tuple[str, ...], vocab_size: int) -> ScoreRequest:
    """Validate a ``/v1/score`` body."""
    b = decode_body(body, _ScoreBody)
    check_model(b.model, models)
    prompts = parse_prompts(b.prompt, vocab_size)
    check_choices(1, len(prompts))
    if (b.candidates is None) == (b.candidate_token_ids is None):
        raise ApiError(400, "give exactly one of candidates or candidate_token_ids",
                       param="candidates")
    if b.candidates is not None:
        if not 1 <= len(b.candidates) <= MAX_ALLOWED_TOKENS or not all(b.candidates):
            raise ApiError(400, f"candidates takes 1 to {MAX_ALLOWED_TOKENS} non-empty strings",
                           param="candidates")
    else:
        allowed_tokens(b.candidate_token_ids, vocab_size)  # raises on bad ids
    return ScoreRequest(b.model, prompts, b.candidates, b.candidate_token_ids)


async def _candidate_ids(mesh: MeshClient, rid: str, req: ScoreRequest) -> list[int]:
    if req.candidate_token_ids is not None:
        return list(req.candidate_token_ids)
    ids = []
    for text in req.candidates or []:
        toks = await mesh.tokenize(rid, text=text, add_special_tokens=False)
        if len(toks) != 1:
            raise ApiError(400, f"candidate {text!r} is {len(toks)} tokens; each candidate "
                           "must be exactly one token", param="candidates")
        ids.append(toks[0])
    return ids


async def score(mesh: MeshClient, cfg: EdgeConfig, req: ScoreRequest, rid: str,
                tenant: str) -> dict[str, Any]:
    """Run a score request on the mesh; returns the response body."""
    ids = await _candidate_ids(mesh, rid, req)
    unique = list(dict.fromkeys(ids))
    sampling = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, seed=None, stop=[],
                              ignore_eos=True, logprobs=len(unique), allowed_token_ids=unique,
                              logprob_token_ids=unique)
    parsed = ParsedRequest(kind="completion", model=req.model, prompts=req.prompts,
                           sampling=sampling)
    prompts = await token_prompts(mesh, rid, parsed)
    check_context(prompts, 1, cfg.context_lengths[req.model])
    tasks = [asyncio.create_task(run_choice(mesh, c, parsed, tenant, None), name=c.request_id)
             for c in fan_out(rid, prompts, 1)]
    try:
        results: list[ChoiceResult] = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    usage = Usage()
    data = []
    labels = req.candidates if req.candidates is not None else [None] * len(ids)
    for r in results:
        if r.error or not r.logprobs:
            raise ApiError(503, f"scoring failed: {r.error or 'no logprobs from the worker'}",
                           type="service_unavailable", code="worker_error",
                           headers={"Retry-After": "1"})
        usage.add(r, True)
        by_id = {t.token_id: t.logprob for t in r.logprobs[0].top}
        scores = []
        for label, tid in zip(labels, ids, strict=True):
            lp = by_id.get(tid)
            # None: the backend did not report it (vllm: outside its 20 most likely).
            scores.append({"candidate": label, "token_id": tid, "logprob": lp,
                           "probability": math.exp(lp) if lp is not None else None})
        data.append({"index": r.index, "object": "score", "scores": scores})
    return {"id": rid, "object": "list", "created": int(time.time()), "model": req.model,
            "simulated": any(r.simulated for r in results),
            "data": sorted(data, key=lambda d: d["index"]), "usage": usage.body()}
