"""``prefixmesh predictor train|eval``: TRAIL's predictors on ShareGPT, with SmolLM2 lengths.

train: seeded split of ShareGPT first turns (prompt = first human message as a chat prompt,
length = the first gpt reply in SmolLM2 tokens, plus its end token); MiniLM embeddings of
the prompts train the head; the reply is teacher-forced through SmolLM2 after the prompt
and the hidden states of several layers at every ``stride``-th reply position train one
probe per layer; the layer with the lowest validation MAE (20% of train) wins and its probe
is retrained on all of train. Saves the artifact folder (models.PredictorArtifact).

eval: on the held-out split, MAE (tokens) of the head's initial prediction, and per decode
step of TRAIL's refined prediction (probe + Bayesian update seeded with the head's
distribution) against the true remaining length; plus the head's latency on batches of 32
prompts. Writes ``{"mae_bert", "mae_refined", "mae_by_step": [...], "test_requests", ...}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.predictor.trail import (
    BIN_SPACINGS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_BINS,
    LengthBins,
    Smoother,
    expected_length,
)

log = logging.getLogger(__name__)

DEFAULT_LAYERS = "4,8,12,16,20,24,28"
STEP_BUCKET = 64  # tokens per mae_by_step bucket
LATENCY_BATCH = 32
LATENCY_REPEATS = 20


@dataclass
class Sample:
    """One conversation's first exchange."""

    prompt: str
    prompt_ids: list[int]  # chat prompt in SmolLM2 tokens (truncated)
    reply_ids: list[int]  # reply + end token in SmolLM2 tokens (untruncated)

    @property
    def length(self) -> int:
        return len(self.reply_ids)


def load_samples(n: int, seed: int, max_prompt: int, tok) -> list[Sample]:
    """``n`` first exchanges of ShareGPT in a seeded random order."""
    from loadgen.workloads.sources import sharegpt_conversations
    from shared.messages import ChatMessage

    convs = [c for c in sharegpt_conversations()
             if len(c) >= 2 and c[0][0] == "human" and c[1][0] == "gpt"
             and c[0][1].strip() and c[1][1].strip()]
    random.Random(seed).shuffle(convs)
    out = []
    for conv in convs[:n]:
        prompt, reply = conv[0][1], conv[1][1]
        ids = tok.encode_chat([ChatMessage(role="user", content=prompt)])
        if len(ids) > max_prompt:  # keep the head and the generation prompt's tail
            ids = ids[: max_prompt - 8] + ids[-8:]
        out.append(Sample(prompt, ids, tok.encode(reply, add_special_tokens=False)
                          + [tok.eos_token_id]))
    return out


def reply_steps(s: Sample, stride: int, max_reply: int) -> list[int]:
    """Decode steps ``t`` (reply tokens already generated) at which the probe is read."""
    return list(range(0, min(s.length, max_reply), stride))


def collect_hidden(samples: list[Sample], layers: list[int], stride: int, max_reply: int,
                   threads: int) -> tuple[dict[int, np.ndarray], np.ndarray, np.ndarray]:
    """Teacher-force each reply through SmolLM2: per layer ``[rows, hidden]`` states at the
    sampled steps, with each row's step and sample index."""
    import torch

    from services.worker.engine.hf_model import load_model

    model = load_model("", threads)
    per_layer: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    steps, owner = [], []
    t0 = time.perf_counter()
    for i, s in enumerate(samples):
        ts = reply_steps(s, stride, max_reply)
        fed = s.prompt_ids + s.reply_ids[: max(ts) if ts else 0]
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([fed]), output_hidden_states=True,
                        logits_to_keep=1)
        pos = [len(s.prompt_ids) - 1 + t for t in ts]
        for k in layers:
            per_layer[k].append(out.hidden_states[k][0, pos].numpy())
        steps.extend(ts)
        owner.extend([i] * len(ts))
        if (i + 1) % 25 == 0:
            log.info("teacher-forced %d/%d (%.0f s)", i + 1, len(samples),
                     time.perf_counter() - t0)
    return ({k: np.concatenate(v) for k, v in per_layer.items()},
            np.asarray(steps), np.asarray(owner))


def _mae_expected(model, x: np.ndarray, target: np.ndarray, bins: LengthBins) -> float:
    from services.predictor.models import predict_proba

    return float(np.mean(np.abs(expected_length(predict_proba(model, x), bins) - target)))


def train(args: argparse.Namespace) -> dict:
    """Build and save an artifact; returns its config."""
    from services.predictor.models import (
        HEAD_HIDDEN,
        PROBE_HIDDEN,
        PredictorArtifact,
        PromptEncoder,
        mlp,
        train_classifier,
    )
    from services.tokenizer.text import TextTokenizer

    tok = TextTokenizer.load()
    bins = LengthBins.make(args.bins, args.max_tokens, args.spacing)
    samples = load_samples(args.train + args.test, args.seed, args.max_prompt, tok)
    train_s = samples[: args.train]  # the test split is samples[args.train:]
    lengths = np.array([s.length for s in train_s])
    enc = PromptEncoder(threads=args.threads, mode=args.encoder)
    emb = enc.encode_many([s.prompt for s in train_s])
    head = train_classifier(emb, bins.bin_of(lengths), mlp(enc.dim, HEAD_HIDDEN, bins.num_bins),
                            args.epochs, args.seed)
    layers = [int(x) for x in args.layers.split(",")]
    hidden, steps, owner = collect_hidden(train_s, layers, args.stride, args.max_reply,
                                          args.threads)
    remaining = lengths[owner] - steps
    fit = owner < int(0.8 * len(train_s))  # validation: the last 20% of requests
    val_mae = {}
    for k in layers:
        x = hidden[k]
        probe = train_classifier(x[fit], bins.bin_of(remaining[fit]),
                                 mlp(x.shape[1], PROBE_HIDDEN, bins.num_bins),
                                 args.epochs, args.seed)
        val_mae[k] = _mae_expected(probe, x[~fit], remaining[~fit], bins)
        log.info("layer %d: validation MAE %.1f tokens", k, val_mae[k])
    best = min(val_mae, key=val_mae.get)
    probe = train_classifier(hidden[best], bins.bin_of(remaining),
                             mlp(hidden[best].shape[1], PROBE_HIDDEN, bins.num_bins),
                             args.epochs, args.seed)
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "out", "verb", "json")}
    art = PredictorArtifact(bins, enc.dim, hidden[best].shape[1], best, float(args.stride),
                            cfg, {"layer_val_mae": {str(k): round(v, 2)
                                                    for k, v in val_mae.items()}},
                            head, probe)
    art.save(Path(args.out))
    return art.describe()


def evaluate(args: argparse.Namespace) -> dict:
    """Score an artifact on its held-out split (same seed and sizes as training)."""
    from services.predictor.models import PredictorArtifact, PromptEncoder, predict_proba
    from services.tokenizer.text import TextTokenizer

    art = PredictorArtifact.load(Path(args.model))
    tc = art.train_config
    tok = TextTokenizer.load()
    n_train, n_test = tc["train"], args.test or tc["test"]
    samples = load_samples(n_train + n_test, tc["seed"], tc["max_prompt"], tok)[n_train:]
    bins, stride = art.bins, int(art.tokens_per_update)
    enc = PromptEncoder(threads=tc["threads"], mode=tc["encoder"])
    initial = predict_proba(art.head, enc.encode_many([s.prompt for s in samples]))
    lengths = np.array([s.length for s in samples])
    init_pred = expected_length(initial, bins)
    hidden, steps, owner = collect_hidden(samples, [art.layer], stride, tc["max_reply"],
                                          tc["threads"])
    probs = predict_proba(art.probe, hidden[art.layer])
    rows = []  # (step, |bert|, |refined|, |probe alone|)
    for i, s in enumerate(samples):
        sm = Smoother(bins, initial[i], stride)
        for j in np.flatnonzero(owner == i):  # in step order
            t, true = steps[j], s.length - steps[j]
            refined = sm.update(probs[j])
            rows.append((t, abs(max(init_pred[i] - t, 0.0) - true), abs(refined - true),
                         abs(expected_length(probs[j], bins) - true)))
    r = np.array(rows)
    by_step = []
    for lo in range(0, int(tc["max_reply"]), STEP_BUCKET):
        m = (r[:, 0] >= lo) & (r[:, 0] < lo + STEP_BUCKET)
        if m.any():
            by_step.append({"from": lo, "to": lo + STEP_BUCKET, "n": int(m.sum()),
                            "mae_bert": round(float(r[m, 1].mean()), 2),
                            "mae_refined": round(float(r[m, 2].mean()), 2),
                            "mae_probe_only": round(float(r[m, 3].mean()), 2)})
    return {
        "mae_bert": round(float(np.mean(np.abs(init_pred - lengths))), 2),
        "mae_refined": round(float(r[:, 2].mean()), 2),
        "mae_bert_same_steps": round(float(r[:, 1].mean()), 2),
        "mae_by_step": by_step,
        "test_requests": len(samples),
        "steps_scored": len(rows),
        "layer": art.layer,
        "latency_batch32_ms": _latency(enc, art, [s.prompt for s in samples]),
        "artifact": art.describe(),
    }


def _latency(enc, art, prompts: list[str]) -> dict:
    """Initial prediction (tokenize + encode + head) on batches of 32 prompts, in ms."""
    from services.predictor.models import predict_proba

    times = []
    for r in range(LATENCY_REPEATS):
        batch = [prompts[(r * LATENCY_BATCH + i) % len(prompts)] for i in range(LATENCY_BATCH)]
        t0 = time.perf_counter()
        predict_proba(art.head, enc.encode(batch))
        times.append((time.perf_counter() - t0) * 1e3)
    return {"p50": round(float(np.percentile(times, 50)), 2),
            "p99": round(float(np.percentile(times, 99)), 2),
            "batches": LATENCY_REPEATS}


def build_parser() -> argparse.ArgumentParser:
    """``prefixmesh predictor`` arguments."""
    ap = argparse.ArgumentParser(prog="prefixmesh predictor", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    t = sub.add_parser("train", help="train the head and the probe; save an artifact folder")
    t.add_argument("--out", required=True, help="artifact folder")
    t.add_argument("--train", type=int, default=160, help="training conversations")
    t.add_argument("--test", type=int, default=80, help="held-out conversations (for eval)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--bins", type=int, default=DEFAULT_NUM_BINS)
    t.add_argument("--max-tokens", type=float, default=DEFAULT_MAX_TOKENS,
                   help="upper edge of the last bin (tokens)")
    t.add_argument("--spacing", choices=BIN_SPACINGS, default="linear")
    t.add_argument("--layers", default=DEFAULT_LAYERS, help="SmolLM2 layers to try")
    t.add_argument("--stride", type=int, default=8, help="decode tokens between probe readings")
    t.add_argument("--max-prompt", type=int, default=256, help="prompt tokens kept")
    t.add_argument("--max-reply", type=int, default=512, help="reply tokens teacher-forced")
    t.add_argument("--epochs", type=int, default=60)
    t.add_argument("--encoder", choices=("full", "static"), default="full")
    t.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: OpenMP threads contend on a shared 2-core box)")
    t.add_argument("--json", type=Path, default=None, help="also write the config here")
    e = sub.add_parser("eval", help="score an artifact on its held-out split")
    e.add_argument("--model", required=True, help="artifact folder")
    e.add_argument("--test", type=int, default=0, help="held-out conversations (0 = as trained)")
    e.add_argument("--json", type=Path, required=True, help="write the scores here")
    return ap


def main(argv: list[str]) -> int:
    """Entry point of ``prefixmesh predictor``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    result = train(args) if args.verb == "train" else evaluate(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "artifact"}, indent=2))
    return 0
