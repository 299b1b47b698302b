"""Training the artifact's networks: cross-entropy over length bins (torch)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from prefixmesh.shared.trail.artifact import Standardise


def train_classifier(x: np.ndarray, y: np.ndarray, model: nn.Module, epochs: int, seed: int,
                     lr: float = 1e-3, weight_decay: float = 1e-4) -> nn.Module:
    """Cross-entropy over bins with Adam, minibatches in a seeded order; returns eval mode.
    About 10 minibatches per epoch (16 to 256 rows), so small sets still get enough steps."""
    gen = torch.Generator().manual_seed(seed)
    # The layers' initial weights come from the seed, not from whatever the global
    # generator had when ``model`` was built.
    torch.manual_seed(seed)
    for layer in model.modules():
        reset = getattr(layer, "reset_parameters", None)
        if callable(reset):
            reset()
    batch = min(256, max(16, len(x) // 10))
    xt, yt = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
    # Standardise inputs inside the model (hidden states have large per-dim offsets).
    mean, std = xt.mean(0), xt.std(0).clamp(min=1e-4)
    model = nn.Sequential(Standardise(mean, std), model)
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


