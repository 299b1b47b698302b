"""The engine backends a worker can run, by name (``--backend``).

Each backend module offers ``missing_dependencies() -> str | None`` (why it cannot run in
this installation) and ``async open_engine(cfg, cost, policy) -> Engine``. Modules are
imported only when chosen, so the sim worker never imports torch or vLLM.
"""

from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = {
    "sim": "prefixmesh.services.worker.engine.sim_live",  # simulated GPU (cost model)
    "hf": "prefixmesh.services.worker.engine.hf_engine",  # transformers, SmolLM2-135M
    "vllm": "prefixmesh.services.worker.engine.vllm_engine",  # vLLM on a GPU
}


def backend(name: str) -> ModuleType:
    """The module of backend ``name``; SystemExit naming the choices when unknown, or
    saying what is missing when it cannot run here."""
    if name not in BACKENDS:
        raise SystemExit(f"backend {name!r} is not available in this build; use "
                         + ", ".join(BACKENDS))
    module = importlib.import_module(BACKENDS[name])
    if (why := module.missing_dependencies()) is not None:
        raise SystemExit(why)
    return module
