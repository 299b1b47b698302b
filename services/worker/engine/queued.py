"""What the real engines (``hf``, ``vllm``) share in front of their model: requests wait in
the local policy, by id, until the engine's loop admits them in the policy's order."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prefixmesh.services.worker.engine.types import FINISH_ABORT, EngineRequest, RequestStatus
from prefixmesh.services.worker.local.base import LocalPolicy
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes


class QueuedEngine:
    """The queue half of an engine; a subclass runs what the queue admits."""

    def __init__(self, policy: LocalPolicy) -> None:
        self.policy = policy
        self._requests: dict[str, EngineRequest] = {}  # waiting or running
        # The backend's sampling parameters of each waiting request.
        self._sampling: dict[str, Any] = {}
        self._wake = asyncio.Event()  # set when the loop has something new to look at

    def now(self) -> float:
        """Monotonic seconds."""
        return time.monotonic()

    @property
    def block_size(self) -> int:
        """prefixmesh block size: capacities are counted in these blocks."""
        return BLOCK_SIZE

    @property
    def num_waiting(self) -> int:
        """Requests in the local policy's queue."""
        return len(self.policy)

    def _check_new(self, req: EngineRequest) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} is already in the engine")

    def _queue(self, req: EngineRequest, now: float, sampling: Any) -> None:
        """Put a checked request in the local policy's queue."""
        if not req.block_hashes:
            req.block_hashes = block_hashes(req.prompt_token_ids, req.tenant, BLOCK_SIZE)
        req.arrival = now
        self._requests[req.request_id] = req
        self._sampling[req.request_id] = sampling
        self.policy.push(req, now)
        self._wake.set()

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a waiting request, or stop a running one (``_abort_running``); False if
        unknown or done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self.policy.remove(request_id)
            self._sampling.pop(request_id, None)
        else:
            self._abort_running(req)
        req.status, req.finish_reason, req.finish_time = RequestStatus.ABORTED, FINISH_ABORT, now
        self._wake.set()
        return True

    def _abort_running(self, req: EngineRequest) -> None:
        raise NotImplementedError

    def update_prediction(self, request_id: str, remaining_tokens: float) -> bool:
        """A refined remaining-length prediction for the local policy (TRAIL)."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.policy.update_prediction(req, remaining_tokens)
        return True
