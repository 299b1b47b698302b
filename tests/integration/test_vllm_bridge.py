"""The vllm backend's parts that run without a GPU.

- The KV bridge against real ZMQ sockets: a PUB and a replay ROUTER that behave like vLLM's
  ZmqEventPublisher (multipart [topic, seq, payload]; replay [b"", seq, payload] frames then
  seq -1 with an empty payload), with batches encoded in vLLM's positional shape.
- VllmEngine's admission, streaming, abort, sampling options and log-probabilities against
  a stand-in for AsyncLLM.generate (the real one is exercised in tests/gpu).
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq  # noqa: E402  (the [test] extra)
import zmq.asyncio  # noqa: E402

from prefixmesh.services.worker.engine.types import EngineRequest, StepOutput
from prefixmesh.services.worker.engine.vllm_engine import VllmEngine, VllmEngineConfig
from prefixmesh.services.worker.engine.vllm_events import BlockTranslator, encode_seq
from prefixmesh.services.worker.kv_bridge import KvBridge, KvBridgeConfig
from prefixmesh.services.worker.local import make_local_policy
from prefixmesh.shared.blocks import block_hashes
from prefixmesh.shared.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    SamplingParams,
)
from tests.helpers import eventually

TOPIC = b"kv-events"
TOKENS = list(range(100, 164))
PM = block_hashes(TOKENS)  # their prefixmesh block hashes
ENC = msgspec.msgpack.Encoder()


def _batch(*events: list) -> bytes:
    """A v0.11-style positional EventBatch: [ts, events, data_parallel_rank]."""
    return ENC.encode([1.0, list(events), 0])


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> list:
    return ["BlockStored", hashes, parent, tokens, 16, None, "GPU", None]


@dataclass
class FakeVllm:
    """vLLM's publisher side: PUB plus a replay ROUTER over a buffer of sent batches."""

    ctx: zmq.asyncio.Context
    pub: zmq.asyncio.Socket
    router: zmq.asyncio.Socket
    buffer: dict[int, bytes] = field(default_factory=dict)
    replay_requests: list[int] = field(default_factory=list)

    async def send(self, seq: int, payload: bytes, *, drop: bool = False) -> None:
        """Publish (or, with ``drop``, only buffer: as if the SUB lost it)."""
        self.buffer[seq] = payload
        if not drop:
            await self.pub.send_multipart([TOPIC, encode_seq(seq), payload])

    async def serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq in sorted(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([ident, b"", encode_seq(seq),
                                                      self.buffer[seq]])
            await self.router.send_multipart([ident, b"", encode_seq(-1), b""])


@pytest.fixture
async def fake_vllm(tmp_path) -> AsyncIterator[tuple[FakeVllm, str, str]]:
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    pub.bind(events)
    router.bind(replay)
    fake = FakeVllm(ctx, pub, router)
    server = asyncio.create_task(fake.serve_replay())
    try:
        yield fake, events, replay
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()


@pytest.fixture
async def start_bridge(fake_vllm):
    """``await start_bridge(first, replay=True)``: a KvBridge on the fake publisher (with its
    replay endpoint or not) that has received batch 0 (``first``); returns the fake, the
    bridge and the event lists it published. Stopped after the test."""
    fake, events, replay_endpoint = fake_vllm
    tasks: list[asyncio.Task] = []

    async def start(first: bytes, replay: bool = True):
        got: list[list[KvEvent]] = []

        async def publish(evs: list[KvEvent]) -> None:
            got.append(evs)

        cfg = KvBridgeConfig(events, replay_endpoint) if replay else KvBridgeConfig(events)
        bridge = KvBridge(cfg, BlockTranslator(), publish)
        tasks.append(asyncio.create_task(bridge.run()))
        # Publish seq 0 until it arrives (PUB/SUB drops what is sent before the
        # subscription lands; the repeats are duplicates the bridge ignores).
        fake.buffer[0] = first
        for _ in range(200):
            await fake.pub.send_multipart([TOPIC, encode_seq(0), first])
            await asyncio.sleep(0.02)
            if got:
                break
        return fake, bridge, got

    yield start
    for task in tasks:
        await _stop(task)


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_gap_is_replayed_in_order(start_bridge) -> None:
    fake, bridge, got = await start_bridge(_batch(_stored([11, 12], None, TOKENS[:32])))
    await fake.send(1, _batch(_stored([13, 14], 12, TOKENS[32:])), drop=True)
    await fake.send(2, _batch(["BlockRemoved", [14], "GPU"]))
    await eventually(lambda: len(got) == 3, timeout=5)
    assert got == [[BlockStored(PM[:2], None, TOKENS[:32], 16)],
                   [BlockStored(PM[2:], PM[1], TOKENS[32:], 16)],  # from the replay
                   [BlockRemoved([PM[3]])]]
    assert fake.replay_requests == [1] and bridge.replayed == 1 and bridge.resets == 0


async def test_unreplayable_gap_resets_the_view(start_bridge) -> None:
    fake, bridge, got = await start_bridge(_batch(_stored([11, 12], None, TOKENS[:32])))
    # seq 1 fell out of vLLM's replay buffer: it may have removed blocks we hold.
    await fake.send(2, _batch(_stored([21], None, TOKENS[:16])))
    await eventually(lambda: len(got) == 3, timeout=5)
    assert got[1] == [AllBlocksCleared()]
    assert got[2] == [BlockStored(PM[:1], None, TOKENS[:16], 16)]
    assert bridge.resets == 1 and bridge.translator.num_blocks == 1


async def test_without_a_replay_endpoint_a_gap_resets(start_bridge) -> None:
    fake, bridge, got = await start_bridge(_batch(_stored([11], None, TOKENS[:16])),
                                           replay=False)
    await fake.send(5, _batch(["AllBlocksCleared"]))
    await eventually(lambda: len(got) == 3, timeout=5)
    assert got[1:] == [[AllBlocksCleared()], [AllBlocksCleared()]]
    assert fake.replay_requests == []


# --------------------------------------------------------------------------- engine


class FakeAsyncLLM:
    """AsyncLLM.generate's contract: delta RequestOutputs, the last one ``finished``;
    cancelling the consumer aborts the request."""

    def __init__(self) -> None:
        self.order: list[str] = []  # request ids in the order they reached "vLLM"
        self.unstarted: set[str] = set()
        self.most_unstarted = 0
        self.aborted: list[str] = []
        self.fail: set[str] = set()
        self.params: dict[str, object] = {}  # the SamplingParams each request reached vLLM with

    async def generate(self, prompt, sp, request_id):
        self.order.append(request_id)
        self.unstarted.add(request_id)
        self.most_unstarted = max(self.most_unstarted, len(self.unstarted))
        try:
            await asyncio.sleep(0.05)  # queued and prefilling
            if request_id in self.fail:
                raise RuntimeError("engine fault")
            self.unstarted.discard(request_id)
            self.params[request_id] = sp
            for i in range(sp.max_tokens):
                last = i + 1 == sp.max_tokens
                token = sp.allowed_token_ids[0] if sp.allowed_token_ids else 7 + i
                comp = types.SimpleNamespace(token_ids=[token], text=f" t{i}",
                                             finish_reason="length" if last else None,
                                             logprobs=_vllm_logprobs(token, sp.logprobs))
                yield types.SimpleNamespace(outputs=[comp], finished=last,
                                            num_cached_tokens=16)
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        finally:
            self.unstarted.discard(request_id)


def _vllm_logprobs(token: int, k: int | None) -> list[dict] | None:
    """What vLLM returns for one token with ``logprobs=k``: the sampled token (here ranked
    second) and the k most likely, as token id -> Logprob(logprob, rank, decoded_token)."""
    if k is None:
        return None
    ranked = [(500 + r, -0.1 * r) for r in range(1, k + 1)]  # ranks 1..k: 501, 502, ...
    ranked.insert(1, (token, -0.15))
    return [{t: types.SimpleNamespace(logprob=lp, rank=r, decoded_token=f"<{t}>")
             for r, (t, lp) in enumerate(ranked, start=1)}]


@pytest.fixture
def fake_vllm_modules(monkeypatch):
    """The two vLLM modules the engine imports per request, reduced to what it uses."""
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = types.SimpleNamespace(DELTA=1)
    sampling.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


class Emitted(list):
    """(StepOutput, text) pairs the engine emitted, and the log-probabilities by request."""

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: dict[str, list] = {}


@pytest.fixture
async def fake_engine(fake_vllm_modules, tmp_path):
    eng = VllmEngine(VllmEngineConfig(model="fake", engine_waiting_max=2),
                     make_local_policy("fcfs"))
    eng._llm = llm = FakeAsyncLLM()  # what start() would build
    eng._bridge_cfg = KvBridgeConfig(f"ipc://{tmp_path}/events")
    outputs = Emitted()

    async def emit(out: StepOutput, text: str, logprobs=None) -> None:
        outputs.append((out, text))
        outputs.logprobs.setdefault(out.request_id, []).extend(logprobs or [])

    async def publish(events: list[KvEvent]) -> None:
        pass

    task = asyncio.create_task(eng.run(emit, publish))
    try:
        yield eng, llm, outputs
    finally:
        await _stop(task)


def _add(eng: VllmEngine, rid: str, max_tokens: int = 3) -> None:
    eng.add(EngineRequest(request_id=rid, prompt_token_ids=TOKENS, max_tokens=max_tokens),
            0.0, SamplingParams(max_tokens=max_tokens))


def _finished(outputs, rid: str) -> StepOutput | None:
    return next((o for o, _ in outputs if o.request_id == rid and o.finished), None)


async def test_engine_admits_in_policy_order_keeping_vllms_queue_short(fake_engine) -> None:
    eng, llm, outputs = fake_engine
    for i in range(6):
        _add(eng, f"r{i}")
    await eventually(lambda: all(_finished(outputs, f"r{i}") for i in range(6)), timeout=10)
    assert llm.order == [f"r{i}" for i in range(6)]  # fcfs order reached vLLM
    assert llm.most_unstarted <= 2  # engine_waiting_max
    done = _finished(outputs, "r0")
    assert (done.finish_reason, done.num_cached_tokens, done.request.num_output_tokens) == \
        ("length", 16, 3)
    firsts = [o for o, _ in outputs if o.request_id == "r0" and o.first_token]
    assert len(firsts) == 1 and "".join(t for o, t in outputs if o.request_id == "r0") == \
        " t0 t1 t2"
    stats = eng.stats(done.request.finish_time)
    assert stats.running == stats.waiting == 0 and stats.hit_ratio == 16 / len(TOKENS)
    assert eng.num_running == 0


async def test_engine_abort_waiting_and_running(fake_engine) -> None:
    eng, llm, outputs = fake_engine
    for rid in ("a", "b", "c"):
        _add(eng, rid, max_tokens=500)
    assert eng.abort("c", 1.0)  # still in our queue (not admitted yet): never reaches vLLM
    await eventually(lambda: any(o.request_id == "a" for o, _ in outputs), timeout=5)
    assert eng.abort("a", 1.0)  # streaming: vLLM aborts it
    assert not eng.abort("a", 1.0)
    await eventually(lambda: "a" in llm.aborted, timeout=5)
    assert "c" not in llm.order and not _finished(outputs, "a")
    eng.abort("b", 1.0)
    await eventually(lambda: eng.num_running == 0, timeout=5)


async def test_engine_failure_ends_the_request_with_an_error(fake_engine) -> None:
    eng, llm, outputs = fake_engine
    llm.fail.add("bad")
    _add(eng, "bad")
    _add(eng, "good")
    await eventually(lambda: _finished(outputs, "bad") and _finished(outputs, "good"),
                     timeout=5)
    assert _finished(outputs, "bad").finish_reason == "error"
    assert _finished(outputs, "good").finish_reason == "length"


async def test_engine_passes_allowed_tokens_and_returns_logprobs(fake_engine) -> None:
    eng, llm, outputs = fake_engine
    eng.add(EngineRequest(request_id="plain", prompt_token_ids=TOKENS, max_tokens=2), 0.0,
            SamplingParams(max_tokens=2, logprobs=2))
    eng.add(EngineRequest(request_id="score", prompt_token_ids=TOKENS, max_tokens=1), 0.0,
            SamplingParams(max_tokens=1, temperature=0.0, logprobs=1,
                           allowed_token_ids=[9, 503], logprob_token_ids=[9, 503, 777]))
    await eventually(lambda: _finished(outputs, "plain") and _finished(outputs, "score"),
                     timeout=5)
    logprobs = outputs.logprobs
    plain, score = llm.params["plain"], llm.params["score"]
    assert plain.logprobs == 2 and plain.allowed_token_ids is None
    # Wanting particular tokens' log-probabilities asks vLLM for all it reports.
    assert score.allowed_token_ids == [9, 503] and score.logprobs == eng.cfg.max_logprobs
    first = logprobs["plain"][0]
    assert (first.token_id, first.token, first.logprob) == (7, "<7>", -0.15)
    assert [(t.token_id, t.logprob) for t in first.top] == [(501, -0.1), (7, -0.15)]
    assert len(logprobs["plain"]) == 2
    (entry,) = logprobs["score"]
    assert entry.token_id == 9  # vLLM chose among the allowed tokens
    # The 1 most likely, then the wanted tokens vLLM reported (777 is not among them).
    assert [t.token_id for t in entry.top] == [501, 9, 503]
