"""TRAIL's trained predictor as files: the artifact format and the networks it holds (torch).

- Initial prediction: a head MLP over the prompt's embedding (``input -> 256 -> ReLU ->
  bins``; the encoder, all-MiniLM-L6-v2, is frozen and not saved).
- Refinement: a probe MLP over the serving model's hidden state at one layer,
  ``input -> 512 -> ReLU -> bins`` (TRAIL section 3), predicting the bin of the *remaining*
  output length at each decode step (TRAIL), or of the reply's total length
  (``target="total"``, ``lengths.PROBE_TARGETS``).

An artifact is one folder: ``config.json`` (bins, layer, sizes, training config and scores)
and ``head.safetensors`` / ``probe.safetensors``. Written by ``prefixmesh predictor train``
(loadgen/predictor), read by the predictor service (the head) and by hf workers (the probe).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from prefixmesh.shared.trail.lengths import STEP_FEATURE_DIM, LengthBins

PROBE_HIDDEN = 512  # TRAIL's probe width
HEAD_HIDDEN = 256
CONFIG_FILE = "config.json"
HEAD_FILE = "head.safetensors"
PROBE_FILE = "probe.safetensors"


def mlp(n_in: int, hidden: int, n_out: int) -> nn.Module:
    """``n_in -> hidden -> ReLU -> n_out`` (logits over bins)."""
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_out))


@dataclass
class PredictorArtifact:
    """What ``predictor train`` saves and the services load."""

    bins: LengthBins
    embed_dim: int  # encoder output width
    hidden_dim: int  # serving model's hidden size (probe input)
    layer: int  # serving-model layer the probe reads (hidden_states index)
    tokens_per_update: float  # decode tokens between two probe readings
    train_config: dict
    scores: dict
    head: nn.Module
    probe: nn.Module
    # Whether the probe also reads the decode step (``probe_input``): an extension of
    # TRAIL, whose probe reads the hidden state alone.
    step_features: bool = False
    # What the probe's bins are over (``trail.PROBE_TARGETS``): the remaining length at
    # each step (TRAIL) or the reply's total length.
    target: str = "remaining"

    def save(self, folder: Path) -> None:
        """Write config.json and the two weight files."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        meta = {"bins": self.bins.to_dict(), "embed_dim": self.embed_dim,
                "hidden_dim": self.hidden_dim, "layer": self.layer,
                "tokens_per_update": self.tokens_per_update,
                "step_features": self.step_features, "target": self.target,
                "head_hidden": HEAD_HIDDEN, "probe_hidden": PROBE_HIDDEN,
                "train_config": self.train_config, "scores": self.scores}
        (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        save_file(self.head.state_dict(), str(folder / HEAD_FILE))
        save_file(self.probe.state_dict(), str(folder / PROBE_FILE))

    @classmethod
    def load(cls, folder: Path) -> PredictorArtifact:
        """Read an artifact folder written by ``save``."""
        from safetensors.torch import load_file

        meta = json.loads((folder / CONFIG_FILE).read_text())
        bins = LengthBins.from_dict(meta["bins"])
        head = classifier(meta["embed_dim"], meta["head_hidden"], bins.num_bins)
        head.load_state_dict(load_file(str(folder / HEAD_FILE)))
        steps = bool(meta.get("step_features", False))
        probe = classifier(meta["hidden_dim"] + (STEP_FEATURE_DIM if steps else 0),
                           meta["probe_hidden"], bins.num_bins)
        probe.load_state_dict(load_file(str(folder / PROBE_FILE)))
        return cls(bins, meta["embed_dim"], meta["hidden_dim"], meta["layer"],
                   meta["tokens_per_update"], meta.get("train_config", {}),
                   meta.get("scores", {}), head.eval(), probe.eval(), step_features=steps,
                   target=meta.get("target", "remaining"))

    def describe(self) -> dict[str, Any]:
        """Config without weights (for logs and eval output)."""
        d = asdict(self)
        d.pop("head"), d.pop("probe")
        d["bins"] = self.bins.to_dict()
        return d


class Standardise(nn.Module):
    """``(x - mean) / std`` with the training set's statistics (saved as buffers)."""

    # Buffers: declared for the type checker (nn.Module types unknown attributes loosely).
    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def classifier(n_in: int, hidden: int, n_out: int) -> nn.Module:
    """The saved shape: standardisation then the MLP (matches ``train_classifier``)."""
    return nn.Sequential(Standardise(torch.zeros(n_in), torch.ones(n_in)),
                         mlp(n_in, hidden, n_out))


@torch.inference_mode()
def predict_proba(model: nn.Module, x: np.ndarray) -> np.ndarray:
    """Softmax over bins for each row of ``x``."""
    logits = model(torch.from_numpy(np.asarray(x, dtype=np.float32)))
    return torch.softmax(logits, -1).numpy().astype(np.float64)
