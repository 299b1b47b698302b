"""A tiny predictor artifact trained in seconds on the real MiniLM encoder (test fixture).

The head learns to tell a few short-answer prompts (bin 0) from long-answer ones (last
bin); the probe is fitted to random vectors of SmolLM2's hidden size (its readings only
need to be distributions that move, for the refinement tests).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prefixmesh.shared.trail.artifact import HEAD_HIDDEN, PROBE_HIDDEN, PredictorArtifact, mlp
from prefixmesh.services.predictor.encoder import PromptEncoder
from prefixmesh.loadgen.predictor.fit import train_classifier
from prefixmesh.shared.trail.lengths import LengthBins

SHORT = ["Say yes or no: is water wet?", "What is 2+2?", "Reply with one word: hello.",
         "Is the sky blue? Answer yes or no.", "Give me a number between 1 and 9.",
         "Spell the word cat.", "True or false: fire is cold.", "Name one colour."]
LONG = ["Write a detailed 2000-word essay on the history of the Roman Empire.",
        "Write a long story about a dragon, with many chapters and characters.",
        "Explain in depth, step by step, how a compiler works, with code examples.",
        "Write a complete tutorial on machine learning covering every major algorithm.",
        "Draft a full business plan with market analysis, finances and strategy.",
        "Write a long poem of fifty stanzas about the sea and its sailors.",
        "Describe in great detail the plot of every Shakespeare play.",
        "Produce an exhaustive guide to cooking Italian food, with many recipes."]
HIDDEN = 576  # SmolLM2-135M's hidden size
LAYER = 8
TOKENS_PER_UPDATE = 2


def build(folder: Path, encoder: str = "full") -> PredictorArtifact:
    """Train and save the tiny artifact into ``folder``; returns it."""
    bins = LengthBins.make(8, 512)
    enc = PromptEncoder(threads=1, mode=encoder)
    x = enc.encode(SHORT + LONG)
    y = np.array([0] * len(SHORT) + [bins.num_bins - 1] * len(LONG))
    head = train_classifier(x, y, mlp(enc.dim, HEAD_HIDDEN, bins.num_bins), epochs=40, seed=0)
    rng = np.random.default_rng(0)
    hx = rng.normal(size=(256, HIDDEN)).astype(np.float32)
    hy = bins.bin_of(np.abs(hx[:, 0]) * 200)  # any rule: readings differ by input
    probe = train_classifier(hx, hy, mlp(HIDDEN, PROBE_HIDDEN, bins.num_bins), epochs=5, seed=0)
    art = PredictorArtifact(bins, enc.dim, HIDDEN, LAYER, float(TOKENS_PER_UPDATE),
                            {"encoder": encoder, "seed": 0}, {}, head, probe)
    art.save(folder)
    return art
