"""The hf engine's paged prefix-KV pool: KV tensors of cached blocks, by block id."""

from __future__ import annotations

from typing import Any

# Blocks in the hf engine's pool by default: 16k tokens, 755 MB for SmolLM2-135M (737 KB a
# block), resident only as blocks are written.
DEFAULT_KV_BLOCKS = 1024


class KvPool:
    """KV tensors of cached 16-token blocks, indexed by BlockCache block id.

    ``k`` and ``v`` are ``[layers, blocks, kv_heads, block_size, head_dim]``; allocated with
    ``torch.empty`` so untouched blocks cost no memory. Per block: layers * 2 * kv_heads *
    block_size * head_dim * 4 bytes (SmolLM2-135M: 737 KB).
    """

    def __init__(self, num_blocks: int, num_layers: int, kv_heads: int, block_size: int,
                 head_dim: int) -> None:
        import torch

        shape = (num_layers, num_blocks, kv_heads, block_size, head_dim)
        self.k = torch.empty(shape, dtype=torch.float32)
        self.v = torch.empty(shape, dtype=torch.float32)
        self.block_size = block_size

    @classmethod
    def for_model(cls, config: Any, num_blocks: int, block_size: int) -> KvPool:
        """A pool shaped for a transformers model config."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        return cls(num_blocks, config.num_hidden_layers, config.num_key_value_heads,
                   block_size, head_dim)

    def write(self, block_id: int, keys: list[Any], values: list[Any], start: int) -> None:
        """Copy tokens ``[start, start + block_size)`` of per-layer ``[1, heads, seq, dim]``
        key/value tensors into ``block_id``."""
        end = start + self.block_size
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.k[layer, block_id].copy_(k[0, :, start:end])
            self.v[layer, block_id].copy_(v[0, :, start:end])

    def gather(self, block_ids: list[int]) -> list[tuple[Any, Any]]:
        """Per-layer ``(k, v)`` of shape ``[1, heads, len(block_ids) * block_size, dim]``."""
        import torch

        idx = torch.tensor(block_ids, dtype=torch.long)
        out = []
        for pool in (self.k, self.v):
            t = pool.index_select(1, idx)  # [L, n, H, bs, D]
            n_layers, n, heads, bs, dim = t.shape
            out.append(t.permute(0, 2, 1, 3, 4).reshape(n_layers, 1, heads, n * bs, dim))
        return [(out[0][i], out[1][i]) for i in range(out[0].shape[0])]

    def gather_layer(self, layer: int, block_ids: list[int], out_k: Any, out_v: Any) -> None:
        """Copy one layer's KV of ``block_ids`` into ``out_k`` / ``out_v`` (``[heads,
        len(block_ids) * block_size, dim]`` views), without building the other layers'."""
        import torch

        idx = torch.tensor(block_ids, dtype=torch.long)
        for pool, out in ((self.k, out_k), (self.v, out_v)):
            blocks = pool[layer].index_select(0, idx)  # [n, H, bs, D]
            out.copy_(blocks.permute(1, 0, 2, 3).reshape(out.shape))

    def write_layer(self, layer: int, block_id: int, k: Any, v: Any, start: int) -> None:
        """Copy tokens ``[start, start + block_size)`` of one layer's ``[heads, seq, dim]``
        keys and values into ``block_id``."""
        end = start + self.block_size
        self.k[layer, block_id].copy_(k[:, start:end])
        self.v[layer, block_id].copy_(v[:, start:end])
