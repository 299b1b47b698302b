"""Training data of the TRAIL predictors: ShareGPT first exchanges and SmolLM2 hidden states.

A sample is one conversation's first exchange: the first human message as a SmolLM2 chat
prompt, and the first gpt reply in SmolLM2 tokens plus its end token. Conversations are
numbered as the ``sharegpt`` workload numbers them (``conv{i}`` is its ``prefix_id``), so
predictions made here can be attached to that workload's requests in the simulator.

Replies come from ShareGPT (``replies="sharegpt"``, the default) or from SmolLM2 itself
(``replies="model"``, ``model_replies``): the serving model samples its own reply to each
prompt, as TRAIL collects its data, so the length label is what the served model would
generate and the hidden states are those it had while generating it (teacher-forcing a
sampled reply reproduces them). Generated replies are cached as JSON chunks too.

Hidden states come from teacher forcing: the prompt (truncated) and the reply go through
SmolLM2 in one forward pass and the states of several layers are read at every
``stride``-th reply position. That pass is the expensive part (about a second per
conversation on one CPU thread), so it can be cached: chunks of samples go to ``.npz``
files named by a hash of what they hold, and a later run with the same samples and settings
reads them back instead of recomputing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Sample filters: "none" keeps every first exchange; "vllm" keeps those the ``sharegpt``
# workload keeps (vLLM benchmark_serving's ShareGPT filter: prompt and reply at least 4
# tokens, prompt at most 1,024, together at most 2,048).
SAMPLE_FILTERS = ("none", "vllm")
# SmolLM2 layers whose states every cached chunk holds (the probe's candidate layers): a
# run that asks for any of them reads the same files; others are added to the chunk.
CACHED_LAYERS = (4, 8, 12, 16, 20, 24, 28)
# Samples per cached chunk of hidden states.
CACHE_CHUNK = 25
# Where the replies come from: ShareGPT's gpt turn, or SmolLM2's own sampled reply.
REPLY_SOURCES = ("sharegpt", "model")
# SmolLM2's end tokens: the tokenizer's eos (<|im_end|> = 2) and <|endoftext|> (0).
END_IDS = (2, 0)
# Hidden states are cached as float16 (the probe standardises its inputs; half precision
# loses nothing it can use and halves the cache).
CACHE_DTYPE = np.float16


@dataclass
class Sample:
    """One conversation's first exchange."""

    conv: int  # index in the sharegpt workload's conversation list (prefix_id "conv{i}")
    prompt: str
    prompt_ids: list[int]  # chat prompt in SmolLM2 tokens (truncated)
    reply_ids: list[int]  # reply + end token in SmolLM2 tokens (untruncated)
    source: str = "sharegpt"  # of the reply: "sharegpt", or "model" (SmolLM2's own)

    @property
    def length(self) -> int:
        return len(self.reply_ids)


def first_exchanges() -> list[tuple[str, str]]:
    """(human, gpt) first turns of ShareGPT, in the order the sharegpt workload numbers them."""
    from prefixmesh.loadgen.workloads.sources import sharegpt_conversations

    return [(c[0][1], c[1][1]) for c in sharegpt_conversations()
            if len(c) >= 2 and c[0][0] == "human" and c[1][0] == "gpt"
            and c[0][1].strip() and c[1][1].strip()]


def load_samples(n: int, seed: int, max_prompt: int, tok, sample_filter: str = "none"
                 ) -> list[Sample]:
    """The first ``n`` first exchanges passing ``sample_filter``, in a seeded random order
    (the same seed gives the same list, so train and test splits are slices of it)."""
    from prefixmesh.shared.wire import ChatMessage

    if sample_filter not in SAMPLE_FILTERS:
        raise ValueError(f"sample filter must be one of {SAMPLE_FILTERS}")
    from prefixmesh.loadgen.workloads.sharegpt import (
        MAX_PROMPT_TOKENS,
        MAX_TOTAL_TOKENS,
        MIN_TOKENS,
    )

    pairs = first_exchanges()
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    out: list[Sample] = []
    for i in order:
        if len(out) == n:
            break
        prompt, reply = pairs[i]
        ids = tok.encode_chat([ChatMessage(role="user", content=prompt)])
        reply_ids = tok.encode(reply, add_special_tokens=False)
        if sample_filter == "vllm" and (
                len(ids) < MIN_TOKENS or len(reply_ids) < MIN_TOKENS
                or len(ids) > MAX_PROMPT_TOKENS or len(ids) + len(reply_ids) > MAX_TOTAL_TOKENS):
            continue
        if len(ids) > max_prompt:  # keep the head and the generation prompt's tail
            ids = ids[: max_prompt - 8] + ids[-8:]
        out.append(Sample(i, prompt, ids, reply_ids + [tok.eos_token_id]))
    if len(out) < n:
        raise ValueError(f"only {len(out)} conversations pass the {sample_filter!r} filter")
    return out


def reply_steps(s: Sample, stride: int, max_reply: int) -> list[int]:
    """Decode steps ``t`` (reply tokens already generated) at which the probe is read."""
    return list(range(0, min(s.length, max_reply), stride))


def _chunk_key(chunk: list[Sample], layers: list[int], stride: int, max_reply: int) -> str:
    spec = {"convs": [s.conv for s in chunk], "prompt": [len(s.prompt_ids) for s in chunk],
            "reply": [s.length for s in chunk], "layers": layers, "stride": stride,
            "max_reply": max_reply, "model": "smollm2-135m-instruct"}
    if any(s.source != "sharegpt" for s in chunk):  # same lengths, other tokens
        spec["reply_ids"] = hashlib.sha256(
            json.dumps([s.reply_ids for s in chunk]).encode()).hexdigest()
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def model_replies(samples: list[Sample], max_new: int, temperature: float, seed: int,
                  threads: int, cache: Path | None = None) -> list[Sample]:
    """The samples with SmolLM2's own replies: sampled at ``temperature`` (top-p 0.95), at
    most ``max_new`` tokens; a reply that ends keeps its end token, one cut at ``max_new``
    has none (its label is the cap). Chunk ``c`` is generated as one left-padded batch under
    seed ``seed + c``, so a chunk's replies do not depend on which other chunks are run."""
    out: list[Sample] = []
    model = None
    t0 = time.perf_counter()
    for c0 in range(0, len(samples), CACHE_CHUNK):
        chunk = samples[c0:c0 + CACHE_CHUNK]
        spec = {"convs": [s.conv for s in chunk], "prompt": [s.prompt_ids for s in chunk],
                "max_new": max_new, "temperature": temperature, "seed": seed + c0,
                "model": "smollm2-135m-instruct"}
        key = hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]
        path = None if cache is None else cache / f"replies-{key}.json"
        if path is not None and path.exists():
            replies = json.loads(path.read_text())
        else:
            if model is None:
                from prefixmesh.shared.smollm2 import load_model

                model = load_model("", threads)
            replies = _sample_replies(model, chunk, max_new, temperature, seed + c0)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(replies))
                tmp.replace(path)
        out.extend(Sample(s.conv, s.prompt, s.prompt_ids, r, "model")
                   for s, r in zip(chunk, replies, strict=True))
        log.info("model replies %d/%d (%.0f s)", len(out), len(samples),
                 time.perf_counter() - t0)
    return out


def _sample_replies(model, chunk: list[Sample], max_new: int, temperature: float,
                    seed: int) -> list[list[int]]:
    """One left-padded batch of ``chunk``'s prompts through ``model.generate``, seeded."""
    import torch

    width = max(len(s.prompt_ids) for s in chunk)
    pad = END_IDS[0]
    ids = torch.tensor([[pad] * (width - len(s.prompt_ids)) + s.prompt_ids for s in chunk])
    mask = torch.tensor([[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids)
                         for s in chunk])
    torch.manual_seed(seed)
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                             temperature=temperature, top_p=0.95, max_new_tokens=max_new,
                             eos_token_id=list(END_IDS), pad_token_id=pad)
    return [_cut_at_end(g) for g in gen[:, width:].tolist()]


def _cut_at_end(tokens: list[int]) -> list[int]:
    """A generated row up to and including its first end token (all of it if none)."""
    for i, t in enumerate(tokens):
        if t in END_IDS:
            return tokens[: i + 1]
    return tokens


def collect_hidden(samples: list[Sample], layers: list[int], stride: int, max_reply: int,
                   threads: int, cache: Path | None = None
                   ) -> tuple[dict[int, np.ndarray], np.ndarray, np.ndarray]:
    """Teacher-force each reply through SmolLM2: per layer ``[rows, hidden]`` states at the
    sampled steps, with each row's step and sample index (into ``samples``)."""
    per_layer: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    stored = sorted(set(layers) | set(CACHED_LAYERS))
    steps, owner = [], []
    model = None
    t0 = time.perf_counter()
    for c0 in range(0, len(samples), CACHE_CHUNK):
        chunk = samples[c0:c0 + CACHE_CHUNK]
        path = None if cache is None else (
            cache / f"hidden-{_chunk_key(chunk, stored, stride, max_reply)}.npz")
        if path is not None and path.exists():
            with np.load(path) as z:
                got = {k: z[f"layer{k}"] for k in layers}
                c_steps, c_owner = z["steps"], z["owner"]
        else:
            if model is None:
                from prefixmesh.shared.smollm2 import load_model

                model = load_model("", threads)
            got, c_steps, c_owner = _teacher_force(model, chunk, stored, stride, max_reply)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp.npz")
                # Any: mypy matches a ** dict of arrays against savez's allow_pickle: bool.
                layer_arrays: dict[str, Any] = {f"layer{k}": v for k, v in got.items()}
                np.savez(tmp, steps=c_steps, owner=c_owner, **layer_arrays)
                tmp.replace(path)
        for k in layers:
            per_layer[k].append(got[k])
        steps.append(c_steps)
        owner.append(c_owner + c0)
        log.info("hidden states %d/%d (%.0f s)", min(c0 + CACHE_CHUNK, len(samples)),
                 len(samples), time.perf_counter() - t0)
    return ({k: np.concatenate(v) for k, v in per_layer.items()},
            np.concatenate(steps), np.concatenate(owner))


def _teacher_force(model, chunk: list[Sample], layers: list[int], stride: int,
                   max_reply: int) -> tuple[dict[int, np.ndarray], np.ndarray, np.ndarray]:
    """One forward pass per sample; states at the reply's sampled steps."""
    import torch

    per_layer: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    steps, owner = [], []
    for i, s in enumerate(chunk):
        ts = reply_steps(s, stride, max_reply)
        fed = s.prompt_ids + s.reply_ids[: max(ts) if ts else 0]
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([fed]), output_hidden_states=True,
                        logits_to_keep=1)
        # The state at the position of token t-1 is what the model has when it samples
        # reply token t (t = 0: the generation prompt's last token).
        pos = [len(s.prompt_ids) - 1 + t for t in ts]
        for k in layers:
            per_layer[k].append(out.hidden_states[k][0, pos].numpy().astype(CACHE_DTYPE))
        steps.extend(ts)
        owner.extend([i] * len(ts))
    return ({k: np.concatenate(v) for k, v in per_layer.items()},
            np.asarray(steps, dtype=np.int32), np.asarray(owner, dtype=np.int32))
