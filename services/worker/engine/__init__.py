"""Engine backends behind the worker; ``sim`` (a simulated GPU scheduled like vLLM) lives here.

The engine is pure logic driven by the caller's clock; see ``sim.SimEngine``.
"""

from services.worker.engine.block_cache import BlockCache
from services.worker.engine.sim import SimEngine
from services.worker.engine.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineRequest,
    EngineStats,
    RequestStatus,
    SimEngineConfig,
    StepOutput,
    StepPlan,
)

__all__ = [
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "BlockCache",
    "EngineRequest",
    "EngineStats",
    "RequestStatus",
    "SimEngine",
    "SimEngineConfig",
    "StepOutput",
    "StepPlan",
]
