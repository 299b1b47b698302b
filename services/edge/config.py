"""Edge configuration."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from prefixmesh.shared.bus import BatchLimits
from prefixmesh.shared.costmodel import DEFAULT_PROFILE
from prefixmesh.shared.models import DEFAULT_MODEL, known_cards
from prefixmesh.shared.runtime.config import PORT, CommonConfig, option


@dataclass(frozen=True)
class EdgeConfig(CommonConfig):
    host: str = option("127.0.0.1", "address the HTTP API listens on")
    port: int = option(8000, "port of the HTTP API (0 = any free port)", bounds=PORT)
    reuse_port: bool = option(False, "share --port with the other edges of this host that "
                              "set it too (SO_REUSEPORT, Linux): the kernel spreads new "
                              "connections over them, one address for all; give each its "
                              "own --metrics-port to scrape it")
    fast_front: bool = option(True, "answer non-streamed completions through the lean "
                              "HTTP/1.1 front (services/edge/front.py), every other request "
                              "through aiohttp; false: every request through aiohttp")
    models: str = option(DEFAULT_MODEL, "comma-separated model names served (the workers' "
                         "--model; shared/models.py)")
    vocab_size: int = option(49152, "token ids in prompts must be below this")
    max_model_len: int = option(0, "longest prompt + max_tokens accepted (tokens; 0 = each "
                                "model's context length, shared/models.py)")
    max_body_bytes: int = option(16 * 1024 * 1024, "largest request body accepted (413 above)")
    tokenize_timeout_s: float = option(10.0, "seconds to wait for the tokenizer")
    local_tokenize_chars: int = option(1024, "text prompts of at most this many characters "
                                       "(chat: all messages' contents) are tokenized by the "
                                       "edge itself, longer ones by the tokenizer service "
                                       "(0 = every prompt by the service)")
    tokenizer_path: str = option("", "the tokenizer.json the edge tokenizes short prompts "
                                 "with: the tokenizer service's (empty = SmolLM2's, as there)")
    route_timeout_s: float = option(2.0, "seconds to wait for the scheduler")
    route_retry_s: float = option(8.0, "seconds to keep retrying while no scheduler answers")
    route_batch: int = option(BatchLimits().max_batch,
                              "routing requests (and placements: place_max_tokens) sent to "
                              "the scheduler in one message at most: those made in the same "
                              "turn of the event loop go together (1 = one message each, no "
                              "batching)")
    route_inflight: int = option(BatchLimits().max_inflight,
                                 "routing messages (and placement messages) awaiting the "
                                 "scheduler's answer at once; requests made meanwhile wait "
                                 "and go together in the next")
    place_max_tokens: int = option(256, "prompts of at most this many tokens go to the "
                                   "scheduler whole, which hands them to the chosen worker "
                                   "itself (one hop less); longer ones are routed by their "
                                   "block hashes, then submitted by the edge (0 = always the "
                                   "two steps)")
    submit_timeout_s: float = option(2.0, "seconds to wait for a worker to accept")
    request_timeout_s: float = option(600.0, "seconds a request may take end to end")
    worker_silence_s: float = option(1.0, "seconds without load reports after which a "
                                     "worker is presumed dead and its requests fail over "
                                     "(0 = never)")
    max_tokens_limit: int = option(0, "largest max_tokens accepted, below the context length "
                                   "(400 above; 0 = no bound of the server's own)")
    max_inflight: int = option(1024, "requests in flight at this edge before new ones get "
                               "503 + Retry-After (the edge's bounded queue)")
    api_keys_file: str = option("", "TOML file of tenants, their API keys and limits "
                                "(services/edge/tenants.py); set = auth on")
    api_keys_redis: bool = option(False, "also look API keys up in the Redis hash "
                                  "<redis_prefix>:apikeys (key -> tenant); set = auth on")
    predict: bool = option(False, "ask the predictor for an output-length estimate")
    edge_id: str = option("", "this edge's id on the bus (empty = random)")
    batch: bool = option(True, "serve the Batch API (/v1/files, /v1/batches; needs JetStream)")
    batch_inflight_per_worker: int = option(32, "batch lines in flight per worker (requests)")
    batch_progress_interval_s: float = option(0.5, "seconds between batch progress saves")
    batch_replicas: int = option(1, "JetStream copies of the Batch API's bucket and files "
                                 "when this edge creates them (3 on a 3-node NATS cluster)")
    batch_profile: str = option(DEFAULT_PROFILE, "cost-model profile the batch planner "
                                "balances workers with")

    @property
    def auth(self) -> bool:
        """Whether requests to /v1/ need a valid API key."""
        return bool(self.api_keys_file) or self.api_keys_redis

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.models.split(",") if m.strip())

    @cached_property
    def context_lengths(self) -> dict[str, int]:
        """Each served model's context length (tokens); SystemExit naming a model whose
        length is unknown while ``max_model_len`` is 0."""
        cards = known_cards()
        out = {}
        for name in self.model_names:
            length = self.max_model_len or (cards[name].context_length if name in cards
                                            else 0)
            if length < 1:
                raise SystemExit(f"the context length of model {name!r} is unknown: give "
                                 "--max-model-len")
            out[name] = length
        return out
