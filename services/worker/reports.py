"""Engine stats to wire reports: shared by the live worker and the cluster simulator."""

from __future__ import annotations

from prefixmesh.services.worker.engine.types import EngineRequest, EngineStats
from prefixmesh.shared.wire import LoadReportEvent, RequestDoneEvent


def load_report(worker_id: str, s: EngineStats, ts: float, backend: str = "sim",
                model: str = "", kv_seq: int = 0, profile: str = "",
                engine_id: str = "") -> LoadReportEvent:
    """A LoadReportEvent from an engine's stats snapshot."""
    return LoadReportEvent(
        worker_id=worker_id, ts=ts, running=s.running, waiting=s.waiting,
        free_blocks=s.free_blocks, total_blocks=s.total_blocks, block_size=s.block_size,
        decode_share=s.decode_share, hit_ratio=s.hit_ratio,
        outstanding_tokens=s.outstanding_tokens, backend=backend, model=model,
        avg_queue_s=s.avg_queue_s, kv_seq=kv_seq, steps=s.steps, avg_step_s=s.avg_step_s,
        profile=profile, engine_id=engine_id)


def done_record(worker_id: str, r: EngineRequest, finish_reason: str,
                tenant: str = "", simulated: bool = False) -> RequestDoneEvent:
    """The completion record of a finished engine request (``simulated``: by the sim
    backend, no model)."""
    return RequestDoneEvent(
        request_id=r.request_id, worker_id=worker_id, prompt_tokens=r.num_prompt_tokens,
        cached_tokens=max(r.num_cached_tokens, 0), completion_tokens=r.num_output_tokens,
        queue_s=r.queue_s or 0.0, ttft_s=r.ttft_s or 0.0, latency_s=r.latency_s or 0.0,
        finish_reason=finish_reason, tenant=tenant, simulated=simulated)
