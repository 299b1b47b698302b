"""The pure parts of the router path: the edge's event queue, routing batches on the wire,
batch limits, what a prompt costs to tokenize."""

from __future__ import annotations

import asyncio

import pytest

from prefixmesh.services.edge.streams import EventQueue
from prefixmesh.shared.bus import BatchLimits, RequestBatcher
from prefixmesh.shared.text.requests import prompt_chars
from prefixmesh.shared.wire import (
    ROUTE_REQUEST,
    ChatMessage,
    GenerateChunkEvent,
    RequestDoneEvent,
    RouteBatchReply,
    RouteBatchRequest,
    RouteReply,
    SamplingParams,
    TokenizedRequest,
    TokenizeRequest,
    encode,
    route_message,
    route_replies,
)


def _req(rid: str) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, token_ids=[], sampling=SamplingParams(),
                            block_hashes=[1, 2], prompt_tokens=40)


async def test_event_queue_gives_events_in_order_and_none_after_its_timeout() -> None:
    q = EventQueue()
    assert await q.get(0.01) is None  # nothing came: the timer ends the wait
    chunk = GenerateChunkEvent(request_id="r", token_ids=[1])
    done = RequestDoneEvent(request_id="r", worker_id="w")
    q.put_nowait(chunk)
    q.put_nowait(done)
    assert await q.get(0.01) is chunk
    assert await q.get(0.01) is done


async def test_event_queue_wakes_a_waiting_reader_at_once() -> None:
    q = EventQueue()
    reader = asyncio.ensure_future(q.get(30.0))
    await asyncio.sleep(0)
    assert not reader.done()
    event = GenerateChunkEvent(request_id="r", token_ids=[7])
    q.put_nowait(event)
    assert await asyncio.wait_for(reader, 1.0) is event


def test_one_routing_request_travels_as_itself_and_several_as_a_batch() -> None:
    one = route_message([_req("a")])
    assert isinstance(one, TokenizedRequest)  # what any scheduler reads
    many = route_message([_req("a"), _req("b")])
    assert isinstance(many, RouteBatchRequest)
    decoded = ROUTE_REQUEST.decode(encode(many))
    assert isinstance(decoded, RouteBatchRequest)
    assert [r.request_id for r in decoded.requests] == ["a", "b"]


def test_route_replies_reads_a_single_reply_and_a_batch_in_order() -> None:
    single = RouteReply(request_id="a", worker_id="w0")
    assert route_replies(encode(single)) == [single]
    batch = RouteBatchReply(replies=[RouteReply(request_id=r, worker_id="w1") for r in "xyz"])
    assert [r.request_id for r in route_replies(encode(batch))] == ["x", "y", "z"]


@pytest.mark.parametrize("limits", [{"max_batch": 0}, {"max_inflight": 0}])
def test_a_batcher_refuses_nonsense_limits(limits: dict) -> None:
    with pytest.raises(ValueError):
        RequestBatcher(None, "subject", route_message, route_replies, 1.0,  # type: ignore[arg-type]
                       BatchLimits(**limits))


def test_prompt_chars_counts_text_or_every_message() -> None:
    assert prompt_chars(TokenizeRequest(request_id="r", text="hello")) == 5
    msgs = [ChatMessage(role="system", content="ab"), ChatMessage(role="user", content="cde")]
    assert prompt_chars(TokenizeRequest(request_id="r", messages=msgs)) == 5
