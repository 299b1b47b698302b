"""A batch of placements on its way to its workers (services/scheduler/place_batch.py):
shares in the batch's order, answers put back in place, failures as retriable refusals."""

from __future__ import annotations

import msgspec

from prefixmesh.services.scheduler.place_batch import PlaceBatch
from prefixmesh.shared.wire import (
    PLACE_REQUEST,
    ErrorInfo,
    RouteReply,
    SamplingParams,
    SubmitBatch,
    SubmitReplies,
    SubmitReply,
    TokenizedRequest,
    encode,
)


def _reqs(n: int) -> list[TokenizedRequest]:
    return [TokenizedRequest(request_id=f"r{i}", token_ids=[i], sampling=SamplingParams())
            for i in range(n)]


def _answers(data: bytes) -> list[SubmitReply]:
    return msgspec.msgpack.decode(data, type=SubmitReplies).replies


def test_each_worker_gets_its_share_and_the_edge_every_answer_in_order() -> None:
    reqs = _reqs(4)
    none = ErrorInfo("no worker serves the model", "unavailable")
    placement = PlaceBatch(reqs, [RouteReply(request_id="r0", worker_id="a"),
                                 RouteReply(request_id="r1", worker_id="b"),
                                 RouteReply(request_id="r2", error=none),
                                 RouteReply(request_id="r3", worker_id="a")])
    assert placement.shares == {"a": [0, 3], "b": [1]}
    sent = PLACE_REQUEST.decode(placement.message("a", b"whole"))
    assert [r.request_id for r in sent.requests] == ["r0", "r3"]
    # a answers first (r3 refused as full), b last: only then is the edge answered.
    assert not placement.take("a", encode(SubmitReplies(replies=[
        SubmitReply(request_id="r0", worker_id="a"),
        SubmitReply(request_id="r3", worker_id="a", accepted=False,
                    error=ErrorInfo("worker queue full (8)", "overloaded", retriable=True))])))
    assert placement.take("b", encode(SubmitReplies(replies=[
        SubmitReply(request_id="r1", worker_id="b")])))
    got = _answers(placement.answer())
    assert [(r.request_id, r.worker_id, r.accepted) for r in got] == [
        ("r0", "a", True), ("r1", "b", True), ("r2", "", False), ("r3", "a", False)]
    assert got[2].error == none and got[3].error.code == "overloaded"


def test_a_worker_that_takes_every_request_is_sent_the_edges_message_as_it_is() -> None:
    reqs = _reqs(2)
    placement = PlaceBatch(reqs, [RouteReply(request_id=r.request_id, worker_id="a")
                                 for r in reqs])
    whole = encode(SubmitBatch(requests=reqs))
    assert placement.message("a", whole) is whole


def test_a_worker_gone_silent_or_answering_wrong_refuses_its_share_naming_itself() -> None:
    reqs = _reqs(5)
    workers = ["gone", "bad", "short", "gone", "ok"]
    placement = PlaceBatch(reqs, [RouteReply(request_id=r.request_id, worker_id=w)
                                 for r, w in zip(reqs, workers)])
    assert not placement.take("gone", None, "no responders on pm.worker.gone.submit")
    # One reply for the whole message, and a count that does not match, answer nothing.
    assert not placement.take("bad", encode(SubmitReply(request_id="", accepted=False,
                                                        error=ErrorInfo("x", "bad_request"))))
    assert not placement.take("short", encode(SubmitReplies(replies=[])))
    assert placement.take("ok", encode(SubmitReplies(replies=[
        SubmitReply(request_id="r4", worker_id="ok")])))
    got = _answers(placement.answer())
    assert [(r.worker_id, r.accepted) for r in got] == [
        ("gone", False), ("bad", False), ("short", False), ("gone", False), ("ok", True)]
    assert all(r.error.code == "unavailable" and r.error.retriable for r in got[:4])
    assert "no responders" in got[0].error.message and "no responders" in got[3].error.message
