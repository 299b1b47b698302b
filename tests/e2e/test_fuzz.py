"""Schemathesis fuzzes the live edge (sim workers behind it) from its own /openapi.json:
valid and invalid requests alike must never get a 5xx, and none may hang.

The request count is read from the edge's own ``prefixmesh_edge_requests_total`` counter
(server-side), so the ">= 2,000 generated requests" claim does not rest on the fuzzer's
report. A longer run: ``FUZZ_EXAMPLES=3000 pytest tests/e2e/test_fuzz.py`` (per operation).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from prefixmesh.services.up import LocalMesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Generated cases per operation; 3 POST operations plus the GETs give >= 2,000 requests.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "550"))
MIN_REQUESTS = 2000
# A request the edge cannot finish within this many seconds counts as a hang.
REQUEST_TIMEOUT_S = 20
# max_tokens the fuzzed edge accepts: keeps every valid request short on the sim.
MAX_TOKENS = 4


def _counts(metrics_text: str) -> dict[str, int]:
    """Requests by status class from the edge's Prometheus text."""
    out: dict[str, int] = {}
    for m in re.finditer(r'^prefixmesh_edge_requests_total\{[^}]*status="(\d)\d\d"[^}]*\} '
                         r'([0-9.e+]+)$', metrics_text, re.M):
        key = m.group(1) + "xx"
        out[key] = out.get(key, 0) + int(float(m.group(2)))
    return out


@pytest.fixture(scope="module")
def mesh_config() -> dict:
    return {"log_level": "ERROR", "extra_env": {"PM_MAX_TOKENS_LIMIT": str(MAX_TOKENS),
                                                "PM_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)}}


def test_schemathesis_finds_no_5xx_and_no_hang(mesh: LocalMesh, tmp_path: Path) -> None:
    st = Path(sys.executable).parent / "schemathesis"
    # One generator thread: CPython 3.11.7's ast module can raise a spurious "AST
    # constructor recursion depth mismatch" SystemError when hypothesis parses in
    # several threads at once (cpython gh-106905), which ends operations early.
    cmd = [str(st), "run", mesh.url + "/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", str(EXAMPLES), "--workers", "1", "--seed", "1",
           "--request-timeout", str(REQUEST_TIMEOUT_S), "--phases", "examples,coverage,fuzzing",
           "--generation-deterministic", "--no-shrink",
           "--report", "junit", "--report-dir", str(tmp_path)]
    # cwd: schemathesis keeps a .schemathesis/ folder in the working directory.
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=tmp_path,
                         env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"})
    with urllib.request.urlopen(mesh.url + "/metrics", timeout=5) as r:
        counts = _counts(r.read().decode())
    summary = run.stdout[-3000:] + run.stderr[-2000:]
    print(summary, counts)
    assert counts.get("5xx", 0) == 0, summary
    assert sum(counts.values()) >= MIN_REQUESTS, (counts, summary)
    assert run.returncode == 0, summary
    assert "Network Error" not in run.stdout and "Timeout" not in run.stdout, summary
