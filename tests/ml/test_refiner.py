"""TRAIL's in-process refinement on the hf engine ([ml] extra): the numpy probe matches the
torch one, and refined predictions reach sprpt_limited as decode steps go by."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import need  # noqa: E402

need("ml", "torch", "transformers")

from prefixmesh.services.worker.engine.hf_engine import HfEngine, HfEngineConfig  # noqa: E402
from prefixmesh.services.worker.engine.types import EngineRequest, StepOutput  # noqa: E402
from prefixmesh.services.worker.local import make_local_policy  # noqa: E402
from prefixmesh.services.worker.refiner import (  # noqa: E402
    Refiner,
    attach_refiner,
    seed_distribution,
)
from prefixmesh.shared.text.tokenizer import TextTokenizer  # noqa: E402
from prefixmesh.shared.trail.artifact import predict_proba  # noqa: E402
from prefixmesh.shared.trail.lengths import LengthBins  # noqa: E402
from prefixmesh.shared.wire import LengthDistribution, SamplingParams  # noqa: E402
from tests.helpers import TINY_HIDDEN as HIDDEN  # noqa: E402
from tests.helpers import TINY_LAYER as LAYER  # noqa: E402
from tests.helpers import TINY_TOKENS_PER_UPDATE as TOKENS_PER_UPDATE  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def artifact(tiny_artifact) -> Path:
    return tiny_artifact("static")


def test_numpy_probe_matches_torch(artifact: Path) -> None:
    from prefixmesh.shared.trail.artifact import PredictorArtifact

    art = PredictorArtifact.load(artifact)
    refiner = Refiner.load(artifact)
    x = np.random.default_rng(1).normal(size=(5, HIDDEN)).astype(np.float32) * 3
    np.testing.assert_allclose(refiner.probe.proba(x), predict_proba(art.probe, x),
                               rtol=1e-4, atol=1e-6)
    assert refiner.layer == LAYER and refiner.every == TOKENS_PER_UPDATE


def test_forgetting_factor_comes_from_the_artifact(artifact: Path, tmp_path: Path) -> None:
    import json
    import shutil

    assert Refiner.load(artifact).forget == 1.0  # TRAIL's update when the artifact has none
    tempered = tmp_path / "tempered"
    shutil.copytree(artifact, tempered)
    meta = json.loads((tempered / "config.json").read_text())
    meta["scores"]["forget"] = 0.5
    (tempered / "config.json").write_text(json.dumps(meta))
    refiner = Refiner.load(tempered)
    assert refiner.forget == 0.5
    req = EngineRequest(request_id="f", prompt_token_ids=[1, 2, 3], max_tokens=4)
    refiner.on_hidden(req, 1, np.zeros(HIDDEN))
    assert refiner._smoothers["f"][1].forget == 0.5


def test_total_length_target_comes_from_the_artifact(artifact: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from prefixmesh.shared.trail.lengths import remaining_given_running

    assert Refiner.load(artifact).target == "remaining"  # TRAIL's when the artifact says none
    total = tmp_path / "total"
    shutil.copytree(artifact, total)
    meta = json.loads((total / "config.json").read_text())
    meta["target"] = "total"
    (total / "config.json").write_text(json.dumps(meta))
    got: dict[str, float] = {}
    refiner = Refiner.load(total, lambda rid, left: got.__setitem__(rid, left) or True)
    assert refiner.target == "total"
    req = EngineRequest(request_id="t", prompt_token_ids=[1, 2, 3], max_tokens=10_000,
                        predicted_output=300.0)
    hidden = np.random.default_rng(3).normal(size=HIDDEN) * 3
    k = 1 + 5 * TOKENS_PER_UPDATE  # a reading with 10 tokens out before this one
    refiner.on_hidden(req, k, hidden)
    smoother = refiner._smoothers["t"][1]
    assert smoother.target == "total"
    left = remaining_given_running(smoother.posterior, refiner.bins, k - 1) - 1.0
    assert got["t"] == pytest.approx(left)


def test_seed_distribution() -> None:
    bins = LengthBins.make(4, 400)
    np.testing.assert_allclose(seed_distribution(bins, 0.0), [0.25] * 4)
    seed = seed_distribution(bins, 250.0)
    assert seed.sum() == pytest.approx(1.0) and seed.argmax() == 2
    # The predictor's distribution is the seed when it is over the same bins (TRAIL).
    dist = LengthDistribution(edges=list(bins.edges), probs=[0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(seed_distribution(bins, 250.0, dist), [0.1, 0.2, 0.3, 0.4])
    other = LengthDistribution(edges=[0.0, 10.0, 20.0, 30.0, 40.0], probs=[0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(seed_distribution(bins, 250.0, other), seed)


async def test_refinement_reaches_sprpt_limited(artifact: Path, tok: TextTokenizer) -> None:
    policy = make_local_policy("sprpt_limited")
    engine = HfEngine(HfEngineConfig(num_blocks=64), policy, tok)
    refiner = attach_refiner(engine, artifact)
    assert engine.cfg.hidden_layer == LAYER and engine.on_hidden is not None
    await asyncio.get_running_loop().run_in_executor(None, engine.load)
    seen: list[tuple[int, float, float]] = []  # (tokens out, remaining passed, refined_output)
    update = engine.update_prediction

    def spy(request_id: str, remaining: float) -> bool:
        ok = update(request_id, remaining)
        req = next(iter(engine._requests.values()))
        seen.append((req.num_output_tokens, remaining, req.refined_output))
        return ok

    refiner.update = spy
    done: dict[str, StepOutput] = {}

    async def emit(out: StepOutput, text: str, logprobs=None) -> None:
        if out.finished:
            done[out.request_id] = out

    async def publish(events: list) -> None:
        return None

    task = asyncio.create_task(engine.run(emit, publish))
    try:
        req = EngineRequest(request_id="r", prompt_token_ids=tok.encode("Once upon a time"),
                            max_tokens=13, predicted_output=100.0)
        engine.add(req, time.monotonic(),
                   SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True))
        while "r" not in done:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.close()
    # Readings before tokens 1, 3, 5, ..., 13: every TOKENS_PER_UPDATE tokens.
    assert [n for n, _, _ in seen] == list(range(1, 14, TOKENS_PER_UPDATE))
    assert refiner.calls == 13 and refiner.readings == len(seen)
    # The policy holds each refinement: tokens out + the remaining tokens predicted, never
    # past the request's budget of 13.
    for n, remaining, refined in seen:
        assert refined == pytest.approx(n + remaining)
        assert remaining <= 13 - n
    assert len({round(r, 6) for _, r, _ in seen}) > 1  # it moves over decode steps
    assert policy.remaining(req) == pytest.approx(max(seen[-1][2] - 13, 0.0))


def test_refinement_never_exceeds_the_budget_left(artifact: Path) -> None:
    got: dict[str, float] = {}
    refiner = Refiner.load(artifact, lambda rid, left: got.__setitem__(rid, left) or True)
    hidden = np.random.default_rng(2).normal(size=HIDDEN) * 3
    for rid, budget in (("wide", 100_000), ("tight", 4)):
        req = EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], max_tokens=budget,
                            predicted_output=300.0)
        refiner.on_hidden(req, 1, hidden)  # first token: 0 out before it, 1 now
    assert got["wide"] > 3  # the probe's reading, a few hundred tokens
    assert got["tight"] == 3  # max_tokens - generated
