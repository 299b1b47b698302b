"""``prefixmesh predictor``: TRAIL's length predictors on ShareGPT and SmolLM2's lengths.

Data (loadgen/predictor/data.py): a seeded order of ShareGPT first exchanges, optionally
filtered as the ``sharegpt`` workload filters them. With ``--split test-first`` (new
artifacts) the first ``--test`` samples are held out and the next ``--train`` train, so the
test set does not move when the training set grows; ``train-first`` is the older layout.
With ``--replies model`` the replies (and so the length labels) are SmolLM2's own, sampled
once per prompt and cached (``data.model_replies``), as TRAIL labels its data with the
serving model's outputs; the default is ShareGPT's reply in SmolLM2 tokens.

collect: teacher-force the samples through SmolLM2 and cache their hidden states (the slow
part), test split first; ``train`` and ``eval`` then read the cache.

train: MiniLM embeddings of the prompts train the head (epochs chosen on a validation 20%
of the training requests); one probe per candidate layer is trained on the other 80% of the
training requests' readings and scored on the 20% (with ``--epochs auto``, the default, at
each of a few epoch counts); the best layer wins. The Bayesian update's forgetting factor
is TRAIL's 1.0 unless ``--forget auto`` chooses it on the same validation requests. The
head and the chosen probe are then retrained on all of train. ``--probe-target total``
trains the probe on the reply's total length instead of the remaining one, and
``--budget-bin`` adds a bin for replies cut at the token budget (trail.py's module doc).

eval: on the held-out split, MAE (tokens) of the head's initial prediction, and per decode
step of the refined prediction (probe + Bayesian update seeded with the head's
distribution) against the true remaining length; plus the head's latency on batches of 32
prompts. Writes ``{"mae_bert", "mae_refined", "mae_by_step": [...], "test_requests", ...}``
and, with ``--preds``, every request's predictions (for ``prefixmesh sim --predictions``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixmesh.loadgen.predictor.data import (
    REPLY_SOURCES,
    SAMPLE_FILTERS,
    Sample,
    collect_hidden,
    load_samples,
    model_replies,
)
from prefixmesh.shared.trail.lengths import (
    BIN_SPACINGS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_BINS,
    PROBE_TARGETS,
    LengthBins,
    Smoother,
    expected_length,
    probe_estimate,
    probe_input,
)

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

DEFAULT_LAYERS = "4,8,12,16,20,24,28"
STEP_BUCKET = 64  # tokens per mae_by_step bucket (default)
LATENCY_BATCH = 32
LATENCY_REPEATS = 20
SPLITS = ("train-first", "test-first")
# Head epochs tried on the validation requests (the head is small; its data is one row per
# request, so the best count depends on the training set's size).
HEAD_EPOCHS = (5, 10, 20, 60, 150, 400)
# Probe epochs tried by ``--epochs auto`` for each candidate layer: the readings of one
# request are strongly correlated, so the probe overfits a few thousand requests quickly.
PROBE_EPOCHS = (1, 2, 3, 5, 10, 20)
# Forgetting factors tried by ``--forget auto`` (1.0 is TRAIL's update).
FORGET_GRID = (1.0, 0.95, 0.9, 0.8, 0.7, 0.5, 0.3, 0.0)
VALIDATION_SHARE = 0.2


def split_samples(cfg: dict, tok, n_test: int | None = None) -> tuple[list[Sample], list[Sample]]:
    """(train, test) samples of a training config (same seed, filter and sizes)."""
    n_train, n_test = cfg["train"], n_test or cfg["test"]
    samples = load_samples(n_train + n_test, cfg["seed"], cfg["max_prompt"], tok,
                           cfg.get("filter", "none"))
    if cfg.get("split", "train-first") == "test-first":
        train_s, test_s = samples[n_test:], samples[:n_test]
    else:
        train_s, test_s = samples[:n_train], samples[n_train:]
    if cfg.get("replies", "sharegpt") == "model":
        def own(part: list[Sample]) -> list[Sample]:
            return model_replies(part, cfg["reply_tokens"], cfg["reply_temperature"],
                                 cfg["seed"], cfg["threads"], _cache(cfg))

        test_s = own(test_s)  # the held-out replies first (collect caches them first)
        train_s = own(train_s)
    return train_s, test_s


def _cache(cfg: dict) -> Path | None:
    return Path(cfg["cache"]) if cfg.get("cache") else None


def refine(initial: np.ndarray, probs: np.ndarray, owner: np.ndarray, steps: np.ndarray,
           bins: LengthBins, stride: int, forget: float, target: str = "remaining"
           ) -> np.ndarray:
    """Refined remaining-length estimate at every reading (rows of ``probs``, grouped by
    ``owner`` in step order), each request's smoother seeded with ``initial[owner]``."""
    out = np.empty(len(probs))
    for i in np.unique(owner):
        sm = Smoother(bins, initial[i], stride, forget, target)
        for j in np.flatnonzero(owner == i):
            out[j] = sm.update(probs[j], steps[j])
    return out


def remaining_median(lengths: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """For each step ``t``: the median of ``L - t`` over the ``lengths`` ``L > t`` (0 when
    none is that long), the best guess of the remaining length from ``t`` alone."""
    lengths = np.sort(np.asarray(lengths))
    out = np.zeros(len(steps))
    for t in np.unique(steps):
        longer = lengths[np.searchsorted(lengths, t, side="right"):]
        if len(longer):
            out[steps == t] = np.median(longer) - t
    return out


def _mae(pred: np.ndarray | float, target: np.ndarray) -> float:
    return float(np.mean(np.abs(np.asarray(pred) - target)))


def collect(args: argparse.Namespace) -> dict:
    """Teacher-force test then train samples into the cache."""
    from prefixmesh.shared.text.tokenizer import TextTokenizer

    cfg = vars(args)
    train_s, test_s = split_samples(cfg, TextTokenizer.load())
    layers = [int(x) for x in args.layers.split(",")]
    out = {}
    for name, part in (("test", test_s), ("train", train_s)):
        t0 = time.perf_counter()
        _, steps, _ = collect_hidden(part, layers, args.stride, args.max_reply, args.threads,
                                     Path(args.cache))
        out[name] = {"requests": len(part), "readings": len(steps),
                     "seconds": round(time.perf_counter() - t0, 1)}
    return out


def train(args: argparse.Namespace) -> dict:
    """Build and save an artifact; returns its config."""
    from prefixmesh.loadgen.predictor.fit import train_classifier
    from prefixmesh.services.predictor.encoder import PromptEncoder
    from prefixmesh.shared.text.tokenizer import TextTokenizer
    from prefixmesh.shared.trail.artifact import (
        HEAD_HIDDEN,
        PROBE_HIDDEN,
        PredictorArtifact,
        mlp,
        predict_proba,
    )

    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "out", "verb", "json")}
    tok = TextTokenizer.load()
    if args.budget_bin and (args.replies != "model" or args.max_tokens != args.reply_tokens):
        raise SystemExit("--budget-bin is for replies cut at a budget: it needs --replies model "
                         "and --max-tokens equal to --reply-tokens")
    bins = LengthBins.make(args.bins, args.max_tokens, args.spacing, args.budget_bin)
    train_s, _ = split_samples(cfg, tok)
    lengths = np.array([s.length for s in train_s])
    n_fit = int((1 - VALIDATION_SHARE) * len(train_s))  # validation: the last 20%
    enc = PromptEncoder(threads=args.threads, mode=args.encoder)
    emb = enc.encode_many([s.prompt for s in train_s])

    def fit_head(rows: slice, epochs: int):
        return train_classifier(emb[rows], bins.bin_of(lengths[rows]),
                                mlp(enc.dim, HEAD_HIDDEN, bins.num_bins), epochs, args.seed)

    val = slice(n_fit, None)
    head_val = {e: _mae(expected_length(predict_proba(fit_head(slice(0, n_fit), e), emb[val]),
                                        bins), lengths[val]) for e in HEAD_EPOCHS}
    head_epochs = min(head_val, key=head_val.__getitem__)
    log.info("head validation MAE by epochs %s: %d chosen", head_val, head_epochs)
    head_fit = fit_head(slice(0, n_fit), head_epochs)

    layers = [int(x) for x in args.layers.split(",")]
    hidden, steps, owner = collect_hidden(train_s, layers, args.stride, args.max_reply,
                                          args.threads, _cache(cfg))
    remaining = lengths[owner] - steps
    label = remaining if args.probe_target == "remaining" else lengths[owner]
    fit = owner < n_fit
    with_steps = args.step_features
    epoch_grid = PROBE_EPOCHS if args.epochs == "auto" else (int(args.epochs),)
    # Per layer: the validation MAE, probe and epoch count of its best epoch count.
    val_mae: dict[int, float] = {}
    val_probe: dict[int, nn.Module] = {}
    val_epochs: dict[int, int] = {}
    for k in layers:
        x = probe_input(hidden[k], steps, with_steps)
        for e in epoch_grid:
            probe = train_classifier(x[fit], bins.bin_of(label[fit]),
                                     mlp(x.shape[1], PROBE_HIDDEN, bins.num_bins), e, args.seed)
            mae = _mae(probe_estimate(predict_proba(probe, x[~fit]), bins, steps[~fit],
                                      args.probe_target), remaining[~fit])
            log.info("layer %d, %d epochs: validation MAE %.1f tokens", k, e, mae)
            if k not in val_mae or mae < val_mae[k]:
                val_mae[k], val_probe[k], val_epochs[k] = mae, probe, e
    best = min(val_mae, key=val_mae.__getitem__)
    # Forgetting factor on the validation requests (head and probe trained without them).
    init_val = predict_proba(head_fit, emb)  # rows of validation requests are used below
    x_best = probe_input(hidden[best], steps, with_steps)
    probs_val = predict_proba(val_probe[best], x_best[~fit])
    forget_val = {f: _mae(refine(init_val, probs_val, owner[~fit], steps[~fit], bins,
                                 args.stride, f, args.probe_target), remaining[~fit])
                  for f in FORGET_GRID}
    forget = (min(forget_val, key=forget_val.__getitem__) if args.forget == "auto"
              else float(args.forget))
    log.info("refined validation MAE by forgetting factor %s: %.2f used", forget_val, forget)
    head = fit_head(slice(None), head_epochs)
    probe = train_classifier(x_best, bins.bin_of(label),
                             mlp(x_best.shape[1], PROBE_HIDDEN, bins.num_bins),
                             val_epochs[best], args.seed)
    scores = {"layer_val_mae": {str(k): round(v, 2) for k, v in val_mae.items()},
              "layer_epochs": {str(k): v for k, v in val_epochs.items()},
              "probe_epochs": val_epochs[best],
              "head_epochs_val_mae": {str(k): round(v, 2) for k, v in head_val.items()},
              "head_epochs": head_epochs,
              "forget_val_mae": {str(k): round(v, 2) for k, v in forget_val.items()},
              "forget": forget}
    art = PredictorArtifact(bins, enc.dim, hidden[best].shape[1], best, float(args.stride),
                            cfg, scores, head, probe, step_features=with_steps,
                            target=args.probe_target)
    art.save(Path(args.out))
    return art.describe()


def evaluate(args: argparse.Namespace) -> dict:
    """Score an artifact on its held-out split (same seed, filter and sizes as training)."""
    from prefixmesh.services.predictor.encoder import PromptEncoder
    from prefixmesh.shared.text.tokenizer import TextTokenizer
    from prefixmesh.shared.trail.artifact import PredictorArtifact, predict_proba

    art = PredictorArtifact.load(Path(args.model))
    tc = art.train_config
    train_s, samples = split_samples(tc, TextTokenizer.load(), args.test or None)
    bins, stride = art.bins, int(art.tokens_per_update)
    forget = float(art.scores.get("forget", 1.0))
    enc = PromptEncoder(threads=tc["threads"], mode=tc["encoder"])
    initial = predict_proba(art.head, enc.encode_many([s.prompt for s in samples]))
    lengths = np.array([s.length for s in samples])
    init_pred = np.asarray(expected_length(initial, bins))  # rows in: rows out
    hidden, steps, owner = collect_hidden(samples, [art.layer], stride, tc["max_reply"],
                                          tc["threads"], _cache(tc))
    probs = predict_proba(art.probe, probe_input(hidden[art.layer], steps, art.step_features))
    true = lengths[owner] - steps
    train_lengths = np.array([s.length for s in train_s])
    # No reply outruns its token budget: with generated replies (cut at --reply-tokens, as
    # an engine cuts at max_tokens) every estimate is clipped at budget - t, as the worker's
    # refiner clips at max_tokens - t. ShareGPT's replies have no budget.
    budget = tc["reply_tokens"] if tc.get("replies") == "model" else np.inf
    room = budget - steps
    target = art.target

    def refined_with(f: float) -> np.ndarray:
        return np.minimum(refine(initial, probs, owner, steps, bins, stride, f, target), room)

    refined = refined_with(forget)
    estimates = {
        "bert": np.minimum(np.maximum(init_pred[owner] - steps, 0.0), room),
        "steps_only": remaining_median(train_lengths, steps),
        "refined": refined,
        "trail": refined_with(1.0),
        "probe_only": np.minimum(probe_estimate(probs, bins, steps, target), room)}
    err = {k: np.abs(v - true) for k, v in estimates.items()}
    bucket = args.bucket
    by_step = []
    for lo in range(0, int(tc["max_reply"]), bucket):
        m = (steps >= lo) & (steps < lo + bucket)
        if m.any():
            by_step.append({"from": lo, "to": lo + bucket, "n": int(m.sum()),
                            **{f"mae_{k}": round(float(v[m].mean()), 2)
                               for k, v in err.items()}})
    result: dict[str, Any] = {
        "mae_bert": round(_mae(init_pred, lengths), 2),
        "mae_refined": round(float(err["refined"].mean()), 2),
        "mae_refined_trail_update": round(float(err["trail"].mean()), 2),
        "mae_bert_same_steps": round(float(err["bert"].mean()), 2),
        # Baselines that read no text: the training median as every request's length, and
        # at each reading the median remaining length of training replies that long.
        "mae_constant": round(_mae(np.full(len(lengths), np.median(train_lengths)), lengths), 2),
        "mae_steps_only": round(float(err["steps_only"].mean()), 2),
        "mae_probe_only": round(float(err["probe_only"].mean()), 2),
        "mae_refined_request_mean": round(float(np.mean(
            [err["refined"][owner == i].mean() for i in np.unique(owner)])), 2),
        "forget": forget,
        "probe_target": target,
        "mae_by_step": by_step,
        "test_requests": len(samples),
        "steps_scored": int(len(steps)),
        "mean_length": round(float(lengths.mean()), 1),
        "layer": art.layer,
        "artifact": art.describe(),
    }
    result["ratio_bert_over_refined"] = round(result["mae_bert"] / result["mae_refined"], 3)
    if args.latency_repeats:
        result["latency_batch32_ms"] = _latency(enc, art, [s.prompt for s in samples],
                                                args.latency_repeats)
    if args.preds is not None:
        preds = {f"conv{s.conv}": {
            "length": s.length, "initial": round(float(init_pred[i]), 1),
            "steps": steps[owner == i].tolist(),
            "remaining": [round(float(x), 1) for x in refined[owner == i]]}
            for i, s in enumerate(samples)}
        args.preds.parent.mkdir(parents=True, exist_ok=True)
        args.preds.write_text(json.dumps({"forget": forget, "stride": stride,
                                          "budget": None if budget == np.inf else int(budget),
                                          "requests": preds}) + "\n")
    return result


def _latency(enc, art, prompts: list[str], repeats: int) -> dict:
    """Initial prediction (tokenize + encode + head) on batches of 32 prompts, in ms."""
    from prefixmesh.shared.trail.artifact import predict_proba

    times = []
    for r in range(repeats):
        batch = [prompts[(r * LATENCY_BATCH + i) % len(prompts)] for i in range(LATENCY_BATCH)]
        t0 = time.perf_counter()
        predict_proba(art.head, enc.encode(batch))
        times.append((time.perf_counter() - t0) * 1e3)
    return {"p50": round(float(np.percentile(times, 50)), 2),
            "p99": round(float(np.percentile(times, 99)), 2),
            "batches": repeats}


def plot(args: argparse.Namespace) -> dict:
    """PNG of an eval's MAE by decode-step bucket (TRAIL's Figure 3 layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = json.loads(Path(args.eval).read_text())
    rows = ev["mae_by_step"]
    x = [(r["from"] + r["to"]) / 2 for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    series = (("mae_bert", "MiniLM + head (initial, carried along)", "o-"),
              ("mae_trail", "probe + TRAIL's update", "s-"),
              ("mae_refined", f"probe + update, forgetting {ev['forget']:g}", "^-"),
              ("mae_probe_only", "probe alone", "x--"),
              ("mae_steps_only", "step alone (no text)", "d:"))
    for key, label, style in series:
        if all(key in r for r in rows):
            ax.plot(x, [r[key] for r in rows], style, label=label, markersize=4)
    ax.set_xlabel("decode step (bucket centre, tokens)")
    ax.set_ylabel("MAE of remaining length (tokens)")
    over = "total length" if ev.get("probe_target") == "total" else "remaining length"
    ax.set_title(f"{ev['test_requests']} held-out ShareGPT prompts, probe over the {over}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png)
    return {"png": str(args.png), "buckets": len(rows)}


def _data_args(p: argparse.ArgumentParser) -> None:
    """Arguments that pick the samples and their hidden states (collect and train)."""
    p.add_argument("--train", type=int, default=160, help="training conversations")
    p.add_argument("--test", type=int, default=80, help="held-out conversations (for eval)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filter", choices=SAMPLE_FILTERS, default="none",
                   help="vllm: keep the conversations the sharegpt workload keeps")
    p.add_argument("--split", choices=SPLITS, default="train-first",
                   help="test-first: the held-out set stays fixed as --train grows")
    p.add_argument("--replies", choices=REPLY_SOURCES, default="sharegpt",
                   help="length labels: ShareGPT's reply, or SmolLM2's own sampled reply "
                        "(generated once, cached)")
    p.add_argument("--reply-tokens", type=int, default=512,
                   help="--replies model: most tokens generated (longer replies are cut)")
    p.add_argument("--reply-temperature", type=float, default=0.7,
                   help="--replies model: sampling temperature")
    p.add_argument("--layers", default=DEFAULT_LAYERS, help="SmolLM2 layers to try")
    p.add_argument("--stride", type=int, default=8, help="decode tokens between probe readings")
    p.add_argument("--max-prompt", type=int, default=256, help="prompt tokens kept")
    p.add_argument("--max-reply", type=int, default=512, help="reply tokens teacher-forced")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: OpenMP threads contend on a shared 2-core box)")
    p.add_argument("--cache", default="", help="folder caching teacher-forced hidden states")


def _epochs(text: str) -> str:
    """``--epochs``: ``auto`` or a positive count."""
    if text != "auto" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """``prefixmesh predictor`` arguments."""
    ap = argparse.ArgumentParser(prog="prefixmesh predictor", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("collect", help="teacher-force the samples; cache their hidden states")
    _data_args(c)
    c.add_argument("--json", type=Path, default=None, help="also write a summary here")
    t = sub.add_parser("train", help="train the head and the probe; save an artifact folder")
    t.add_argument("--out", required=True, help="artifact folder")
    _data_args(t)
    t.add_argument("--bins", type=int, default=DEFAULT_NUM_BINS)
    t.add_argument("--max-tokens", type=float, default=DEFAULT_MAX_TOKENS,
                   help="upper edge of the last bin (tokens)")
    t.add_argument("--spacing", choices=BIN_SPACINGS, default="linear")
    t.add_argument("--epochs", type=_epochs, default="auto",
                   help="probe training epochs, or auto: the best of "
                        f"{', '.join(map(str, PROBE_EPOCHS))} per layer on the validation requests")
    t.add_argument("--forget", default="1.0",
                   help="Bayesian update's forgetting factor: 1.0 is TRAIL's; auto: chosen "
                        "on the validation requests")
    t.add_argument("--encoder", choices=("full", "static"), default="full")
    t.add_argument("--step-features", action="store_true",
                   help="the probe also reads the decode step (log(1+t), t/512); TRAIL's "
                        "probe reads the hidden state alone")
    t.add_argument("--probe-target", choices=PROBE_TARGETS, default="remaining",
                   help="what the probe's bins are over: the remaining length at each step "
                        "(TRAIL) or the reply's total length, read as remaining = E[L | L > t] - t")
    t.add_argument("--budget-bin", action="store_true",
                   help="one more bin, [--max-tokens, --max-tokens + 1): replies that run to "
                        "the token budget (--replies model, --max-tokens = --reply-tokens)")
    t.add_argument("--json", type=Path, default=None, help="also write the config here")
    e = sub.add_parser("eval", help="score an artifact on its held-out split")
    e.add_argument("--model", required=True, help="artifact folder")
    e.add_argument("--test", type=int, default=0, help="held-out conversations (0 = as trained)")
    e.add_argument("--bucket", type=int, default=STEP_BUCKET, help="decode steps per bucket")
    e.add_argument("--latency-repeats", type=int, default=LATENCY_REPEATS,
                   help="batches of 32 timed (0: skip)")
    e.add_argument("--preds", type=Path, default=None,
                   help="write every test request's predictions here (for the simulator)")
    e.add_argument("--json", type=Path, required=True, help="write the scores here")
    g = sub.add_parser("plot", help="PNG of an eval's MAE by decode step")
    g.add_argument("--eval", type=Path, required=True, help="eval JSON")
    g.add_argument("--png", type=Path, required=True, help="write the figure here")
    g.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str]) -> int:
    """Entry point of ``prefixmesh predictor``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    verbs = {"collect": collect, "train": train, "eval": evaluate, "plot": plot}
    result = verbs[args.verb](args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "artifact"}, indent=2))
    return 0
