"""vLLM KV-event payloads decoded in every encoding, and translated to prefixmesh hashes.

The payloads are built with msgspec Structs declared like vLLM's own
(``vllm/distributed/kv_events.py``) in each release's shape and encoded the way vLLM's
ZmqEventPublisher encodes them, so the bytes are those a real publisher sends.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from prefixmesh.services.worker.engine.vllm_events import (
    BlockTranslator,
    SeqGap,
    SeqTracker,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventError,
    decode_batch,
    decode_seq,
    encode_seq,
)
from prefixmesh.shared.blocks import block_hashes, tenant_salt
from prefixmesh.shared.wire import AllBlocksCleared, BlockRemoved, BlockStored

ENC = msgspec.msgpack.Encoder()


# ---- v0.9: positional, int hashes, no medium, batch [ts, events]
class V9Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class V9Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V9Stored(V9Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class V9Removed(V9Event, tag="BlockRemoved"):
    block_hashes: list[int]


class V9Cleared(V9Event, tag="AllBlocksCleared"):
    pass


# ---- v0.11-0.2x: positional, ExternalBlockHash (bytes | int), medium, dp rank, later fields
class V11Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V11Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


# The fields of BlockStored and BlockRemoved from v0.11 on (the map encoding below has the
# same ones): ExternalBlockHash hashes, medium, and fields appended by later releases.
STORED_FIELDS = [
    ("block_hashes", list[bytes | int]),
    ("parent_block_hash", bytes | int | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
    ("lora_name", str | None),
    ("extra_keys", list[tuple[Any, ...] | None] | None, None),
    ("group_idx", int | None, None),
    # A field from a release newer than the decoder knows.
    ("kv_cache_spec_kind", str | None, None),
]
REMOVED_FIELDS = [("block_hashes", list[bytes | int]), ("medium", str | None),
                  ("group_idx", int | None, None)]

V11Stored = msgspec.defstruct("V11Stored", STORED_FIELDS, bases=(V11Event,), tag="BlockStored")
V11Removed = msgspec.defstruct("V11Removed", REMOVED_FIELDS, bases=(V11Event,),
                               tag="BlockRemoved")


# ---- after #42892: events are maps tagged under "type"; batch a map (main) or array (0.26)
class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


MapStored = msgspec.defstruct("MapStored", STORED_FIELDS, bases=(MapEvent,), tag="BlockStored")
MapRemoved = msgspec.defstruct("MapRemoved", REMOVED_FIELDS, bases=(MapEvent,),
                               tag="BlockRemoved")


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapPinned(MapEvent, tag="BlockPinned"):  # an event type this decoder never heard of
    block_hashes: list[int]


TOKENS = list(range(100, 164))  # 4 prefixmesh blocks
H = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32, b"\x04" * 32]  # sha256-sized vLLM hashes


def _decode(batch: msgspec.Struct):
    return decode_batch(ENC.encode(batch))


# --------------------------------------------------------------------------- decoding


def test_v09_positional_frames_decode() -> None:
    raw = ENC.encode(V9Batch(1.5, [V9Stored([11, 12], None, TOKENS[:32], 16, None),
                                   V9Removed([11]), V9Cleared()]))
    assert msgspec.msgpack.decode(raw)[1][0][0] == "BlockStored"  # really positional, tag first
    b = decode_batch(raw)
    assert b.ts == 1.5 and b.data_parallel_rank is None and b.skipped == 0
    assert b.events == [VllmBlockStored([11, 12], None, TOKENS[:32], 16),
                        VllmBlockRemoved([11]), VllmAllBlocksCleared()]


def test_v011_positional_frames_with_bytes_hashes_and_future_fields() -> None:
    b = _decode(V11Batch(2.0, [
        V11Stored(H[:2], None, TOKENS[:32], 16, None, "GPU", None, [None, None], 0, "full"),
        V11Removed([H[0]], "GPU")], data_parallel_rank=0))
    assert b.data_parallel_rank == 0
    stored, removed = b.events
    assert stored == VllmBlockStored(H[:2], None, TOKENS[:32], 16, None, "GPU", None,
                                     [None, None], 0)
    assert removed == VllmBlockRemoved([H[0]], "GPU")


def test_map_events_decode_in_array_and_map_batches() -> None:
    events = [MapStored([2**64 - 5], None, TOKENS[:16], 16, None, "GPU", None, [None], 0,
                        "full_attention"),
              MapRemoved([2**64 - 5], "GPU"), MapCleared()]
    for batch in (V11Batch(3.0, events, 0), MapBatch(3.0, events, 0)):  # v0.26 and main
        b = _decode(batch)
        assert [type(e) for e in b.events] == [VllmBlockStored, VllmBlockRemoved,
                                               VllmAllBlocksCleared]
        assert b.events[0].block_hashes == [2**64 - 5] and b.events[0].group_idx == 0


def test_unknown_and_malformed_events_are_skipped_not_fatal() -> None:
    b = _decode(MapBatch(1.0, [MapPinned([1]), ["BlockStored", "not-a-list"], 42,
                               MapCleared()]))
    assert b.events == [VllmAllBlocksCleared()] and b.skipped == 3


def test_earliest_num_toks_per_block_shape_is_accepted() -> None:
    b = decode_batch(ENC.encode([1.0, [["BlockStored", [7], None, TOKENS[:16], [16], None]]]))
    assert b.events[0].block_size == 16


@pytest.mark.parametrize("payload", [b"\xc1", ENC.encode({"nope": 1}), ENC.encode([1.0])])
def test_undecodable_batches_raise(payload: bytes) -> None:
    with pytest.raises(VllmEventError):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq(encode_seq(-1)) == -1  # the replay end marker
    with pytest.raises(VllmEventError):
        decode_seq(b"\x00")


def test_gaps_and_duplicates_are_detected() -> None:
    t = SeqTracker()
    assert t.gap_before(0) is None
    t.accept(0)
    assert t.gap_before(1) is None and t.is_duplicate(0)
    t.accept(1)
    assert t.gap_before(4) == SeqGap(2, 4)
    t.accept(4)
    assert t.is_duplicate(3) and not t.is_duplicate(5)
    assert SeqTracker().gap_before(3) == SeqGap(0, 3)  # slow joiner: 0..2 never arrived
    assert SeqTracker(first=None).gap_before(3) is None


# --------------------------------------------------------------------------- translation


def _stored(hashes, parent, tokens, bs=16, **kw) -> VllmBlockStored:
    return VllmBlockStored(hashes, parent, tokens, bs, **kw)


def test_stores_rehash_to_prefixmesh_hashes_through_the_parent_chain() -> None:
    tr = BlockTranslator()
    expect = block_hashes(TOKENS)
    out = tr.translate([_stored(H[:2], None, TOKENS[:32])])
    assert out == [BlockStored(expect[:2], None, TOKENS[:32], 16)]
    out = tr.translate([_stored(H[2:], H[1], TOKENS[32:])])
    assert out == [BlockStored(expect[2:], expect[1], TOKENS[32:], 16)]
    assert tr.cached_prefix_tokens(expect) == 64
    assert tr.cached_prefix_tokens(block_hashes(TOKENS, tenant="other")) == 0


def test_removal_is_translated_through_the_map() -> None:
    tr = BlockTranslator()
    expect = block_hashes(TOKENS)
    tr.translate([_stored(H, None, TOKENS)])
    assert tr.translate([VllmBlockRemoved([H[3], H[2]])]) == [BlockRemoved([expect[3],
                                                                            expect[2]])]
    assert tr.cached_prefix_tokens(expect) == 32
    assert tr.translate([VllmBlockRemoved([b"never-stored"])]) == []
    assert tr.unknown_removals == 1


def test_int_and_bytes_hashes_translate_alike() -> None:
    a, b = BlockTranslator(), BlockTranslator()
    ints = [-3, 2**64 - 1, 7, 8]
    assert a.translate([_stored(ints, None, TOKENS)]) == b.translate([_stored(H, None, TOKENS)])
    assert a.translate([VllmBlockRemoved([2**64 - 1])]) == \
        b.translate([VllmBlockRemoved([H[1]])])


def test_all_blocks_cleared_clears_the_map() -> None:
    tr = BlockTranslator()
    tr.translate([_stored(H, None, TOKENS)])
    assert tr.translate([VllmAllBlocksCleared()]) == [AllBlocksCleared()]
    assert tr.num_blocks == tr.num_vllm_blocks == 0
    assert tr.snapshot_events() == [AllBlocksCleared()]
    assert tr.translate([VllmBlockRemoved([H[0]])]) == []  # nothing left to remove
    assert tr.translate([_stored([H[1]], H[0], TOKENS[16:32])]) == []  # parent gone: orphan
    assert tr.orphans == 1


@pytest.mark.parametrize("vllm_bs", [8, 32, 48])
def test_vllm_block_sizes_other_than_16(vllm_bs: int) -> None:
    tokens = list(range(500, 500 + 96))
    n = len(tokens) // vllm_bs
    hs = [bytes([i + 1]) * 8 for i in range(n)]
    tr = BlockTranslator()
    got: list[int] = []
    for i, h in enumerate(hs):  # one event per vLLM block, each naming its parent
        out = tr.translate([_stored([h], hs[i - 1] if i else None,
                                    tokens[i * vllm_bs : (i + 1) * vllm_bs], vllm_bs)])
        got += [x for e in out for x in e.block_hashes]
    assert got == block_hashes(tokens)
    # Removing the last vLLM block drops exactly the prefixmesh blocks that end in it.
    last = tr.pm_hashes_of(hs[-1])
    assert tr.translate([VllmBlockRemoved([hs[-1]])]) == ([BlockRemoved(list(last))]
                                                          if last else [])


def test_duplicate_physical_copies_are_reference_counted() -> None:
    tr = BlockTranslator()
    tr.translate([_stored(H[:1], None, TOKENS[:16])])
    tr.translate([_stored(H[:1], None, TOKENS[:16])])  # a second copy of the same block
    assert tr.translate([VllmBlockRemoved([H[0]])]) == []
    assert tr.translate([VllmBlockRemoved([H[0]])]) == [BlockRemoved(block_hashes(TOKENS)[:1])]


def test_other_media_groups_and_lora_blocks_are_skipped() -> None:
    tr = BlockTranslator()
    assert tr.translate([_stored(H[:1], None, TOKENS[:16], medium="CPU"),
                         _stored(H[:1], None, TOKENS[:16], group_idx=1),
                         _stored(H[:1], None, TOKENS[:16], lora_id=3),
                         VllmBlockRemoved(H[:1], "CPU")]) == []
    assert tr.skipped == 4 and tr.num_blocks == 0
    assert tr.translate([_stored(H[:1], None, TOKENS[:16], medium="GPU", group_idx=0)])


def test_tenant_roots_from_hints_and_from_extra_keys() -> None:
    tr = BlockTranslator()
    tr.note_request("acme", TOKENS)
    acme = block_hashes(TOKENS, tenant="acme")
    # Older vLLM (no extra_keys): the tenant of the latest prompt with this first block.
    assert tr.translate([_stored(H[:1], None, TOKENS[:16])])[0].block_hashes == acme[:1]
    # Newer vLLM: the cache_salt in the first block's extra keys decides.
    out = tr.translate([_stored(H[1:2], None, TOKENS[:16], extra_keys=[None])])
    assert out[0].block_hashes == block_hashes(TOKENS)[:1]
    out = tr.translate([_stored(H[2:3], None, TOKENS[:16], extra_keys=[["acme"]])])
    assert out[0].block_hashes == acme[:1]
    assert tenant_salt("acme") != tenant_salt("")


def test_snapshot_rebuilds_the_cache_parents_first() -> None:
    tr = BlockTranslator()
    other = TOKENS[:32] + list(range(900, 932))  # shares the first two blocks
    tr.translate([_stored(H, None, TOKENS)])
    tr.translate([_stored([b"x", b"y"], H[1], other[32:])])
    snap = tr.snapshot_events()
    assert snap[0] == AllBlocksCleared()
    seen: set[int] = set()
    for ev in snap[1:]:
        assert ev.parent_block_hash is None or ev.parent_block_hash in seen
        assert len(ev.token_ids) == 16 * len(ev.block_hashes)
        seen.update(ev.block_hashes)
    assert seen == set(block_hashes(TOKENS)) | set(block_hashes(other))


def test_backend_vllm_without_vllm_fails_clearly() -> None:
    from prefixmesh.services.worker.config import WorkerConfig
    from prefixmesh.services.worker.engine.vllm_engine import missing_dependencies
    from prefixmesh.services.worker.service import WorkerService

    if missing_dependencies() is None:
        pytest.skip("vllm is installed here")
    with pytest.raises(SystemExit, match="--backend vllm needs vllm"):
        WorkerService(WorkerConfig(backend="vllm", worker_id="w"))
