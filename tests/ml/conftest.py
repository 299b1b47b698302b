"""Fixtures of the [ml] tests: the tiny predictor artifact, trained once per encoder mode;
an hf engine on the real SmolLM2 running its loop (``h``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from prefixmesh.services.worker.engine.hf_engine import HfEngine, HfEngineConfig
from prefixmesh.services.worker.local import make_local_policy
from prefixmesh.shared.text.tokenizer import TextTokenizer
from tests.helpers import HfHarness, build_tiny_artifact

# Hidden-state layer the ``h`` engine hands to its sink at every sampled token.
HF_LAYER = 12


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_artifact(encoder)``: the folder of a tiny artifact using that encoder mode
    ("full" or "static"), built on first use."""
    built: dict[str, Path] = {}

    def get(encoder: str) -> Path:
        if encoder not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{encoder}") / "tiny"
            build_tiny_artifact(folder, encoder=encoder)
            built[encoder] = folder
        return built[encoder]

    return get


@pytest.fixture(scope="module")
async def model_engine(tok: TextTokenizer) -> HfEngine:
    engine = HfEngine(HfEngineConfig(num_blocks=96, hidden_layer=HF_LAYER),
                      make_local_policy("fcfs"), tok)
    await asyncio.get_running_loop().run_in_executor(None, engine.load)
    return engine


@pytest.fixture
async def h(model_engine: HfEngine, tok: TextTokenizer) -> AsyncIterator[HfHarness]:
    """A fresh engine around the loaded model for each test (empty cache and queue)."""
    engine = HfEngine(model_engine.cfg, make_local_policy("fcfs"), tok)
    engine.model, engine.pool = model_engine.model, model_engine.pool
    engine.hybrid = model_engine.hybrid
    harness = HfHarness(engine)
    engine.on_hidden = lambda req, k, vec: harness.hidden.append((req.request_id, k, vec.shape[0]))
    task = asyncio.create_task(engine.run(harness.emit, harness.publish))
    yield harness
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    engine.close()
