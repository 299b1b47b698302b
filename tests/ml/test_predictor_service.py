"""The predictor service serving a trained artifact over real NATS ([ml] extra): sane
predictions from token ids, micro-batching of concurrent requests, error replies for
malformed requests, the prior as fallback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import need  # noqa: E402

need("ml", "torch", "transformers")

from prefixmesh.services.predictor.service import PredictorConfig, PredictorService  # noqa: E402
from prefixmesh.services.predictor.serving import prompt_text  # noqa: E402
from prefixmesh.shared.bus import Bus  # noqa: E402
from prefixmesh.shared.text.tokenizer import TextTokenizer  # noqa: E402
from prefixmesh.shared.trail.lengths import LengthBins, expected_length  # noqa: E402
from prefixmesh.shared.wire import PREDICT_REPLY, ChatMessage, PredictLengthRequest  # noqa: E402
from tests.helpers import TINY_LONG as LONG  # noqa: E402
from tests.helpers import TINY_SHORT as SHORT  # noqa: E402
from tests.helpers import running  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def artifact(tiny_artifact) -> Path:
    return tiny_artifact("full")


def chat(tok: TextTokenizer, text: str) -> list[int]:
    return tok.encode_chat([ChatMessage(role="user", content=text)])


async def ask(bus: Bus, rid: str, ids: list[int], **kw) -> object:
    return await bus.request(bus.subjects.predict_length,
                             PredictLengthRequest(request_id=rid, prompt_tokens=len(ids),
                                                  token_ids=ids, **kw), PREDICT_REPLY, 30)


def test_prompt_text_reads_the_last_user_turn(tok: TextTokenizer) -> None:
    ids = tok.encode_chat([ChatMessage(role="system", content="Be brief."),
                           ChatMessage(role="user", content="First question?"),
                           ChatMessage(role="assistant", content="An answer."),
                           ChatMessage(role="user", content="Second question?")])
    assert prompt_text(tok, ids) == "Second question?"
    assert prompt_text(tok, tok.encode("Plain prompt text")) == "Plain prompt text"


async def test_serves_the_artifact_in_batches(bus: Bus, nats_server, prefix, artifact, tok):
    cfg = PredictorConfig(nats_url=nats_server, subject_prefix=prefix, model_dir=str(artifact),
                          batch_wait_ms=200.0, length_prior="default=77")
    async with running(PredictorService(cfg)) as svc:
        short = await ask(bus, "s", chat(tok, SHORT[1]))
        long = await ask(bus, "l", chat(tok, LONG[0]))
        assert short.error is None and long.error is None
        bins = svc.model.artifact.bins
        lo, hi = bins.centres[0], bins.centres[-1]
        assert lo <= short.predicted_tokens < long.predicted_tokens <= hi
        # The chat template is stripped: a plain prompt of the same text predicts the same.
        plain = await ask(bus, "p", tok.encode(LONG[0]))
        assert plain.predicted_tokens == pytest.approx(long.predicted_tokens, rel=1e-4)
        # No token ids: the prior answers.
        prior = await bus.request(bus.subjects.predict_length,
                                  PredictLengthRequest(request_id="n", prompt_tokens=5),
                                  PREDICT_REPLY, 30)
        assert prior.error is None and prior.predicted_tokens == 77
        assert prior.distribution is None and long.distribution is not None
        # 32 concurrent requests share a few forward passes and each gets its own answer.
        before = svc.server.batches
        texts = (SHORT + LONG) * 2
        replies = await asyncio.gather(*(ask(bus, f"b{i}", chat(tok, t))
                                         for i, t in enumerate(texts)))
        assert svc.server.batches - before <= 4
        assert [r.request_id for r in replies] == [f"b{i}" for i in range(len(texts))]
        single = {SHORT[1]: short.predicted_tokens, LONG[0]: long.predicted_tokens}
        for t, r in zip(texts, replies, strict=True):
            assert r.error is None
            if t in single:  # padding to the batch's longest prompt changes nothing
                assert r.predicted_tokens == pytest.approx(single[t], rel=1e-3)


async def test_malformed_requests_get_error_replies(bus: Bus, nats_server, prefix, artifact,
                                                   tok):
    cfg = PredictorConfig(nats_url=nats_server, subject_prefix=prefix, model_dir=str(artifact),
                          batch_wait_ms=100.0)
    async with running(PredictorService(cfg)):
        subj = bus.subjects.predict_length
        raw = await bus.nc.request(subj, b"\x93not a request", timeout=30)
        assert PREDICT_REPLY.decode(raw.data).error.code == "bad_request"
        good = chat(tok, SHORT[0])
        # A bad request in the same batch as good ones fails alone.
        negative = PredictLengthRequest(request_id="c", prompt_tokens=-1, token_ids=good)
        bad_vocab, bad_count, ok = await asyncio.gather(
            ask(bus, "v", [5, tok.vocab_size + 10]),
            bus.request(subj, negative, PREDICT_REPLY, 30),
            ask(bus, "ok", good))
        assert bad_vocab.error.code == "bad_request" and "vocabulary" in bad_vocab.error.message
        assert bad_count.error.code == "bad_request"
        assert ok.error is None and ok.predicted_tokens > 0
        wrong_type = await bus.nc.request(subj, b"\x82\xa4type\xb4PredictLengthRequest"
                                          b"\xaarequest_id\x05", timeout=30)
        assert PREDICT_REPLY.decode(wrong_type.data).error is not None
        again = await ask(bus, "after", good)  # still serving
        assert again.error is None


def test_static_serving_encoder_matches_the_training_encoder() -> None:
    from prefixmesh.services.predictor.encoder import PromptEncoder
    from prefixmesh.services.predictor.serving import StaticEncoder

    enc = PromptEncoder(threads=1, mode="static")
    texts = SHORT[:3] + [LONG[0] * 40, "", "日本語のテキスト"]
    np.testing.assert_allclose(StaticEncoder(enc).encode(texts), enc.encode(texts),
                               rtol=1e-5, atol=1e-6)


async def test_edge_asks_the_model_with_the_prompts_token_ids(bus: Bus, nats_server, prefix,
                                                              artifact, tok):
    from prefixmesh.services.edge.pipeline import MeshClient, MeshTimeouts

    cfg = PredictorConfig(nats_url=nats_server, subject_prefix=prefix, model_dir=str(artifact),
                          length_prior="default=77")
    async with running(PredictorService(cfg)):
        mesh = MeshClient(bus, "edge-test", MeshTimeouts(predict_s=30.0), predict=True)
        ids = chat(tok, LONG[1])
        direct = await ask(bus, "d", ids)
        predicted, dist = await mesh.predict_length("e", ids)
        assert predicted == pytest.approx(direct.predicted_tokens)
        assert direct.predicted_tokens != 77  # the artifact answered, not the prior
        # The head's distribution comes along (the worker seeds its refinement with it).
        bins = LengthBins.from_dict(json.loads((artifact / "config.json").read_text())["bins"])
        assert tuple(dist.edges) == bins.edges and sum(dist.probs) == pytest.approx(1.0)
        assert expected_length(np.array(dist.probs), bins) == pytest.approx(predicted)
