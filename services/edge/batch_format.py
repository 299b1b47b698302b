"""OpenAI Batch API shapes (pure): stored records, input-line parsing, output lines.

Records are stored as JSON (``msgspec.json``) in the JetStream KV bucket of
``batch_store``; ``to_openai()`` gives the exact object OpenAI's API returns, so the
official client's ``files`` and ``batches`` calls parse them.

Input lines (one JSON object per line, as OpenAI's):
``{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``.
Output lines: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}``; failed lines go to the error file with ``response`` carrying the error
status and body, and ``error`` {"code", "message"}.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from prefixmesh.shared.openai.schema import ApiError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = ("24h",)
# Batch states, OpenAI's names. Terminal ones never change again.
VALIDATING, FAILED, IN_PROGRESS, FINALIZING = "validating", "failed", "in_progress", "finalizing"
COMPLETED, EXPIRED, CANCELLING, CANCELLED = "completed", "expired", "cancelling", "cancelled"
TERMINAL = frozenset({FAILED, COMPLETED, EXPIRED, CANCELLED})
# Seconds in the only completion window OpenAI offers (24 h).
WINDOW_S = 24 * 3600
# Most lines in one batch (OpenAI's limit is 50,000).
MAX_LINES = 50_000
# Most metadata pairs on a batch (OpenAI: 16).
MAX_METADATA = 16


def new_id(kind: str) -> str:
    """A fresh id: ``file-<hex>``, ``batch_<hex>``, ``batch_req_<hex>`` (subject-safe)."""
    sep = "-" if kind == "file" else "_"
    return f"{kind}{sep}{uuid.uuid4().hex}"


class FileRecord(msgspec.Struct, omit_defaults=True):
    """An uploaded (or produced) file's metadata; its bytes live in the object store."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    # Lines parsed from an upload (0 for output files).
    lines: int = 0

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": None}


class RequestCounts(msgspec.Struct):
    """Lines of a batch: all, finished with a 2xx, finished with an error."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchRecord(msgspec.Struct, omit_defaults=True):
    """One batch, as stored; ``to_openai`` is the API's Batch object."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    expires_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    # Validation errors (status "failed"): [{"code", "message", "line", "param"}].
    errors: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    # prefixmesh extension: the planner's token-saving ratios and balance for this batch.
    plan: dict[str, float] | None = None

    def to_openai(self) -> dict[str, Any]:
        d = msgspec.to_builtins(self)
        d.pop("plan", None)
        out: dict[str, Any] = {"object": "batch", **{k: None for k in _NULLABLE}, **d}
        out["errors"] = ({"object": "list", "data": self.errors} if self.errors else None)
        out["metadata"] = self.metadata
        if self.plan is not None:
            out["prefixmesh_plan"] = self.plan
        return out


_NULLABLE = ("expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
             "expired_at", "cancelling_at", "cancelled_at", "output_file_id", "error_file_id")


class LineResult(msgspec.Struct, omit_defaults=True):
    """The outcome of one batch line, stored once (idempotency key: batch id + line)."""

    custom_id: str
    status_code: int
    request_id: str
    # The response body (2xx) or the OpenAI error body.
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


class BatchLine(msgspec.Struct):
    """One parsed input line."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class LineError(msgspec.Struct):
    """A validation error of one input line (1-based ``line``)."""

    code: str
    message: str
    line: int
    param: str | None = None


_LINE = msgspec.json.Decoder(BatchLine)


def parse_lines(data: bytes, endpoint: str) -> tuple[list[BatchLine], list[LineError]]:
    """Input JSONL to lines; every malformed line is reported (the batch then fails)."""
    lines: list[BatchLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = _LINE.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            errors.append(LineError("invalid_json_line", f"line {n}: {exc}", n))
            continue
        if line.method.upper() != "POST":
            errors.append(LineError("invalid_method", f"line {n}: method must be POST", n,
                                    "method"))
        elif line.url != endpoint:
            errors.append(LineError("mismatched_endpoint",
                                    f"line {n}: url {line.url!r} differs from the batch's "
                                    f"endpoint {endpoint!r}", n, "url"))
        elif line.custom_id in seen:
            errors.append(LineError("duplicate_custom_id",
                                    f"line {n}: custom_id {line.custom_id!r} is not unique", n,
                                    "custom_id"))
        elif line.body.get("stream"):
            errors.append(LineError("invalid_request", f"line {n}: stream is not allowed in a "
                                    "batch", n, "body.stream"))
        else:
            seen.add(line.custom_id)
            lines.append(line)
    if not lines and not errors:
        errors.append(LineError("empty_file", "the input file has no requests", 0))
    if len(lines) > MAX_LINES:
        errors.append(LineError("too_many_requests",
                                f"{len(lines)} requests; at most {MAX_LINES} per batch", 0))
    return lines, errors


def count_lines(data: bytes) -> int:
    """Non-empty lines of a JSONL upload."""
    return sum(1 for raw in data.splitlines() if raw.strip())


def error_result(custom_id: str, request_id: str, err: ApiError) -> LineResult:
    """A line that failed with ``err``."""
    return LineResult(custom_id, err.status, request_id, err.body())


def output_line(result: LineResult) -> bytes:
    """The output- or error-file line of one result."""
    line_id = "batch_req_" + result.request_id.removeprefix("batch_")
    response = {"status_code": result.status_code, "request_id": result.request_id,
                "body": result.body}
    error = None
    if not result.ok:
        err = result.body.get("error", {})
        error = {"code": err.get("code") or err.get("type"), "message": err.get("message")}
    return json.dumps({"id": line_id, "custom_id": result.custom_id, "response": response,
                       "error": error}, separators=(",", ":")).encode()


def encode_record(rec: msgspec.Struct) -> bytes:
    return msgspec.json.encode(rec)


def decode_record(data: bytes, typ: type[msgspec.Struct]) -> Any:
    return msgspec.json.decode(data, type=typ)
