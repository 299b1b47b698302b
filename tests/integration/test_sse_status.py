"""The status an edge counts for a streamed answer: a handler cancelled once ``data: [DONE]``
went out (its client closed on it) gave its answer (200); one whose client left mid-stream
did not (499)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from prefixmesh.shared.openai.http import (
    CLIENT_CLOSED,
    close_sse,
    errors_middleware,
    open_sse,
    send_sse,
)
from prefixmesh.shared.runtime.servers import free_port
from tests.helpers import eventually


async def test_a_client_leaving_on_done_is_answered_one_leaving_early_is_not() -> None:
    statuses: list[tuple[str, int]] = []
    release = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = await open_sse(request)
        await send_sse(resp, {"n": 1})
        if request.query.get("hold") == "before":
            await release.wait()  # the client leaves here, before the end
        await close_sse(request, resp)
        if request.query.get("hold") == "after":
            # The client's leave lands after [DONE] went out (in the stream's last write,
            # say): the handler is cancelled at its next await, as aiohttp does.
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)
        return resp

    app = web.Application(middlewares=[errors_middleware(
        lambda route, status: statuses.append((route, status)))])
    app.router.add_post("/s", stream)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)
                                         ) as session:
            for hold, want, leave_on in (("after", 200, b"data: [DONE]"),
                                         ("before", CLIENT_CLOSED, b"data: {")):
                statuses.clear()
                got = []
                async with session.post(f"http://127.0.0.1:{port}/s?hold={hold}") as r:
                    try:
                        async for line in r.content:
                            got.append(line)
                            if line.startswith(leave_on):
                                break  # the client closes here, without draining the rest
                    except aiohttp.ClientError:
                        pass  # the server ended the connection as the client left
                    r.close()
                assert got and got[-1].startswith(leave_on)
                await eventually(lambda: bool(statuses), timeout=5)
                assert statuses == [("/s", want)]
    finally:
        release.set()
        await runner.cleanup()
