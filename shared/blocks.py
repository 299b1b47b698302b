"""prefixmesh block hashes: a hash chain over 16-token blocks, salted by tenant.

The hash of block ``i`` covers every token before it (it folds in the parent's hash), so
one hash names a whole prefix, as in vLLM's prefix cache. Only full blocks are hashed;
a trailing partial block is never cached. Python's tuple hash over ints is deterministic
across processes (no PYTHONHASHSEED dependence), fast, and 64-bit.

Tenant isolation: the chain starts from a salt derived from the tenant name, so identical
prompts of two tenants share no block hash, and so no cache entry.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence

BLOCK_SIZE = 16
# Packed hashes are little-endian int64s, whatever this machine's order.
_BIG_ENDIAN = sys.byteorder == "big"
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
    append = out.append
    # zip over one iterator yields the full blocks as tuples (a trailing partial block is
    # dropped); ``(parent,) + block`` is the tuple ``(parent, *block)``, built in C.
    it = iter(token_ids)
    for block in zip(*[it] * block_size):
        parent = hash((parent,) + block)
        append(parent)
    return out


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """``hashes`` as little-endian int64s, 8 bytes each, for a message that carries them to
    a reader that needs only some of them as ints (the scheduler's tree walk reads a few
    of a prompt's hashes; decoding a msgpack list makes an int object of every one). b""
    when one does not fit in a signed 64-bit int (not a prefixmesh hash: send the list)."""
    try:
        arr = array("q", hashes)  # from an int64 array (unpacked ones passed on): a copy
    except OverflowError:
        return b""
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def packed_run(run: array[int]) -> bytes | memoryview:
    """``pack_hashes`` of an int64 array without a copy where none is needed: a view of
    its memory on a little-endian machine."""
    return pack_hashes(run) if _BIG_ENDIAN else memoryview(run)


def unpack_hashes(data: bytes) -> array:
    """The int64 array over ``pack_hashes`` bytes: an int is made only where one is read.
    ValueError when ``data`` is not whole int64s."""
    if len(data) % 8:
        raise ValueError(f"{len(data)} bytes of packed hashes, not a multiple of 8")
    arr = array("q")
    arr.frombytes(data)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr


def chain_runs(parent_of: Mapping[int, int | None]) -> list[list[int]]:
    """The blocks of ``parent_of`` (block hash -> parent hash) as straight runs of their
    chains, parents before children: each run follows first children, and a sibling
    starts a run of its own later. A block whose parent is not in ``parent_of`` is a root.
    Used to describe a whole cache as ``BlockStored`` events (a resync)."""
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for h, parent in parent_of.items():
        if parent is not None and parent in parent_of:
            children.setdefault(parent, []).append(h)
        else:
            roots.append(h)
    runs: list[list[int]] = []
    stack = roots[::-1]
    while stack:
        run = [stack.pop()]
        while kids := children.get(run[-1]):
            stack.extend(reversed(kids[1:]))
            run.append(kids[0])
        runs.append(run)
    return runs
