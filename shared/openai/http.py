"""The HTTP side of the OpenAI protocol (aiohttp): errors as OpenAI JSON, bodies, SSE."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from prefixmesh.shared.openai.schema import ApiError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# (route, status) of every answered request; status 499 when the client went away.
StatusSink = Callable[[str, int], None]

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Status recorded for requests whose client disconnected before the answer (nginx's 499).
CLIENT_CLOSED = 499
# Request key: the status of a streamed answer whose end (``[DONE]``) was written.
ANSWERED = web.RequestKey("prefixmesh.answered", int)


def error_response(err: ApiError) -> web.Response:
    """``err`` as OpenAI's error body with its status and headers."""
    return web.json_response(err.body(), status=err.status, headers=err.headers)


def errors_middleware(on_status: StatusSink | None = None) -> Any:
    """Every error leaves as OpenAI-shaped JSON with the right status, never a bare 500;
    ``on_status`` sees the route and status of every request (metrics)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        try:
            resp = await handler(request)
        except asyncio.CancelledError:  # the client went away (its request was aborted)
            if on_status is not None:
                on_status(route, request.get(ANSWERED, CLIENT_CLOSED))
            raise
        except ApiError as err:
            resp = error_response(err)
        except web.HTTPRequestEntityTooLarge as exc:
            resp = error_response(ApiError(413, f"request body too large: {exc.text}",
                                           code="request_too_large"))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            msg = f"{request.method} {request.path}: {exc.reason}"
            resp = error_response(ApiError(exc.status, msg, type=kind, headers={
                k: v for k, v in exc.headers.items() if k.lower() == "allow"}))
        except Exception:
            log.exception("unhandled error on %s", request.path)
            resp = error_response(ApiError(500, "internal error", type="internal_error"))
        if on_status is not None:
            on_status(route, resp.status)
        return resp

    return middleware


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body; a 413 in OpenAI's shape above ``limit`` bytes (the app's
    ``client_max_size``)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body exceeds {limit} bytes",
                       code="request_too_large") from None


async def open_sse(request: web.Request, headers: dict[str, str] | None = None
                   ) -> web.StreamResponse:
    """Start a server-sent-events response."""
    resp = web.StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
    await resp.prepare(request)
    return resp


async def send_sse(resp: web.StreamResponse, obj: Any) -> None:
    """One ``data:`` event holding ``obj`` as compact JSON."""
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


async def close_sse(request: web.Request, resp: web.StreamResponse) -> None:
    """End the stream as OpenAI does: ``data: [DONE]``. From then on the answer counts
    as given (``errors_middleware``): a client that closes the connection on ``[DONE]``,
    before the stream's last bytes, went away with everything."""
    await resp.write(b"data: [DONE]\n\n")
    request[ANSWERED] = resp.status
    await resp.write_eof()
