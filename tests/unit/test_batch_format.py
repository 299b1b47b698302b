"""OpenAI batch shapes: input-line validation, output lines, the Batch object."""

from __future__ import annotations

import json

import pytest

from prefixmesh.services.edge.batch_format import (
    BatchRecord,
    LineResult,
    error_result,
    new_id,
    output_line,
    parse_lines,
)
from prefixmesh.shared.openai.schema import ApiError

EP = "/v1/completions"


def line(cid: str, url: str = EP, method: str = "POST", **body: object) -> bytes:
    return json.dumps({"custom_id": cid, "method": method, "url": url,
                       "body": {"model": "m", "prompt": "p", **body}}).encode()


def test_good_lines_parse_and_blank_lines_are_skipped() -> None:
    lines, errors = parse_lines(line("a") + b"\n\n" + line("b") + b"\n", EP)
    assert errors == [] and [x.custom_id for x in lines] == ["a", "b"]


@pytest.mark.parametrize("raw,code", [
    (b"not json", "invalid_json_line"),
    (line("a", method="GET"), "invalid_method"),
    (line("a", url="/v1/chat/completions"), "mismatched_endpoint"),
    (line("a") + b"\n" + line("a"), "duplicate_custom_id"),
    (line("a", stream=True), "invalid_request"),
    (b"\n", "empty_file"),
])
def test_bad_lines_are_reported_with_their_line(raw: bytes, code: str) -> None:
    _, errors = parse_lines(raw, EP)
    assert errors[0].code == code


def test_output_and_error_lines() -> None:
    ok = LineResult("a", 200, "batch_x-0", {"id": "cmpl-1"})
    row = json.loads(output_line(ok))
    assert row == {"id": "batch_req_x-0", "custom_id": "a", "error": None,
                   "response": {"status_code": 200, "request_id": "batch_x-0",
                                "body": {"id": "cmpl-1"}}}
    bad = error_result("b", "batch_x-1", ApiError(400, "nope", code="bad"))
    row = json.loads(output_line(bad))
    assert row["response"]["status_code"] == 400
    assert row["error"] == {"code": "bad", "message": "nope"}


def test_batch_object_has_openai_fields() -> None:
    rec = BatchRecord(id=new_id("batch"), endpoint=EP, input_file_id="file-1",
                      completion_window="24h", status="in_progress", created_at=1)
    obj = rec.to_openai()
    assert obj["object"] == "batch" and obj["output_file_id"] is None
    assert obj["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert obj["errors"] is None and "prefixmesh_plan" not in obj
    assert new_id("file").startswith("file-") and new_id("batch").startswith("batch_")
