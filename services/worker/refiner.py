"""TRAIL's in-process refinement on an ``hf`` worker (TRAIL s.3-4, docs/design.md section 6).

The engine hands over the hidden state of the probe's layer at each step that samples a
token (``HfEngine.on_hidden``). Every ``tokens_per_update`` generated tokens the refiner
runs the probe on it (numpy: two matrix-vector products, no torch call on the event
loop), folds the distribution into the request's ``Smoother`` (Bayesian update over the
length bins, those of the remaining length or of the total length as the artifact's
``target`` says; with its forgetting factor, ``scores["forget"]``, 1.0 when absent),
and passes the expected remaining tokens to the local policy through
``HfEngine.update_prediction``; ``sprpt_limited`` re-ranks on it.

The Smoother's first prior, as in TRAIL, is the prompt encoder's bin distribution: the
predictor's reply carries it and the edge passes it on (``TokenizedRequest.
predicted_distribution``). When it is absent (prior-only predictor) or over other bins than
the probe's, the seed puts ``SEED_CONFIDENCE`` of the mass on the bin of the scalar
``predicted_output`` and spreads the rest evenly; a request without any prediction starts
from the uniform distribution (its first posterior is then the probe's own reading).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixmesh.services.worker.engine.types import EngineRequest, RequestStatus
from prefixmesh.shared.trail.lengths import LengthBins, Smoother, probe_input, softmax
from prefixmesh.shared.wire import LengthDistribution

log = logging.getLogger(__name__)

# Mass the seed distribution puts on the bin of the initial prediction (the rest is
# spread evenly over all bins, so a wrong initial bin can still be recovered).
SEED_CONFIDENCE = 0.5
# Smoothers kept before those of finished requests are dropped (requests).
SWEEP_AT = 64

Update = Callable[[str, float], bool]


class ProbeMLP:
    """The probe as numpy arrays: standardise -> Linear -> ReLU -> Linear -> softmax."""

    def __init__(self, mean: np.ndarray, std: np.ndarray, w1: np.ndarray, b1: np.ndarray,
                 w2: np.ndarray, b2: np.ndarray) -> None:
        # Fold the standardisation into the first layer: W1 ((x - m) / s) = (W1 / s) x - ...
        scaled = w1 / std[None, :]
        self.w1, self.b1 = scaled, b1 - scaled @ mean
        self.w2, self.b2 = w2, b2

    @classmethod
    def from_state_dict(cls, sd: dict[str, Any]) -> ProbeMLP:
        """From ``models.classifier``'s state dict (``0.mean``, ``0.std``, ``1.0.*``, ``1.2.*``)."""
        a = {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v,
                           dtype=np.float64) for k, v in sd.items()}
        return cls(a["0.mean"], a["0.std"], a["1.0.weight"], a["1.0.bias"],
                   a["1.2.weight"], a["1.2.bias"])

    @property
    def input_dim(self) -> int:
        return self.w1.shape[1]

    def proba(self, x: np.ndarray) -> np.ndarray:
        """Distribution over bins for one hidden state ``[input_dim]`` (or a batch)."""
        h = np.maximum(np.asarray(x, dtype=np.float64) @ self.w1.T + self.b1, 0.0)
        return softmax(h @ self.w2.T + self.b2)


def seed_distribution(bins: LengthBins, predicted: float,
                      distribution: LengthDistribution | None = None) -> np.ndarray:
    """The Smoother's first prior: the predictor's distribution when it is over the same
    bins, else one built from the scalar prediction (see module doc)."""
    if distribution is not None and tuple(distribution.edges) == bins.edges:
        probs = np.asarray(distribution.probs, dtype=np.float64)
        if probs.shape == (bins.num_bins,) and probs.sum() > 0:
            return probs / probs.sum()
    uniform = np.full(bins.num_bins, 1.0 / bins.num_bins)
    if predicted <= 0:
        return uniform
    onehot = np.zeros(bins.num_bins)
    onehot[int(bins.bin_of(predicted))] = 1.0
    return SEED_CONFIDENCE * onehot + (1.0 - SEED_CONFIDENCE) * uniform


class Refiner:
    """Per-request probe readings -> Smoother -> ``update(request_id, remaining_tokens)``."""

    def __init__(self, probe: ProbeMLP, bins: LengthBins, layer: int, tokens_per_update: int,
                 update: Update | None = None, forget: float = 1.0,
                 step_features: bool = False, target: str = "remaining") -> None:
        if tokens_per_update < 1:
            raise ValueError("tokens_per_update must be >= 1")
        self.probe, self.bins, self.layer = probe, bins, layer
        self.step_features = step_features  # the probe also reads the decode step
        self.every = tokens_per_update
        self.forget = forget  # the Bayesian update's forgetting factor (1.0: TRAIL's)
        self.target = target  # the probe's bins: remaining length (TRAIL) or total length
        self.update = update
        self._smoothers: dict[str, tuple[EngineRequest, Smoother]] = {}
        self.readings = 0  # probe runs since start
        self.seconds = 0.0  # time spent in on_hidden (all calls, readings or not)
        self.calls = 0  # on_hidden calls (one per sampled token)

    @classmethod
    def load(cls, folder: str | Path, update: Update | None = None) -> Refiner:
        """From a predictor artifact folder (torch is needed to read it, not to run it)."""
        from prefixmesh.shared.trail.artifact import PredictorArtifact

        art = PredictorArtifact.load(Path(folder))
        probe = ProbeMLP.from_state_dict(art.probe.state_dict())
        return cls(probe, art.bins, art.layer, max(1, round(art.tokens_per_update)), update,
                   float(art.scores.get("forget", 1.0)), art.step_features, art.target)

    def on_hidden(self, req: EngineRequest, generated: int, hidden: np.ndarray) -> None:
        """``HfEngine.on_hidden``: ``hidden`` was read just before sampling output token
        number ``generated`` (1-based), i.e. with ``generated - 1`` tokens already out,
        which is the step the probe was trained on (train.py: reply position ``t``)."""
        t0 = time.perf_counter()
        self.calls += 1
        t = generated - 1
        if t % self.every == 0:
            entry = self._smoothers.get(req.request_id)
            if entry is None:
                if len(self._smoothers) >= SWEEP_AT:
                    self._sweep()
                seed = seed_distribution(self.bins, req.predicted_output,
                                         req.predicted_distribution)
                smoother = Smoother(self.bins, seed, self.every, self.forget, self.target)
                entry = (req, smoother)
                self._smoothers[req.request_id] = entry
            x = probe_input(hidden, t, self.step_features)
            remaining_at_t = entry[1].update(self.probe.proba(x), t)
            self.readings += 1
            if self.update is not None:  # one of them (the sampled token) is now out
                # No request outruns its budget: at most max_tokens - generated are left.
                left = min(remaining_at_t - 1.0, req.max_tokens - generated)
                self.update(req.request_id, max(left, 0.0))
        self.seconds += time.perf_counter() - t0

    def _sweep(self) -> None:
        """Drop the smoothers of requests that are no longer waiting or running."""
        live = (RequestStatus.WAITING, RequestStatus.RUNNING)
        self._smoothers = {rid: e for rid, e in self._smoothers.items() if e[0].status in live}

    def __len__(self) -> int:
        return len(self._smoothers)


def attach_refiner(engine: Any, folder: str | Path) -> Refiner:
    """Load the probe artifact and wire it into an ``HfEngine`` before ``engine.load()``:
    the engine captures the probe's layer, the refiner updates the engine's local policy."""
    refiner = Refiner.load(folder, engine.update_prediction)
    engine.cfg = dataclasses.replace(engine.cfg, hidden_layer=refiner.layer)
    engine.on_hidden = refiner.on_hidden
    log.info("TRAIL refinement on: probe of layer %d, every %d tokens, %d bins over the %s "
             "length, forgetting factor %g", refiner.layer, refiner.every,
             refiner.bins.num_bins, refiner.target, refiner.forget)
    return refiner
