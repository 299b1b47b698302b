"""The predictor's torch parts ([ml] extra): encoder shapes, head/probe training, artifacts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import need  # noqa: E402

need("ml", "torch", "transformers")
import torch  # noqa: E402

from prefixmesh.loadgen.predictor.fit import train_classifier  # noqa: E402
from prefixmesh.services.predictor.encoder import PromptEncoder  # noqa: E402
from prefixmesh.shared.trail.artifact import (  # noqa: E402
    HEAD_HIDDEN,
    PROBE_HIDDEN,
    PredictorArtifact,
    mlp,
    predict_proba,
)
from prefixmesh.shared.trail.lengths import LengthBins, expected_length  # noqa: E402


@pytest.mark.parametrize("mode", ["full", "static"])
def test_encoder_embeds_texts(mode: str) -> None:
    enc = PromptEncoder(mode=mode, threads=1)
    out = enc.encode(["Write a poem about the sea.", "2+2?", ""])
    assert out.shape == (3, 384) and out.dtype == np.float32
    assert np.isfinite(out).all()
    assert not np.allclose(out[0], out[1])


def test_probe_learns_a_separable_rule_and_round_trips(tmp_path: Path) -> None:
    bins = LengthBins.make(4, 400)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(800, 16)).astype(np.float32) * 5 + 3  # offset: standardised inside
    y = (x[:, 0] > 3).astype(int) * 3  # bin 0 or bin 3
    probe = train_classifier(x, y, mlp(16, PROBE_HIDDEN, 4), epochs=30, seed=0)
    p = predict_proba(probe, x)
    assert (p.argmax(1) == y).mean() > 0.95
    head = train_classifier(x, y, mlp(16, HEAD_HIDDEN, 4), epochs=2, seed=0)
    art = PredictorArtifact(bins, 16, 16, 7, 8.0, {"seed": 0}, {}, head, probe)
    art.save(tmp_path / "a")
    back = PredictorArtifact.load(tmp_path / "a")
    assert back.layer == 7 and back.bins == bins and back.tokens_per_update == 8.0
    np.testing.assert_allclose(predict_proba(back.probe, x), p, rtol=1e-5, atol=1e-6)
    assert expected_length(p[:1], bins).shape == (1,)


def test_training_depends_on_the_seed_alone() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    torch.manual_seed(123)  # the global generator's state differs between the two builds
    a = train_classifier(x, y, mlp(8, 16, 2), epochs=3, seed=7)
    torch.rand(5)
    b = train_classifier(x, y, mlp(8, 16, 2), epochs=3, seed=7)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_probe_with_step_features_round_trips_and_reads_the_step(tmp_path: Path) -> None:
    from prefixmesh.services.worker.refiner import Refiner
    from prefixmesh.shared.trail.lengths import STEP_FEATURE_DIM, probe_input

    bins = LengthBins.make(4, 400)
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(800, 16)).astype(np.float32)
    steps = rng.integers(0, 400, size=800)
    x = probe_input(hidden, steps, True)
    assert x.shape == (800, 16 + STEP_FEATURE_DIM)
    y = bins.bin_of(400 - steps - 1)  # the remaining length is the step's business alone
    probe = train_classifier(x, y, mlp(x.shape[1], PROBE_HIDDEN, 4), epochs=30, seed=0)
    head = train_classifier(hidden, y, mlp(16, HEAD_HIDDEN, 4), epochs=2, seed=0)
    PredictorArtifact(bins, 16, 16, 7, 8.0, {}, {}, head, probe,
                      step_features=True, target="total").save(tmp_path / "s")
    back = PredictorArtifact.load(tmp_path / "s")
    assert back.step_features and back.hidden_dim == 16 and back.target == "total"
    np.testing.assert_allclose(predict_proba(back.probe, x), predict_proba(probe, x),
                               rtol=1e-5, atol=1e-6)
    # The worker's numpy probe appends the same features: one hidden state, two steps.
    refiner = Refiner.load(tmp_path / "s")
    assert refiner.step_features and refiner.probe.input_dim == x.shape[1]
    early = refiner.probe.proba(probe_input(hidden[0], 0, True))
    late = refiner.probe.proba(probe_input(hidden[0], 390, True))
    assert early.argmax() == 3 and late.argmax() == 0
