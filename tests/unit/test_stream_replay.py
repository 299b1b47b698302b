"""A worker's stream journal: what a ResumeRequest resends (services/worker/replay.py)."""


from prefixmesh.services.worker.replay import FinishedJournals, StreamJournal
from prefixmesh.shared.wire import GenerateChunkEvent, RequestDoneEvent, TokenLogprob


def chunk(index, tokens, text, cached=0, logprobs=()):
    return GenerateChunkEvent(request_id="r", token_ids=list(tokens), text=text, index=index,
                              cached_tokens=cached, logprobs=list(logprobs))


def journal():
    j = StreamJournal("reply.r")
    j.record(chunk(0, [1], "a", cached=16))
    j.record(chunk(1, [2, 3], "bc", cached=16))
    j.record(chunk(3, [4], "d", cached=16))
    return j


def test_replay_from_a_chunk_boundary_merges_the_rest_into_one_chunk():
    (ev,) = journal().replay("r", 1)
    assert (ev.index, ev.token_ids, ev.text, ev.cached_tokens) == (1, [2, 3, 4], "bcd", 16)
    (ev,) = journal().replay("r", 0)
    assert (ev.token_ids, ev.text) == ([1, 2, 3, 4], "abcd")


def test_replay_inside_a_chunk_starts_at_its_boundary():
    (ev,) = journal().replay("r", 2)  # the edge drops token 2 again by index
    assert (ev.index, ev.token_ids, ev.text) == (1, [2, 3, 4], "bcd")


def test_replay_of_a_complete_stream_is_the_done_event_alone():
    j = journal()
    assert j.replay("r", 4) == []  # running, nothing missing
    done = RequestDoneEvent(request_id="r", worker_id="w", finish_reason="stop",
                             completion_tokens=4)
    j.record(done)
    assert j.replay("r", 4) == [done]
    events = j.replay("r", 3)
    assert events[0].token_ids == [4] and events[1] is done


def test_logprobs_are_resent_with_their_tokens():
    lp = [TokenLogprob(token_id=t, token=str(t), logprob=-float(t)) for t in (1, 2, 3)]
    j = StreamJournal("x")
    j.record(chunk(0, [1], "a", logprobs=lp[:1]))
    j.record(chunk(1, [2, 3], "bc", logprobs=lp[1:]))
    (ev,) = j.replay("r", 1)
    assert [e.token_id for e in ev.logprobs] == [2, 3]


def test_finished_journals_expire_by_age_and_count():
    f = FinishedJournals(ttl_s=10.0, max_entries=2)
    a, b, c = StreamJournal("a"), StreamJournal("b"), StreamJournal("c")
    f.add("a", a, now=0.0)
    f.add("b", b, now=1.0)
    assert f.get("a") is a and f.get("b") is b
    f.add("c", c, now=2.0)  # over the count: the oldest goes
    assert f.get("a") is None and f.get("c") is c
    f.expire(now=11.5)  # b's 10 s are up, c's are not
    assert f.get("b") is None and f.get("c") is c and len(f) == 1
