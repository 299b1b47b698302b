"""Wire messages: round trips, tagged unions, and schema evolution."""

import msgspec
import pytest

from prefixmesh.shared import wire as m
from prefixmesh.shared.blocks import pack_hashes, unpack_hashes


def test_worker_union_round_trip_picks_the_right_type() -> None:
    gen = m.TokenizedRequest(request_id="r1", token_ids=[1, 2, 3],
                             sampling=m.SamplingParams(max_tokens=5, ignore_eos=True),
                             reply_to="pm.stream.e.r1")
    abort = m.AbortRequest(request_id="r1")
    assert m.WORKER_REQUEST.decode(m.encode(gen)) == gen
    assert m.WORKER_REQUEST.decode(m.encode(abort)) == abort


def test_one_tokenized_request_is_routed_and_submitted() -> None:
    """The scheduler's decoder and the worker's read the same message."""
    req = m.TokenizedRequest(request_id="r1", token_ids=list(range(40)),
                             sampling=m.SamplingParams(max_tokens=5), block_hashes=[9, 8],
                             tenant="t", exclude=["w1"])
    blob = m.encode(req)
    assert m.ROUTE_REQUEST.decode(blob) == req == m.WORKER_REQUEST.decode(blob)
    # The edge routes it without the ids, its length in prompt_tokens: far fewer bytes.
    route = msgspec.structs.replace(req, token_ids=[], prompt_tokens=40)
    assert m.ROUTE_REQUEST.decode(m.encode(route)).prompt_tokens == 40
    assert len(m.encode(route)) < len(blob)


def test_the_routing_copy_carries_the_hashes_packed_and_no_token_ids() -> None:
    hashes = [-(2**63), -1, 0, 7, 2**63 - 1]
    req = m.TokenizedRequest(request_id="r1", token_ids=list(range(80)),
                             sampling=m.SamplingParams(max_tokens=5), block_hashes=hashes,
                             prompt_tokens=80, tenant="t")
    route = m.ROUTE_REQUEST.decode(m.encode(m.routing_copy(req)))
    assert isinstance(route, m.TokenizedRequest)
    assert route.token_ids == [] and route.block_hashes == []
    assert list(unpack_hashes(route.packed_hashes)) == hashes
    assert (route.prompt_tokens, route.tenant, route.sampling) == (80, "t", req.sampling)
    # A hash past 64 bits (not a prefixmesh hash) keeps the list.
    wide = msgspec.structs.replace(req, block_hashes=[2**64 - 1, 5])
    kept = m.routing_copy(wide)
    assert kept.packed_hashes == b"" and kept.block_hashes == [2**64 - 1, 5]
    assert kept.token_ids == []


def test_packed_hashes_are_little_endian_int64s_whatever_the_machine() -> None:
    assert pack_hashes([1, -2]) == (1).to_bytes(8, "little") + (-2).to_bytes(
        8, "little", signed=True)
    assert list(unpack_hashes(bytes(8) + b"\xff" * 8)) == [0, -1]


def test_one_done_event_for_the_stream_and_the_done_subject() -> None:
    done = m.RequestDoneEvent(request_id="r", worker_id="w0", prompt_tokens=40,
                              completion_tokens=5, cached_tokens=32, tenant="t")
    blob = m.encode(done)
    assert m.STREAM_EVENT.decode(blob) == done == m.BUS_EVENT.decode(blob)


def test_stream_union_distinguishes_chunk_and_done() -> None:
    chunk = m.GenerateChunkEvent(request_id="r", token_ids=[7], text="hi")
    done = m.RequestDoneEvent(request_id="r", worker_id="w0", cached_tokens=32)
    assert isinstance(m.STREAM_EVENT.decode(m.encode(chunk)), m.GenerateChunkEvent)
    assert m.STREAM_EVENT.decode(m.encode(done)).cached_tokens == 32


def test_kv_events_follow_vllm_schema_and_nest_in_batches() -> None:
    batch = m.KvEventBatch(worker_id="w0", seq=7, ts=1.5, events=[
        m.BlockStored(block_hashes=[11, 12], parent_block_hash=None,
                      token_ids=list(range(32)), block_size=16),
        m.BlockRemoved(block_hashes=[11]),
        m.AllBlocksCleared(),
    ])
    decoded = m.BUS_EVENT.decode(m.encode(batch))
    assert decoded == batch
    assert [type(e).__name__ for e in decoded.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_message_on_wrong_subject_is_rejected() -> None:
    route = m.RouteReply(request_id="r", worker_id="w0")
    with pytest.raises(msgspec.ValidationError):
        m.WORKER_REQUEST.decode(m.encode(route))


def test_old_reader_ignores_new_fields_and_new_reader_defaults_missing_ones() -> None:
    """Schema evolution: fields are only added at the end, with defaults."""

    class RouteReplyV2(msgspec.Struct, tag="RouteReply", omit_defaults=True):
        request_id: str
        worker_id: str = ""
        decision: str = ""
        matched_tokens: int = 0
        error: m.ErrorInfo | None = None
        future_field: int = 5

    new = msgspec.msgpack.encode(RouteReplyV2(request_id="r", worker_id="w", future_field=9))
    assert m.ROUTE_REPLY.decode(new) == m.RouteReply(request_id="r", worker_id="w")
    old = m.encode(m.RouteReply(request_id="r", worker_id="w"))
    assert msgspec.msgpack.decode(old, type=RouteReplyV2).future_field == 5


def test_submit_replies_reads_one_answer_per_request_of_a_batch() -> None:
    reqs = [m.TokenizedRequest(request_id=f"r{i}", token_ids=[i], sampling=m.SamplingParams())
            for i in range(3)]
    answers = m.SubmitReplies(replies=[m.SubmitReply(request_id=r.request_id, worker_id="w")
                                       for r in reqs])
    assert m.submit_replies(m.encode(answers)) == answers.replies
    # One reply for the whole message (a receiver that could not read it) answers none.
    refusal = m.SubmitReply(request_id="", worker_id="w", accepted=False,
                            error=m.ErrorInfo("malformed request: x", "bad_request"))
    with pytest.raises(ValueError, match="answered as a whole: malformed request: x"):
        m.submit_replies(m.encode(refusal))
    # A worker reads a SubmitBatch on its submit subject.
    batch = m.SubmitBatch(requests=reqs)
    assert m.WORKER_REQUEST.decode(m.encode(batch)) == batch
