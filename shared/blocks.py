"""prefixmesh block hashes: a hash chain over 16-token blocks, salted by tenant.

The hash of block ``i`` covers every token before it (it folds in the parent's hash), so
one hash names a whole prefix, as in vLLM's prefix cache. Only full blocks are hashed;
a trailing partial block is never cached. Python's tuple hash over ints is deterministic
across processes (no PYTHONHASHSEED dependence), fast, and 64-bit.

Tenant isolation: the chain starts from a salt derived from the tenant name, so identical
prompts of two tenants share no block hash, and so no cache entry.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

BLOCK_SIZE = 16
# Root of every chain for the default (empty) tenant.
ROOT_SALT = 0x5F3759DF


def tenant_salt(tenant: str) -> int:
    """Deterministic chain root for a tenant ("" -> the shared root)."""
    if not tenant:
        return ROOT_SALT
    return ROOT_SALT ^ (zlib.crc32(tenant.encode()) << 20)


def block_hashes(
    token_ids: Sequence[int], tenant: str = "", block_size: int = BLOCK_SIZE
) -> list[int]:
    """Hashes of the full blocks of ``token_ids``, each covering its whole prefix."""
    return extend_hashes(tenant_salt(tenant), token_ids, block_size)


def extend_hashes(parent: int, token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` continuing the chain after ``parent``."""
    out: list[int] = []
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        parent = hash((parent, *token_ids[start : start + block_size]))
        out.append(parent)
    return out
