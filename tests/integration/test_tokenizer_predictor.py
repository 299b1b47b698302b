"""Tokenizer and predictor services over a real NATS server."""

from __future__ import annotations

from prefixmesh.services.predictor.service import PredictorConfig, PredictorService
from prefixmesh.services.tokenizer.service import TokenizerConfig, TokenizerService
from prefixmesh.shared.bus import Bus
from prefixmesh.shared.wire import (
    PREDICT_REPLY,
    TOKENIZER_REPLY,
    ChatMessage,
    DetokenizeRequest,
    PredictLengthRequest,
    TokenizeRequest,
)
from tests.helpers import running


async def test_tokenizer_encodes_decodes_and_rejects_bad_requests(bus: Bus, nats_server, prefix):
    cfg = TokenizerConfig(nats_url=nats_server, subject_prefix=prefix)
    # Two replicas in one queue group: requests are shared, every one is answered once.
    async with running(TokenizerService(cfg)), running(TokenizerService(cfg)):
        subj = bus.subjects.tokenize
        replies = [await bus.request(subj, TokenizeRequest(request_id=f"r{i}", text="Hello world"),
                                     TOKENIZER_REPLY, 5) for i in range(6)]
        assert all(r.error is None and r.token_ids == replies[0].token_ids for r in replies)
        ids = replies[0].token_ids
        back = await bus.request(subj, DetokenizeRequest(request_id="d", token_ids=ids),
                                 TOKENIZER_REPLY, 5)
        assert back.text == "Hello world"
        chat = await bus.request(subj, TokenizeRequest(request_id="c", messages=[
            ChatMessage(role="user", content="Hello world")]), TOKENIZER_REPLY, 5)
        assert len(chat.token_ids) > len(ids)
        bad = await bus.request(subj, TokenizeRequest(request_id="b"), TOKENIZER_REPLY, 5)
        assert bad.error is not None and bad.error.code == "bad_request"
        # Garbage bytes on the subject get an error reply, not a timeout.
        raw = await bus.nc.request(subj, b"\x93garbage", timeout=5)
        assert TOKENIZER_REPLY.decode(raw.data).error is not None


async def test_predictor_answers_from_its_prior_and_survives_garbage(bus: Bus, nats_server,
                                                                    prefix):
    cfg = PredictorConfig(nats_url=nats_server, subject_prefix=prefix,
                          length_prior="toolbench=43,default=100")
    async with running(PredictorService(cfg)):
        subj = bus.subjects.predict_length
        r = await bus.request(subj, PredictLengthRequest(request_id="a", prompt_tokens=10,
                                                         workload="toolbench"), PREDICT_REPLY, 5)
        assert r.predicted_tokens == 43
        r = await bus.request(subj, PredictLengthRequest(request_id="b", prompt_tokens=10),
                              PREDICT_REPLY, 5)
        assert r.predicted_tokens == 100
        raw = await bus.nc.request(subj, b"not msgpack", timeout=5)
        assert PREDICT_REPLY.decode(raw.data).error is not None
        r = await bus.request(subj, PredictLengthRequest(request_id="c", prompt_tokens=-1),
                              PREDICT_REPLY, 5)
        assert r.error is not None
