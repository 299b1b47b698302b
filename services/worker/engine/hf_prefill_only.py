"""Prefill-only requests on the hf engine: hybrid prefilling and suffix KV discarding
(PrefillOnly; docs/design.md section 7).

A request that generates one token (``max_tokens: 1``: every ``/v1/score`` request, or a
completion asking for one token) never decodes, so layer ``l``'s keys and values are needed
by layer ``l``'s attention and by nothing after it. The ordinary path (``hf_engine.py``)
keeps every layer's KV of the whole prompt in a ``DynamicCache`` until the request ends
(SmolLM2-135M: 30 layers x 2 x 3 KV heads x 64 x 4 bytes = 45 KiB a token, 360 MiB at 8k
tokens). This path instead runs the model layer by layer over the whole uncached prompt:

- **hybrid prefilling**: attention sees the whole prompt (every query attends all of its
  keys within one layer pass), while the token-wise parts (the norms, the q/k/v/o
  projections and the MLP, whose intermediates are 2.7x the hidden size wide, twice) run
  ``chunk_tokens`` rows at a time, so their intermediates never exist for the whole
  sequence;
- **suffix KV discarding**: one layer's KV exists at a time. For layer ``l`` the cached
  prefix's KV is gathered from the pool, the new tokens' KV computed, the new full blocks
  copied into their pool blocks (they become prefix blocks, reusable by later requests as
  on the ordinary path), and everything else of that layer is dropped before layer
  ``l + 1``: nothing of the request outlives the pass but the prefix blocks it registers;
- logits of the last position only.

Working memory is then about the hidden states, the queries and one layer's KV: (576 + 576
+ 2 x 192) x 4 bytes = 6 KiB a token, plus one chunk's intermediates.

Attention runs per query chunk against every key up to the chunk's end with a lower-right
causal mask, in PyTorch's fused kernel with grouped-query heads (no n x n score matrix, no
copies of the KV heads): the same arithmetic as one call over the whole prompt.
Llama-architecture models only (SmolLM2 is one); others take the ordinary path.
"""

from __future__ import annotations

from typing import Any

from prefixmesh.services.worker.engine.kv_pool import KvPool

# Tokens per chunk of the token-wise layers: 512 keeps their intermediates at a few MB
# (SmolLM2-135M's MLP: 2 x 1536 floats a token) while the matrix products stay large.
DEFAULT_HYBRID_CHUNK_TOKENS = 512


def _rope(x: Any, cos: Any, sin: Any) -> Any:
    """Rotary position embedding of ``[heads, tokens, dim]`` with ``[tokens, dim]`` tables
    (the half-rotation convention of Llama)."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class HybridPrefill:
    """Runs the prefill-only forward pass of a Llama-architecture causal LM."""

    def __init__(self, model: Any, pool: KvPool, chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.model = model
        self.pool = pool
        self.chunk_tokens = chunk_tokens
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads

    @staticmethod
    def supports(model: Any) -> bool:
        """Whether ``model`` has the layout this pass computes (Llama's)."""
        cfg = model.config
        layers = getattr(getattr(model, "model", None), "layers", None)
        return (cfg.model_type == "llama" and getattr(cfg, "pretraining_tp", 1) == 1
                and layers is not None and all(
                    hasattr(la, "self_attn") and hasattr(la, "mlp") for la in layers))

    def run(self, ids: list[int], start: int, prefix_blocks: list[int],
            store_blocks: list[int], hidden_layer: int | None) -> tuple[Any, Any]:
        """Compute tokens ``ids`` at positions ``start..`` after a cached prefix of
        ``start`` tokens held in ``prefix_blocks``; write the KV of the new tokens' full
        blocks into ``store_blocks`` (block ``i`` holds new tokens ``[i*bs, (i+1)*bs)``;
        fewer blocks than full ones is fine: the rest is discarded). Returns the last
        position's logits ``[vocab]`` and, when ``hidden_layer`` is set, its hidden state
        at that layer (0 = embeddings; the last layer's is after the final norm, as
        transformers reports it). Call under ``torch.inference_mode()``."""
        import torch
        import torch.nn.functional as F

        m = self.model.model
        n, c, T, bs = len(ids), start, self.chunk_tokens, self.pool.block_size
        H, KH, D = self.heads, self.kv_heads, self.head_dim
        if c != len(prefix_blocks) * bs:
            raise ValueError("the cached prefix must be whole blocks")
        x = m.embed_tokens(torch.tensor(ids, dtype=torch.long))  # [n, hidden], the residual
        cos, sin = m.rotary_emb(x, torch.arange(c, c + n)[None])
        cos, sin = cos[0], sin[0]  # [n, D]
        hidden = x[-1].clone() if hidden_layer == 0 else None
        chunks = [(s, min(s + T, n)) for s in range(0, n, T)]
        q = torch.empty(H, n, D)
        # One layer's keys and values of the whole prompt (cached prefix, then new tokens),
        # reused by every layer: the only KV this pass holds.
        k, v = torch.empty(KH, c + n, D), torch.empty(KH, c + n, D)
        n_layers = len(m.layers)
        for li, layer in enumerate(m.layers):
            att = layer.self_attn
            if c:
                self.pool.gather_layer(li, prefix_blocks, k[:, :c], v[:, :c])
            for s, e in chunks:
                h = layer.input_layernorm(x[s:e])
                q[:, s:e] = _rope(att.q_proj(h).view(e - s, H, D).transpose(0, 1),
                                  cos[s:e], sin[s:e])
                k[:, c + s:c + e] = _rope(att.k_proj(h).view(e - s, KH, D).transpose(0, 1),
                                          cos[s:e], sin[s:e])
                v[:, c + s:c + e] = att.v_proj(h).view(e - s, KH, D).transpose(0, 1)
            for i, b in enumerate(store_blocks):
                self.pool.write_layer(li, b, k, v, c + i * bs)
            for s, e in chunks:
                end = c + e  # keys of every position up to this chunk's last query
                # Query i (position c + s + i) attends keys 0 .. c + s + i.
                mask = torch.ones(e - s, end, dtype=torch.bool).tril(end - (e - s))
                o = F.scaled_dot_product_attention(
                    q[None, :, s:e], k[None, :, :end], v[None, :, :end], attn_mask=mask,
                    scale=att.scaling, enable_gqa=True)
                x[s:e] += att.o_proj(o[0].transpose(0, 1).reshape(e - s, H * D))
                x[s:e] += layer.mlp(layer.post_attention_layernorm(x[s:e]))
            if hidden_layer == li + 1 and li + 1 < n_layers:
                hidden = x[-1].clone()
        last = m.norm(x[-1:])
        if hidden_layer == n_layers:
            hidden = last[0].clone()
        return self.model.lm_head(last)[0], hidden
