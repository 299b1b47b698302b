"""The edge's lean HTTP/1.1 front (services/edge/front.py) on a real socket: what it answers
itself, what it hands to aiohttp, and that nothing is answered twice or out of order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from prefixmesh.services.edge.front import Answer, Declined, Front, parse_head

FAST = "/fast"


def test_parse_head_reads_a_plain_request_and_refuses_what_it_does_not_serve() -> None:
    assert parse_head(b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nX-A: 1\r\n"
                      b"x-a: 2") == ("POST", "/fast", {"host": "x", "content-length": "2",
                                                        "x-a": "1, 2"})
    for head in (b"POST /fast HTTP/1.0\r\nHost: x",           # another version
                 b"POST /fast\r\nHost: x",                     # no version
                 b"POST /fast HTTP/1.1\r\nno colon",           # not a header
                 b"POST /fast HTTP/1.1\r\nHost : x",           # space before the colon
                 b"POST /fast HTTP/1.1\r\nA: 1\r\n  folded",   # obsolete line folding
                 b"POST /fast HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1"):
        assert parse_head(head) is None, head


class _Served:
    """A Front on a free port: FAST answered by ``handle`` (echoes the body, waits on
    ``gate`` when the body says ``wait``), anything else by an aiohttp app."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []
        self.cancelled = 0
        self.gate = asyncio.Event()

    async def handle(self, path: str, headers: dict[str, str], body: bytes) -> Answer:
        self.calls.append(body)
        if body == b"wait":
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if body == b"decline":
            raise Declined
        if body == b"boom":
            raise RuntimeError("boom")
        return 200, {"x-seen": headers.get("x-tag", "")}, b'{"echo":"' + body + b'"}'


async def _aiohttp_route(request: web.Request) -> web.Response:
    return web.json_response({"aiohttp": request.path, "body": (await request.text())})


@pytest.fixture
async def served() -> AsyncIterator[tuple[_Served, Front, int]]:
    app = web.Application(client_max_size=64)
    app.router.add_route("*", "/{tail:.*}", _aiohttp_route)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    state = _Served()
    front = Front(runner.server, frozenset({FAST}), state.handle,
                  lambda path, body: b"stream" not in body, max_body=64)
    server = await asyncio.get_running_loop().create_server(front, "127.0.0.1", 0)
    try:
        yield state, front, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        front.close()
        await runner.cleanup()


async def _exchange(port: int, raw: bytes, answers: int) -> list[tuple[int, dict, bytes]]:
    """Send ``raw`` on one connection; read ``answers`` responses off it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    out = []
    try:
        for _ in range(answers):
            out.append(await asyncio.wait_for(_read_response(reader), 5))
    finally:
        writer.close()
    return out


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    while head[0].split(" ")[1] == "100":  # aiohttp's answer to Expect: 100-continue
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(head[0].split(" ")[1]), headers, body


def _post(body: bytes, path: str = FAST, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


async def test_the_front_answers_its_route_and_pipelined_requests_in_order(served) -> None:
    state, front, port = served
    # Two requests in one write, the first with a header the handler reads.
    answers = await _exchange(port, _post(b"one", extra="X-Tag: t1\r\n") + _post(b"two"), 2)
    assert [a[0] for a in answers] == [200, 200]
    assert [a[2] for a in answers] == [b'{"echo":"one"}', b'{"echo":"two"}']
    assert answers[0][1]["x-seen"] == "t1" and answers[0][1]["content-type"] == (
        "application/json") and "date" in answers[0][1]
    assert state.calls == [b"one", b"two"] and (front.answered, front.handed_off) == (2, 0)


async def test_a_request_the_front_does_not_take_hands_the_connection_to_aiohttp(
        served) -> None:
    state, front, port = served
    # A GET between two fast POSTs: the first POST is the front's; from the GET on, the
    # connection is aiohttp's (the POST after it too).
    get = b"GET /models HTTP/1.1\r\nHost: t\r\n\r\n"
    answers = await _exchange(port, _post(b"a") + get + _post(b"b"), 3)
    assert answers[0][2] == b'{"echo":"a"}'
    assert b'"aiohttp": "/models"' in answers[1][2]
    assert b'"aiohttp": "/fast"' in answers[2][2] and b'"body": "b"' in answers[2][2]
    assert state.calls == [b"a"] and (front.answered, front.handed_off) == (1, 1)


@pytest.mark.parametrize("raw", [
    _post(b'{"stream":true}'),                        # the caller turns it down
    _post(b"x", path="/fast?q=1"),                      # not exactly the route
    b"POST /fast HTTP/1.0\r\nContent-Length: 1\r\n\r\nx",
    b"POST /fast HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    _post(b"x", extra="Expect: 100-continue\r\n"),
])
async def test_what_the_front_does_not_serve_is_answered_by_aiohttp(served, raw) -> None:
    state, front, port = served
    [(status, _, body)] = await _exchange(port, raw, 1)
    assert status == 200 and b'"aiohttp"' in body
    assert state.calls == [] and front.handed_off == 1


async def test_a_request_the_handler_declines_is_answered_by_aiohttp_whole(served) -> None:
    state, front, port = served
    answers = await _exchange(port, _post(b"decline", extra="X-Tag: t\r\n") + _post(b"z"), 2)
    assert [b'"body": "decline"' in answers[0][2], b'"body": "z"' in answers[1][2]] == [
        True, True]
    assert state.calls == [b"decline"] and (front.answered, front.handed_off) == (0, 1)


async def test_a_body_over_the_limit_gets_aiohttps_413(served) -> None:
    state, front, port = served
    [(status, _, _)] = await _exchange(port, _post(b"x" * 65), 1)
    assert status == 413 and state.calls == []


async def test_connection_close_is_honoured_and_a_failing_handler_is_a_500(served) -> None:
    state, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_post(b"boom") + _post(b"late", extra="Connection: close\r\n"))
    assert (await _read_response(reader))[0] == 500
    status, headers, _ = await _read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await reader.read() == b""  # the server closed the connection
    writer.close()


async def test_a_client_that_goes_away_cancels_its_request(served) -> None:
    state, front, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_post(b"wait"))
    while not state.calls:
        await asyncio.sleep(0.01)
    writer.close()
    for _ in range(500):
        if state.cancelled:
            break
        await asyncio.sleep(0.01)
    assert state.cancelled == 1 and not front.connections
