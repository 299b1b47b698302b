"""The hf engine's admission with ``batch_groups`` ([ml] extra, no model needed): planned
batch requests run beyond ``max_num_seqs`` up to the KV token threshold, and slot holders
keep their turn in the rotation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import need, span

need("ml", "torch", "transformers")

from prefixmesh.services.worker.engine.hf_engine import HfEngine, HfEngineConfig  # noqa: E402
from prefixmesh.services.worker.engine.types import EngineRequest  # noqa: E402
from prefixmesh.services.worker.local import (  # noqa: E402
    BatchGroupsConfig,
    BatchGroupsPolicy,
    FcfsPolicy,
    LocalPolicy,
)
from prefixmesh.shared.text.tokenizer import TextTokenizer  # noqa: E402
from prefixmesh.shared.wire import SamplingParams  # noqa: E402

# 160-token prompts + 32 output tokens: 12 KV blocks (192 tokens) each at their end.
FINAL_TOKENS = 192


@pytest.fixture
def make(tok: TextTokenizer) -> Iterator:
    engines: list[HfEngine] = []

    def build(policy: LocalPolicy, max_num_seqs: int) -> HfEngine:
        engine = HfEngine(HfEngineConfig(num_blocks=1024, max_num_seqs=max_num_seqs),
                          policy, tok)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


def _add(engine: HfEngine, rid: str, base: int, batch: str = "job") -> EngineRequest:
    req = EngineRequest(rid, span(base, 160), max_tokens=32, batch_id=batch)
    engine.add(req, 0.0, SamplingParams(max_tokens=32))
    return req


def test_a_planned_batch_is_admitted_beyond_max_num_seqs_up_to_the_threshold(make) -> None:
    policy = BatchGroupsPolicy(BatchGroupsConfig(kv_tokens=10 * FINAL_TOKENS))
    engine = make(policy, 2)
    for i in range(30):
        _add(engine, f"b{i}", 1000 * i)
    engine._admit(0.0)
    assert 2 < engine.num_running <= 10
    for _ in range(5):  # held at the threshold: nothing has finished, nothing more goes
        engine._admit(0.0)
    assert engine.num_running == 10
    # An interactive request still gets a slot, and its turn every 2 forward passes
    # (itself, then the batch requests' shared turn).
    chat = _add(engine, "chat", 900_000, batch="")
    engine._admit(0.0)
    assert engine.num_running == 11
    picks = [engine._pick().req for _ in range(8)]
    assert picks[0::2].count(chat) == 4 or picks[1::2].count(chat) == 4
    batch_picks = [r.request_id for r in picks if r is not chat]
    assert len(set(batch_picks)) == 4  # the batch turn rotates over the batch requests


def test_without_batch_groups_the_slot_count_binds(make) -> None:
    engine = make(FcfsPolicy(), 2)
    for i in range(6):
        _add(engine, f"b{i}", 1000 * i)
    engine._admit(0.0)
    engine._admit(0.0)
    assert engine.num_running == 2
    picks = [engine._pick().req.request_id for _ in range(4)]
    assert picks == ["b0", "b1", "b0", "b1"]
