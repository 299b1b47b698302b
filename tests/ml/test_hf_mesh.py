"""The real model as a user meets it ([ml] extra): ``prefixmesh up --backend hf --workers 1``
on a fresh cache (the worker converts SmolLM2 first), then the OpenAI API at once.

- ``up`` says it is up only when the worker serves: the first request after it is a 200;
- completions and chat return the model's log-probabilities, ``allowed_token_ids`` holds;
- ``/v1/score`` (the prefill-only path) returns ``exp(logprob)`` of each candidate as an
  unrestricted ``/v1/completions`` call (``max_tokens: 1``, ``logprobs: 20``) reports it, and
  as the ordinary path does (a two-token completion's first position), within float
  tolerance.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import need  # noqa: E402

need("ml", "torch", "transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
PROMPT = "Question: Is water wet? Answer Yes or No.\nAnswer:"
# Relative tolerance between probabilities computed on different paths (float rounding).
REL = 1e-3


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def up(nats_server: str, redis_server: str, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[tuple[str, Path, dict]]:
    """``prefixmesh up --backend hf --workers 1`` on the session's NATS and Redis with an
    empty cache; yields the edge URL, its output file and the first answer after it said
    it was up (a completion asking for logprobs)."""
    tmp = tmp_path_factory.mktemp("hfup")
    state, out = tmp / "state.json", tmp / "up.out"
    cmd = [sys.executable, "-m", "prefixmesh.services.cli", "up", "--backend", "hf",
           "--workers", "1", "--port", "0", "--metrics-port", "0", "--nats-url", nats_server,
           "--redis-url", redis_server, "--subject-prefix", "hfmesh", "--log-dir",
           str(tmp / "logs"), "--state-file", str(state)]
    env = {**os.environ, "PREFIXMESH_CACHE": str(tmp / "cache")}  # converts the model first
    with out.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 400
        while not state.exists():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, "mesh did not come up"
            time.sleep(0.05)
        url = json.loads(state.read_text())["url"]
        first = post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                              "max_tokens": 1, "logprobs": 20,
                                              "temperature": 0})
        yield url, out, {"status": first[0], "body": first[1]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_up_says_up_only_when_the_worker_serves(up) -> None:
    _url, out, first = up
    assert first["status"] == 200, first["body"]  # no 503 window after "is up"
    text = out.read_text()
    assert "prefixmesh is up" in text
    # It converted the model meanwhile (a fresh cache), and it said what it waited for
    # when that took longer than a progress period.
    logs = Path(text.split("logs: ")[1].split()[0])
    assert "converting" in (logs / "worker-0.log").read_text()


def test_completion_and_chat_return_logprobs(up) -> None:
    url, _out, first = up
    lp = first["body"]["choices"][0]["logprobs"]
    top = lp["top_logprobs"][0]
    assert len(top) == 20 and lp["token_logprobs"][0] == pytest.approx(max(top.values()))
    status, chat = post(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "temperature": 0})
    assert status == 200, chat
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    # allowed_token_ids: the pick is among them; its logprob is still the model's.
    yes = top[" Yes"]
    status, only = post(url, "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "logprobs": 0, "temperature": 0,
        "allowed_token_ids": [9230]})  # " Yes"
    assert status == 200, only
    assert only["choices"][0]["text"] == " Yes"
    assert only["choices"][0]["logprobs"]["token_logprobs"][0] == pytest.approx(yes, abs=1e-4)


def test_score_is_exp_of_the_completion_logprob(up) -> None:
    url, _out, first = up
    top = first["body"]["choices"][0]["logprobs"]["top_logprobs"][0]
    status, scored = post(url, "/v1/score", {"model": MODEL, "prompt": PROMPT,
                                             "candidates": [" Yes", " No"]})
    assert status == 200, scored
    assert scored["simulated"] is False
    scores = {s["candidate"]: s for s in scored["data"][0]["scores"]}
    for cand in (" Yes", " No"):
        assert scores[cand]["probability"] == pytest.approx(math.exp(top[cand]), rel=REL)
    # The ordinary (decoding) path agrees at the first position.
    status, two = post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                "max_tokens": 2, "logprobs": 20,
                                                "temperature": 0})
    assert status == 200, two
    first_pos = two["choices"][0]["logprobs"]["top_logprobs"][0]
    for cand in (" Yes", " No"):
        assert scores[cand]["probability"] == pytest.approx(math.exp(first_pos[cand]), rel=REL)
