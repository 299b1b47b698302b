"""One edge's batch of placements (``sched.place``) on its way to the chosen workers.

Pure bookkeeping, no I/O: the scheduler service decides the requests, sends each worker
its share (``message``) and hands each worker's answer (or why none came) to ``take``;
once every worker has answered, ``answer`` is what goes back to the edge.
"""

from __future__ import annotations

from prefixmesh.shared.wire import (
    ErrorInfo,
    RouteReply,
    SubmitBatch,
    SubmitReplies,
    SubmitReply,
    TokenizedRequest,
    encode,
    submit_replies,
)


class PlaceBatch:
    """The requests of one ``SubmitBatch`` and their decisions: each request's reply so far
    (the scheduler's own refusal where it chose no worker) and each chosen worker's
    share, in the batch's order."""

    def __init__(self, requests: list[TokenizedRequest], decisions: list[RouteReply]) -> None:
        self.requests = requests
        self.replies = [SubmitReply(request_id=r.request_id, worker_id=d.worker_id,
                                    accepted=False, error=d.error)
                        for r, d in zip(requests, decisions, strict=True)]
        self.shares: dict[str, list[int]] = {}
        for i, d in enumerate(decisions):
            if d.worker_id:
                self.shares.setdefault(d.worker_id, []).append(i)
        # Workers whose answer has not been taken yet.
        self.waiting = len(self.shares)

    def message(self, worker: str, whole: bytes) -> bytes:
        """What ``worker`` is sent: its share as a ``SubmitBatch``; ``whole`` (the edge's
        own message) when its share is every request."""
        share = self.shares[worker]
        if len(share) == len(self.requests):
            return whole
        return encode(SubmitBatch(requests=[self.requests[i] for i in share]))

    def take(self, worker: str, data: bytes | None, why: str = "") -> bool:
        """``worker``'s answer to its share (``data``), or ``why`` none came (data None):
        each request of the share is then a retriable refusal naming the worker, and so
        is every one of an answer that is not one reply per request. True once every
        worker has answered."""
        share = self.shares[worker]
        mine = [self.requests[i] for i in share]
        try:
            if data is None:
                raise ValueError(why)
            got = submit_replies(data)
            if len(got) != len(mine):
                raise ValueError(f"{len(got)} answers to {len(mine)} requests")
        except ValueError as exc:  # msgspec's DecodeError is a ValueError too
            got = [SubmitReply(request_id=r.request_id, worker_id=worker, accepted=False,
                               error=ErrorInfo(str(exc), "unavailable", retriable=True))
                   for r in mine]
        for i, reply in zip(share, got, strict=True):
            self.replies[i] = reply
        self.waiting -= 1
        return self.waiting == 0

    def answer(self) -> bytes:
        """The edge's answer: every request's ``SubmitReply``, in order."""
        return encode(SubmitReplies(replies=self.replies))
