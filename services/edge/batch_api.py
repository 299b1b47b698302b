"""OpenAI's Files and Batch routes on the edge (``/v1/files``, ``/v1/batches``).

Handlers validate and talk to the durable ``BatchStore``; execution belongs to the
``BatchRunner``. Shapes follow OpenAI's API so the official client's ``files.create``,
``files.content``, ``batches.create/retrieve/cancel/list`` work unchanged.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from prefixmesh.services.edge.batch_format import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    MAX_METADATA,
    VALIDATING,
    WINDOW_S,
    BatchRecord,
    FileRecord,
    count_lines,
    new_id,
)
from prefixmesh.services.edge.batch_runner import BatchRunner
from prefixmesh.services.edge.batch_store import BatchStore
from prefixmesh.shared.openai.schema import ApiError

STORE = web.AppKey("batch_store", BatchStore)
RUNNER = web.AppKey("batch_runner", BatchRunner)

# Purposes accepted on upload (OpenAI has more; only batch input is useful here).
UPLOAD_PURPOSES = ("batch",)
# Page size of GET /v1/batches when ``limit`` is absent, and its maximum.
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100


# The Files and Batch routes (each handler names its own); add_batch_routes adds them.
ROUTES = web.RouteTableDef()


def _store(request: web.Request) -> BatchStore:
    return request.app[STORE]


@ROUTES.post("/v1/files")
async def create_file(request: web.Request) -> web.Response:
    """POST /v1/files (multipart: ``file``, ``purpose``)."""
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "upload a file as multipart/form-data with fields file and purpose")
    form = await request.post()
    purpose = form.get("purpose")
    upload = form.get("file")
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}",
                       param="purpose")
    if not isinstance(upload, web.FileField):
        raise ApiError(400, "missing file field `file`", param="file")
    data = upload.file.read()
    if not data.strip():
        raise ApiError(400, "the file is empty", param="file")
    rec = FileRecord(id=new_id("file"), bytes=len(data), created_at=int(time.time()),
                     filename=upload.filename or "upload.jsonl", purpose=str(purpose),
                     lines=count_lines(data))
    await _store(request).put_file(rec, data)
    return web.json_response(rec.to_openai())


def _not_found(kind: str, param: str, object_id: str) -> ApiError:
    """OpenAI's 404 for an unknown File or Batch id."""
    return ApiError(404, f"No such {kind} object: {object_id}", param=param, code="not_found",
                    type="not_found_error")


async def _file(request: web.Request) -> FileRecord:
    fid = request.match_info["file_id"]
    rec = await _store(request).get_file(fid)
    if rec is None:
        raise _not_found("File", "file_id", fid)
    return rec


@ROUTES.get("/v1/files/{file_id}")
async def get_file(request: web.Request) -> web.Response:
    """GET /v1/files/{file_id}."""
    return web.json_response((await _file(request)).to_openai())


@ROUTES.get("/v1/files/{file_id}/content")
async def file_content(request: web.Request) -> web.Response:
    """GET /v1/files/{file_id}/content: the raw bytes (JSONL)."""
    rec = await _file(request)
    data = await _store(request).file_content(rec.id)
    return web.Response(body=data, content_type="application/jsonl",
                        headers={"Content-Disposition": f'attachment; filename="{rec.filename}"'})


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"null")
    except ValueError as exc:
        raise ApiError(400, f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


@ROUTES.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    """POST /v1/batches: {input_file_id, endpoint, completion_window, metadata?}."""
    body = await _json(request)
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    window = body.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise ApiError(400, "completion_window must be 24h", param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise ApiError(400, f"metadata must map at most {MAX_METADATA} keys to strings",
                       param="metadata")
    fid = body.get("input_file_id")
    store = _store(request)
    frec = await store.get_file(fid) if isinstance(fid, str) else None
    if frec is None or not isinstance(fid, str):  # not a string: no such file either
        raise ApiError(400, f"input file {fid!r} does not exist", param="input_file_id",
                       code="invalid_file")
    if frec.purpose != "batch":
        raise ApiError(400, "the input file's purpose must be batch", param="input_file_id")
    now = int(time.time())
    rec = BatchRecord(id=new_id("batch"), endpoint=endpoint, input_file_id=fid,
                      completion_window=window, status=VALIDATING, created_at=now,
                      expires_at=now + WINDOW_S, metadata=metadata)
    rec.request_counts.total = frec.lines
    await store.put_batch(rec)
    request.app[RUNNER].submit(rec)
    return web.json_response(rec.to_openai())


async def _batch(request: web.Request) -> BatchRecord:
    bid = request.match_info["batch_id"]
    rec = request.app[RUNNER].record_of(bid) or await _store(request).get_batch(bid)
    if rec is None:
        raise _not_found("Batch", "batch_id", bid)
    return rec


@ROUTES.get("/v1/batches/{batch_id}")
async def get_batch(request: web.Request) -> web.Response:
    """GET /v1/batches/{batch_id}: status and request counts."""
    return web.json_response((await _batch(request)).to_openai())


@ROUTES.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    """POST /v1/batches/{batch_id}/cancel: ``cancelling`` now, ``cancelled`` once drained."""
    rec = await request.app[RUNNER].cancel(await _batch(request))
    return web.json_response(rec.to_openai())


@ROUTES.get("/v1/batches")
async def list_batches(request: web.Request) -> web.Response:
    """GET /v1/batches?limit=&after=: newest first, cursor pagination by id."""
    try:
        limit = int(request.query.get("limit", DEFAULT_LIST_LIMIT))
    except ValueError:
        raise ApiError(400, "limit must be an integer", param="limit") from None
    limit = max(1, min(limit, MAX_LIST_LIMIT))
    recs = await _store(request).list_batches()
    after = request.query.get("after")
    if after:
        ids = [r.id for r in recs]
        recs = recs[ids.index(after) + 1:] if after in ids else []
    page = recs[:limit]
    return web.json_response({
        "object": "list", "data": [r.to_openai() for r in page],
        "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
        "has_more": len(recs) > limit})


def add_batch_routes(app: web.Application, store: BatchStore, runner: BatchRunner) -> None:
    """Register the Files and Batch routes on the edge's application."""
    app[STORE] = store
    app[RUNNER] = runner
    app.add_routes(ROUTES)
