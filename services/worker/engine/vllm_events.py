"""vLLM's KV-event stream, decoded and translated into prefixmesh's KV events (pure logic).

vLLM publishes KV events from its scheduler through ``ZmqEventPublisher``
(``vllm/distributed/kv_events.py``, enabled by ``--kv-events-config``): each message is
multipart ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian counter from 0 per
publisher, ``payload`` a msgpack ``EventBatch{ts, events, data_parallel_rank?}``. A ROUTER
socket replays buffered batches: send ``[b"", start_seq]`` (8-byte big-endian), get
``[b"", seq, payload]`` frames, then ``[b"", seq=-1, b""]`` as the end marker.

The event structs are msgspec tagged structs, encoded differently across releases; every
shape below is accepted (``decode_batch``), and fields added later are ignored:

- v0.9 (PR #16750): ``array_like=True``, tag first. ``["BlockStored", hashes, parent,
  token_ids, block_size, lora_id]``, ``["BlockRemoved", hashes]``, ``["AllBlocksCleared"]``;
  batch ``[ts, events]``. Hashes are ints. (vLLM's earliest example subscriber had
  ``num_toks_per_block: list[int]`` where ``block_size`` now is; accepted too.)
- v0.10 - v0.2x: still positional, fields appended at the end: ``medium`` (#19737),
  ``lora_name`` (#27577), ``extra_keys`` (#33304), ``group_idx`` (#37688), ...; batch
  ``[ts, events, data_parallel_rank]``. Hashes became ``ExternalBlockHash = bytes | int``
  (sha256 bytes by default; ints with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
- after #42892 (2026): each event is a map, tag under ``"type"``:
  ``{"type": "BlockStored", "block_hashes": [...], ...}``; the outer batch stays an array in
  some releases (0.26: ``[ts, [{...}], 0]``) and is a map on current main.

prefixmesh's scheduler keys its prefix tree by prefixmesh block hashes (``shared/blocks.py``:
16-token blocks, tenant-salted chain) that the edge computes from token ids before any
engine has seen the request; vLLM's hashes are its own (different function, extra keys,
block size) and cannot be computed at the edge. So ``BlockTranslator`` re-hashes: a
BlockStored carries the tokens of its blocks and names its parent, so the prefixmesh chain
of every new vLLM block is its parent's chain extended over its tokens. The translator keeps,
per live vLLM hash, the prefixmesh hashes it stands for, which is all a later BlockRemoved
(hashes only) needs. Losing events is asymmetric: a missed store under-reports the cache (the
scheduler routes a little worse), a missed removal over-reports it (the scheduler sends
requests for prefixes the worker no longer holds), so after an unrecoverable gap the caller
``reset()``s the translator and publishes ``AllBlocksCleared``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from prefixmesh.shared.blocks import BLOCK_SIZE, chain_runs, extend_hashes, tenant_salt
from prefixmesh.shared.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

# vLLM's ExternalBlockHash.
VllmHash = int | bytes

SEQ_BYTES = 8
# Sequence number of the replay socket's end marker (sent with an empty payload).
END_SEQ = -1
# Medium of GPU-resident blocks; events about other tiers (CPU offload) are skipped.
MEDIUM_GPU = "GPU"
# First-block token tuples remembered for tenant attribution of root blocks (see
# BlockTranslator.note_request); oldest forgotten first.
MAX_ROOT_HINTS = 65536

# Field order of the positional (array_like) encodings, after the tag; later releases only
# appended, so an old array is a prefix of this and a newer one's extra fields fall off.
_POSITIONAL: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_DECODER = msgspec.msgpack.Decoder()


class VllmEventError(ValueError):
    """A payload that is not a vLLM EventBatch in any known shape."""


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True, slots=True)
class VllmBlockStored:
    """vLLM blocks newly cached; ``token_ids`` covers all of them, ``block_size`` each."""

    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # Per block: the extra keys vLLM hashed (multimodal ids, LoRA name, cache_salt, ...).
    extra_keys: list[Any] | None = None
    # KV-cache group (hybrid models publish one event per group).
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class VllmBlockRemoved:
    """vLLM blocks evicted (one entry per physical copy)."""

    block_hashes: list[VllmHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class VllmAllBlocksCleared:
    """vLLM's prefix cache was reset."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


@dataclass(frozen=True, slots=True)
class VllmEventBatch:
    """One decoded publisher message."""

    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None
    # Events left out: unknown type (a future vLLM) or malformed.
    skipped: int = 0


def decode_seq(raw: bytes) -> int:
    """A publisher or replay sequence number (8-byte big-endian, -1 = end marker)."""
    if len(raw) != SEQ_BYTES:
        raise VllmEventError(f"sequence frame of {len(raw)} bytes")
    return int.from_bytes(raw, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian frame of a sequence number (a replay request's start)."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_batch(payload: bytes) -> VllmEventBatch:
    """Decode one EventBatch payload in any known encoding; raises VllmEventError."""
    try:
        raw = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise VllmEventError(f"not msgpack: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise VllmEventError(f"not an EventBatch: {type(raw).__name__}")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise VllmEventError("EventBatch without ts / events")
    out: list[VllmEvent] = []
    for ev in events:
        decoded = _decode_event(ev)
        if decoded is not None:
            out.append(decoded)
    return VllmEventBatch(float(ts), out, rank if isinstance(rank, int) else None,
                          len(events) - len(out))


def _decode_event(ev: Any) -> VllmEvent | None:
    """One event from its positional or map form; None if unknown or malformed."""
    if isinstance(ev, list) and ev and isinstance(ev[0], str):
        tag = ev[0]
        names = _POSITIONAL.get(tag)
        if names is None:
            return None
        fields = dict(zip(names, ev[1:], strict=False))
    elif isinstance(ev, dict) and isinstance(ev.get("type"), str):
        tag = ev["type"]
        names = _POSITIONAL.get(tag)
        if names is None:
            return None
        fields = {k: ev[k] for k in names if k in ev}
    else:
        return None
    try:
        return _build(tag, fields)
    except (KeyError, TypeError, ValueError):  # a required field missing or mistyped
        return None


def _hashes(v: Any) -> list[VllmHash]:
    if not isinstance(v, list) or not all(isinstance(h, int | bytes) for h in v):
        raise TypeError("block_hashes must be a list of ints or bytes")
    return v


def _opt(v: Any, kind: type | tuple[type, ...]) -> Any:
    if v is not None and not isinstance(v, kind):
        raise TypeError(f"expected {kind} or None, got {type(v).__name__}")
    return v


def _build(tag: str, f: dict[str, Any]) -> VllmEvent:
    if tag == "AllBlocksCleared":
        return VllmAllBlocksCleared()
    if tag == "BlockRemoved":
        return VllmBlockRemoved(_hashes(f["block_hashes"]), _opt(f.get("medium"), str),
                                _opt(f.get("group_idx"), int))
    tokens, size = f["token_ids"], f["block_size"]
    if isinstance(size, list):  # num_toks_per_block of the earliest example subscriber
        size = size[0] if size else 0
    if not isinstance(tokens, list) or not isinstance(size, int) or size < 1:
        raise ValueError("BlockStored needs token_ids and a block_size >= 1")
    return VllmBlockStored(
        _hashes(f["block_hashes"]), _opt(f.get("parent_block_hash"), (int, bytes)), tokens,
        size, _opt(f.get("lora_id"), int), _opt(f.get("medium"), str),
        _opt(f.get("lora_name"), str), _opt(f.get("extra_keys"), list),
        _opt(f.get("group_idx"), int))


# --------------------------------------------------------------------------- sequence numbers


@dataclass(frozen=True, slots=True)
class SeqGap:
    """Publisher messages ``start .. end - 1`` never arrived."""

    start: int
    end: int


class SeqTracker:
    """Order check on one publisher's sequence numbers (0, 1, 2, ...)."""

    def __init__(self, first: int | None = 0) -> None:
        # ``first``: the seq expected first (vLLM's publisher starts at 0, and PUB/SUB drops
        # what is sent before the subscription lands: a gap to replay); None = take any.
        self.last: int | None = None if first is None else first - 1

    def is_duplicate(self, seq: int) -> bool:
        """Already seen (a replayed batch arriving again)."""
        return self.last is not None and seq <= self.last

    def gap_before(self, seq: int) -> SeqGap | None:
        """The messages missing before ``seq``, if any."""
        if self.last is None or seq <= self.last + 1:
            return None
        return SeqGap(self.last + 1, seq)

    def accept(self, seq: int) -> None:
        """``seq`` has been handled (or given up on)."""
        if self.last is None or seq > self.last:
            self.last = seq


# --------------------------------------------------------------------------- translation


@dataclass(slots=True)
class _Block:
    """What one live vLLM block hash stands for in prefixmesh terms."""

    # prefixmesh blocks that end inside this vLLM block (its own, for BlockRemoved).
    pm_hashes: tuple[int, ...]
    # Where the prefixmesh chain continues after this block: its last prefixmesh hash,
    # or the tenant salt while no prefixmesh block is complete yet.
    chain: int
    # Last prefixmesh hash up to this block's end (None: none yet; a child's parent).
    tail: int | None
    # Tokens after the last full prefixmesh block (vLLM block size not a multiple of 16).
    leftover: tuple[int, ...]
    # Live vLLM copies of this hash: vLLM may cache one hash in several physical blocks
    # and publishes a store and a removal for each.
    refs: int = 1


class BlockTranslator:
    """vLLM KV events -> prefixmesh KV events, per worker (see the module docstring)."""

    def __init__(self, block_size: int = BLOCK_SIZE, main_group: int = 0) -> None:
        # prefixmesh block size (tokens); vLLM's may differ.
        self.block_size = block_size
        # Hybrid models publish one event per KV-cache group with shared hashes; only this
        # group (the full-attention one, 0) describes reusable prefixes.
        self.main_group = main_group
        self._blocks: dict[VllmHash, _Block] = {}
        # Live prefixmesh hashes: vLLM blocks naming each, parent hash, tokens.
        self._pm_refs: dict[int, int] = {}
        self._pm_parent: dict[int, int | None] = {}
        self._pm_tokens: dict[int, tuple[int, ...]] = {}
        self._tenants: set[str] = set()
        self._root_hints: OrderedDict[tuple[int, ...], str] = OrderedDict()
        # Counters for logs and metrics.
        self.orphans = 0  # stores whose parent vLLM block was unknown (dropped)
        self.unknown_removals = 0  # removals of vLLM hashes never seen stored
        self.skipped = 0  # events for other media, groups, LoRA adapters or malformed

    # ------------------------------------------------------------------ tenants

    def note_request(self, tenant: str, prompt_token_ids: Sequence[int]) -> None:
        """Remember a submitted prompt's tenant, to root its blocks' chain at that tenant's
        salt. The engine passes the tenant to vLLM as ``cache_salt`` (so vLLM isolates
        tenants as prefixmesh does); vLLM >= #33304 reports it back in ``extra_keys``, which
        wins. Older vLLM reports nothing: the tenant is then looked up by the prompt's first
        block (the latest request with those 16 tokens decides)."""
        if tenant:
            self._tenants.add(tenant)
        if len(prompt_token_ids) >= self.block_size:
            key = tuple(prompt_token_ids[: self.block_size])
            self._root_hints[key] = tenant
            self._root_hints.move_to_end(key)
            if len(self._root_hints) > MAX_ROOT_HINTS:
                self._root_hints.popitem(last=False)

    def _root_tenant(self, ev: VllmBlockStored) -> str:
        if ev.extra_keys is not None:
            first = ev.extra_keys[0] if ev.extra_keys else None
            if isinstance(first, list | tuple):
                for key in first:
                    if isinstance(key, str) and key in self._tenants:
                        return key
            return ""
        return self._root_hints.get(tuple(ev.token_ids[: self.block_size]), "")

    # ------------------------------------------------------------------ events

    def translate(self, events: Iterable[VllmEvent]) -> list[KvEvent]:
        """prefixmesh events for a batch of vLLM events, in order."""
        out: list[KvEvent] = []
        for ev in events:
            if isinstance(ev, VllmBlockStored):
                stored = self._store(ev)
                if stored is not None:
                    out.append(stored)
            elif isinstance(ev, VllmBlockRemoved):
                if self._wanted(ev.medium, ev.group_idx):
                    gone = self._remove(ev.block_hashes)
                    if gone:
                        out.append(BlockRemoved(block_hashes=gone))
                else:
                    self.skipped += 1
            elif isinstance(ev, VllmAllBlocksCleared):
                out.extend(self.reset())
        return out

    def reset(self) -> list[KvEvent]:
        """Forget every block; returns the ``AllBlocksCleared`` to publish."""
        self._blocks.clear()
        self._pm_refs.clear()
        self._pm_parent.clear()
        self._pm_tokens.clear()
        return [AllBlocksCleared()]

    def _wanted(self, medium: str | None, group_idx: int | None) -> bool:
        return medium in (None, MEDIUM_GPU) and group_idx in (None, self.main_group)

    def _store(self, ev: VllmBlockStored) -> BlockStored | None:
        bs, pm_bs = ev.block_size, self.block_size
        if (not self._wanted(ev.medium, ev.group_idx) or ev.lora_id is not None
                or ev.lora_name or len(ev.token_ids) < len(ev.block_hashes) * bs):
            # LoRA blocks hold adapter KV: not reusable by the base-model requests we route.
            self.skipped += 1
            return None
        leftover: tuple[int, ...]  # as in _Block
        if ev.parent_block_hash is None:
            chain, tail, leftover = tenant_salt(self._root_tenant(ev)), None, ()
        else:
            parent = self._blocks.get(ev.parent_block_hash)
            if parent is None:  # stored before we listened, or lost: under-reported, safe
                self.orphans += 1
                return None
            chain, tail, leftover = parent.chain, parent.tail, parent.leftover
        first_parent = tail
        hashes: list[int] = []
        for i, h in enumerate(ev.block_hashes):
            known = self._blocks.get(h)
            if known is not None:  # another physical copy of a block we know
                known.refs += 1
                block = known
            else:
                tokens = leftover + tuple(ev.token_ids[i * bs : (i + 1) * bs])
                full = len(tokens) - len(tokens) % pm_bs
                own = tuple(extend_hashes(chain, tokens[:full], pm_bs))
                prev = tail
                for k, p in enumerate(own):
                    n = self._pm_refs.get(p, 0)
                    self._pm_refs[p] = n + 1
                    if not n:
                        self._pm_parent[p] = prev
                        self._pm_tokens[p] = tokens[k * pm_bs : (k + 1) * pm_bs]
                    prev = p
                block = _Block(own, own[-1] if own else chain, own[-1] if own else tail,
                               tokens[full:])
                self._blocks[h] = block
            chain, tail, leftover = block.chain, block.tail, block.leftover
            hashes.extend(block.pm_hashes)
        if not hashes:
            return None
        tokens_out = [t for p in hashes for t in self._pm_tokens[p]]
        return BlockStored(block_hashes=hashes, parent_block_hash=first_parent,
                           token_ids=tokens_out, block_size=pm_bs)

    def _remove(self, vllm_hashes: Iterable[VllmHash]) -> list[int]:
        gone: list[int] = []
        for h in vllm_hashes:
            block = self._blocks.get(h)
            if block is None:
                self.unknown_removals += 1
                continue
            block.refs -= 1
            if block.refs:
                continue
            del self._blocks[h]
            for p in block.pm_hashes:
                n = self._pm_refs[p] - 1
                if n:
                    self._pm_refs[p] = n
                else:
                    del self._pm_refs[p], self._pm_parent[p], self._pm_tokens[p]
                    gone.append(p)
        return gone

    # ------------------------------------------------------------------ views

    @property
    def num_vllm_blocks(self) -> int:
        """Live vLLM block hashes known."""
        return len(self._blocks)

    @property
    def num_blocks(self) -> int:
        """Live prefixmesh blocks."""
        return len(self._pm_refs)

    def pm_hashes_of(self, vllm_hash: VllmHash) -> tuple[int, ...]:
        """The prefixmesh hashes a live vLLM block stands for (empty if unknown)."""
        block = self._blocks.get(vllm_hash)
        return block.pm_hashes if block is not None else ()

    def cached_prefix_tokens(self, block_hashes: Sequence[int]) -> int:
        """Tokens of the longest prefix of prefixmesh ``block_hashes`` that vLLM caches."""
        n, refs = 0, self._pm_refs
        for h in block_hashes:
            if h not in refs:
                break
            n += 1
        return n * self.block_size

    def snapshot_events(self) -> list[KvEvent]:
        """``[AllBlocksCleared, BlockStored...]`` describing every live prefixmesh block,
        parents before children, one event per straight run of a chain (a resync)."""
        parents, cached = self._pm_parent, self._pm_refs
        events: list[KvEvent] = [AllBlocksCleared()]
        for run in chain_runs({h: p for h, p in parents.items() if h in cached}):
            events.append(BlockStored(
                block_hashes=run, parent_block_hash=parents[run[0]],
                token_ids=[t for h in run for t in self._pm_tokens[h]],
                block_size=self.block_size))
        return events
