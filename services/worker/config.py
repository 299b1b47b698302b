"""Worker configuration."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from prefixmesh.services.worker.engine.hf_prefill_only import DEFAULT_HYBRID_CHUNK_TOKENS
from prefixmesh.services.worker.engine.kv_pool import DEFAULT_KV_BLOCKS
from prefixmesh.services.worker.local import (
    DEFAULT_LOCAL_POLICY,
    LOCAL_POLICIES,
    BatchGroupsConfig,
    LocalPolicyConfig,
)
from prefixmesh.services.worker.local.batch_groups import DEFAULT_MEMORY_THRESHOLD
from prefixmesh.shared.costmodel import DEFAULT_PROFILE
from prefixmesh.shared.models import ModelCard, card_for
from prefixmesh.shared.runtime.config import PORT, CommonConfig, option


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    worker_id: str = option("", "this worker's id (empty = hostname-pid, unique per replica)")
    worker_ids: str = option("", "sim: run one engine per id of this comma list in this "
                             "process, each a worker of its own (overrides worker_id)")
    backend: str = option("sim", "engine backend: sim (simulated GPU), hf, vllm",
                          choices=("sim", "hf", "vllm"))
    profile: str = option(DEFAULT_PROFILE, "cost-model profile of the simulated GPU")
    local_policy: str = option(DEFAULT_LOCAL_POLICY, "local queue policy (docs/design.md "
                               "section 6)",
                               choices=LOCAL_POLICIES)
    model: str = option("", "model served (empty = the backend's own: <profile>-sim for sim, "
                        "smollm2-135m-instruct for hf; vllm needs one)")
    tokenizer_path: str = option("", "tokenizer.json for detokenizing (empty = SmolLM2's)")
    load_interval_s: float = option(0.25, "period of load reports to the scheduler (seconds)")
    max_requests: int = option(4096, "queued + running requests before new ones are refused")
    mesh: bool = option(True, "join the mesh over NATS (--no-mesh: serve HTTP only)")
    http_host: str = option("127.0.0.1", "address of the standalone HTTP API (with http_port)")
    http_port: int = option(0, "serve the OpenAI / SGLang / vLLM-compatible HTTP API on this "
                            "port beside the mesh subjects (0 = no HTTP)", bounds=PORT)
    max_model_len: int = option(0, "longest prompt + max_tokens accepted (tokens; 0 = the "
                                "served model's context length, shared/models.py)")
    max_num_seqs: int = option(0, "hf: requests run at once, interleaved one forward pass "
                               "each (0 = the engine's default, 8); the sim takes its "
                               "profile's")
    probe_model: str = option("", "hf: predictor artifact folder whose probe refines each "
                              "request's remaining length in-process (TRAIL; read by "
                              "sprpt_limited); empty = no refinement")
    time_scale: float = option(
        1.0, "sim: wall seconds per modelled second; K > 1 runs the simulated GPU K times "
        "slower than the modelled hardware (every step lasts K x its modelled time) while the "
        "engine's own times stay in model seconds (engine/pacing.py)")
    sim_kv_blocks: int = option(0, "sim: KV pool in 16-token blocks (0 = the profile's KV "
                                "capacity); a smaller pool puts the prefix cache under "
                                "pressure (prefixmesh compare --cache-pressure)")
    kv_blocks: int = option(DEFAULT_KV_BLOCKS, "hf: prefix-cache pool in 16-token blocks "
                            "(SmolLM2-135M: 737 KB each; 1024 = 16k tokens)")
    hybrid_chunk_tokens: int = option(
        DEFAULT_HYBRID_CHUNK_TOKENS, "hf: tokens per chunk of the norms, projections and MLP "
        "when a one-token request (/v1/score, max_tokens 1) runs prefill-only, attention "
        "seeing the whole prompt "
        "(hybrid prefilling, docs/design.md section 7); 0 = such requests take the ordinary "
        "chunked path")
    default_output_mean: float = option(
        128.0, "sim: mean output tokens of a request with no length hint and no ignore_eos")
    batch_kv_tokens: int = option(
        0, "batch_groups: KV token threshold of planned batch work (tokens of KV the engine "
        "may hold before batch admissions stop; batch requests are not capped by "
        f"max_num_seqs); 0 = {DEFAULT_MEMORY_THRESHOLD * 100:.0f}%% of the engine's KV pool "
        "(docs/batch.md)")

    def local_policy_config(self) -> LocalPolicyConfig | None:
        """The local policy's knobs set here (None = its defaults)."""
        if self.local_policy == "batch_groups" and self.batch_kv_tokens:
            return BatchGroupsConfig(kv_tokens=self.batch_kv_tokens)
        return None

    def served_model(self) -> ModelCard:
        """Name and context length of what this worker serves."""
        card = card_for(self.backend, self.profile, self.model)
        name = self.model or (card.name if card is not None else "")
        if not name:
            raise SystemExit("--backend vllm needs --model")
        length = self.max_model_len or (card.context_length if card is not None else 0)
        if length < 1:
            raise SystemExit(f"the context length of {name!r} is unknown here: give "
                             "--max-model-len")
        simulated = card is not None and card.simulated
        return ModelCard(name, length, simulated)

    def resolved_worker_id(self) -> str:
        """The configured id, or one unique to this host and process."""
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}".replace(".", "-")
