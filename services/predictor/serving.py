"""Serving a trained artifact: prompt token ids -> the text the encoder was trained on ->
MiniLM (full or static) + head -> expected output tokens, for a batch of requests at once.

Which text: requests carry the prompt's SmolLM2 token ids (the edge has nothing else for
token-id prompts, and chat prompts reach it already rendered by the tokenizer service).
The head was trained on the user's own message (train.py: the first human message, no
chat template), so a ChatML prompt is decoded and its last user turn is what gets encoded;
a plain prompt is encoded whole. Decoding here keeps that choice next to the artifact that
depends on it, and costs the edge nothing.

This module imports no torch at load time: ``ModelPredictor`` pulls it in when built.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixmesh.shared.text.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
USER_TURN = IM_START + "user\n"
# Characters of a prompt handed to MiniLM's tokenizer, which truncates to 256 word pieces
# anyway but would first tokenize the whole text: 16 characters per word piece. Over the
# first 4,000 ShareGPT prompts the last word piece read ends by character 1,654 at most,
# so the cut changes nothing there; only long unbroken strings (one [UNK] per word of over
# 100 characters) could leave fewer word pieces than the encoder would have read.
MAX_TEXT_CHARS = 16 * 256


def prompt_text(tok: TextTokenizer, token_ids: Sequence[int]) -> str:
    """The text the head reads: a ChatML prompt's last user message, else the whole prompt
    without special tokens."""
    raw = tok.decode(token_ids, skip_special_tokens=False)
    start = raw.rfind(USER_TURN)
    if start < 0:
        return tok.decode(token_ids, skip_special_tokens=True)
    body = raw[start + len(USER_TURN):]
    end = body.find(IM_END)
    return body if end < 0 else body[:end]


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> str | None:
    """Why ``token_ids`` cannot be decoded (None when they can)."""
    for t in token_ids:
        if not 0 <= t < vocab_size:
            return f"token id {t} outside the vocabulary [0, {vocab_size})"
    return None


class StaticEncoder:
    """``PromptEncoder(mode="static")``'s embeddings, computed for serving latency: MiniLM's
    Rust tokenizer called directly (truncated to the encoder's limit, no padding, no
    tensors built per prompt), then one ``embedding_bag`` mean over the word embeddings,
    which never materialises the ``[batch, tokens, dim]`` tensor. Same output as
    ``PromptEncoder.encode`` in static mode (tests/ml/test_predictor_service.py)."""

    def __init__(self, encoder: Any) -> None:
        from tokenizers import Tokenizer

        # A private copy: truncation is set once here, not per call on the shared one.
        self.tokenizer = Tokenizer.from_str(encoder.tokenizer.backend_tokenizer.to_str())
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(encoder.max_tokens)
        self.weight = encoder.model.embeddings.word_embeddings.weight.detach()
        self.dim = int(self.weight.shape[1])

    def encode(self, texts: list[str]) -> Any:
        """``[len(texts), dim]`` float32 numpy embeddings."""
        import numpy as np
        import torch

        ids = [e.ids for e in self.tokenizer.encode_batch_fast(texts)]
        offsets = torch.tensor([0, *np.cumsum([len(x) for x in ids[:-1]])], dtype=torch.long)
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.long)
        with torch.inference_mode():
            out = torch.nn.functional.embedding_bag(flat, self.weight, offsets, mode="mean")
        return out.numpy().astype(np.float32)


class ModelPredictor:
    """A loaded artifact's prompt encoder and head; ``predict`` blocks (run it in an executor).

    The encoder mode (``full`` or ``static``) is the one the head was trained with
    (``train_config["encoder"]`` of the artifact).
    """

    def __init__(self, folder: str | Path, threads: int = 1, tokenizer_path: str = "") -> None:
        from prefixmesh.services.predictor.encoder import PromptEncoder
        from prefixmesh.shared.trail.artifact import PredictorArtifact

        self.artifact: Any = PredictorArtifact.load(Path(folder))
        self.mode = str(self.artifact.train_config.get("encoder", "full"))
        self.encoder: Any = PromptEncoder(threads=threads, mode=self.mode)
        if self.mode == "static":
            self.encoder = StaticEncoder(self.encoder)
        if self.encoder.dim != self.artifact.embed_dim:
            raise ValueError(f"artifact expects {self.artifact.embed_dim}-d embeddings, "
                             f"the encoder gives {self.encoder.dim}")
        self.tok = TextTokenizer.load(tokenizer_path or None)
        log.info("predictor artifact %s loaded (%s encoder, %d bins)", folder, self.mode,
                 self.artifact.bins.num_bins)

    @property
    def vocab_size(self) -> int:
        """Token ids accepted in requests are below this."""
        return self.tok.vocab_size

    def texts(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """Encoder input for each prompt."""
        return [prompt_text(self.tok, ids)[:MAX_TEXT_CHARS] for ids in prompts]

    def predict(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        """Expected output tokens of each prompt (one encoder and head pass for all)."""
        return [n for n, _ in self.predict_distributions(prompts)]

    def predict_distributions(self, prompts: Sequence[Sequence[int]]
                              ) -> list[tuple[float, list[float]]]:
        """Each prompt's expected output tokens and its distribution over the bins."""
        import numpy as np

        from prefixmesh.shared.trail.artifact import predict_proba
        from prefixmesh.shared.trail.lengths import expected_length

        if not prompts:
            return []
        probs = predict_proba(self.artifact.head, self.encoder.encode(self.texts(prompts)))
        lengths = np.asarray(expected_length(probs, self.artifact.bins))  # rows in: rows out
        return [(float(n), [float(x) for x in p]) for n, p in zip(lengths, probs, strict=True)]

    @property
    def edges(self) -> list[float]:
        """The artifact's bin edges (output tokens)."""
        return list(self.artifact.bins.edges)
