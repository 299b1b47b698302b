"""Data passed between the engine, the local policy and the worker or cluster simulator,
and the engine's config.

Pure data, no I/O. Times are caller-provided clock readings in seconds (real time in the
live worker, virtual time in the cluster simulator); token counts are tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from prefixmesh.shared.blocks import BLOCK_SIZE, extend_hashes, tenant_salt
from prefixmesh.shared.wire import LengthDistribution

DEFAULT_STATS_WINDOW_S = 5.0
# Ordinary token ids (clear of BOS/EOS and other special ids) that sim outputs cycle through.
DEFAULT_OUTPUT_TOKEN_POOL: tuple[int, ...] = tuple(range(1000, 1512))

FINISH_LENGTH = "length"  # hit max_tokens
FINISH_STOP = "stop"  # ended before max_tokens (the sim's stand-in for an EOS token)
FINISH_ABORT = "abort"  # aborted by the caller
FINISH_ERROR = "error"  # the engine failed on it (a real backend's exception)


class BadOption(ValueError):
    """A request option the engine cannot serve, or a value of it it cannot take: the
    worker refuses the request as a bad request naming ``param`` (the client gets a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class RequestStatus(enum.Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"  # in the local policy's queue (new or preempted)
    RUNNING = "running"  # holds KV blocks, scheduled every step until done
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One generation request as the engine and the local policy see it.

    The caller sets the first group of fields; the engine owns the rest (``init=False``).
    Identity equality (``eq=False``) so requests can live in sets and dicts.
    """

    request_id: str
    prompt_token_ids: list[int]
    # Upper bound on generated tokens (OpenAI ``max_tokens``), >= 1.
    max_tokens: int
    # Tokens this request will generate, decided by the caller (max_tokens when ignore_eos,
    # else the workload's hint, else sampled); 0 = unknown -> max_tokens.
    output_len: int = 0
    tenant: str = ""
    # prefixmesh block hashes of the prompt's full blocks (prefixmesh.shared.blocks, engine block
    # size, tenant-salted); empty -> computed by the engine on add(). The engine extends
    # the chain over blocks of generated tokens as it caches them.
    block_hashes: list[int] = field(default_factory=list)
    # Predicted output tokens, for length-aware local policies (0 = none).
    predicted_output: float = 0.0
    # The predictor's bin distribution behind predicted_output (None = none): seeds the
    # worker's TRAIL refinement (services/worker/refiner.py).
    predicted_distribution: LengthDistribution | None = None
    # Offline batch id for batch-group scheduling ("" = interactive).
    batch_id: str = ""
    # Key of the deterministic output token stream ("" = the request id). Requests with
    # the same key (same seed and prompt, or greedy on the same prompt) produce the same
    # tokens.
    sample_key: str = ""

    # ---- engine-managed state
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_prompt_tokens: int = field(default=0, init=False)
    # Tokens generated in total: min(output_len or max_tokens, max_tokens), at least 1.
    target_output_tokens: int = field(default=0, init=False)
    # Known tokens (prompt + generated so far); the last generated one has no KV yet.
    num_tokens: int = field(default=0, init=False)
    # Tokens whose KV is in the request's blocks.
    num_computed_tokens: int = field(default=0, init=False)
    # Prompt tokens served from the prefix cache at first admission (-1 = not admitted yet).
    num_cached_tokens: int = field(default=-1, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    # Block table: physical KV block ids in sequence order.
    block_ids: list[int] = field(default_factory=list, init=False)
    # Leading entries of block_ids already registered in the prefix cache.
    num_stored_blocks: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)
    # Tokens (prompt and output) served from the prefix cache when the request last resumed
    # after a preemption; the rest of its known tokens were recomputed (-1 = never resumed).
    num_resumed_cached_tokens: int = field(default=-1, init=False)
    # Latest refined prediction of total output tokens: tokens generated when it came plus
    # the remaining tokens then predicted (LocalPolicy.update_prediction; the worker
    # refines as the engine exposes hidden states). 0 = none: use predicted_output.
    refined_output: float = field(default=0.0, init=False)
    # Seed of the deterministic output token stream (crc32 of sample_key or the id).
    token_seed: int = field(default=0, init=False)
    arrival: float = field(default=0.0, init=False)
    first_scheduled: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)
    finish_reason: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1")
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens
        wanted = self.output_len if self.output_len > 0 else self.max_tokens
        self.target_output_tokens = max(1, min(wanted, self.max_tokens))

    def known_tokens(self, start: int, end: int) -> list[int]:
        """Known tokens ``[start, end)`` of prompt + output (a new list)."""
        prompt, p = self.prompt_token_ids, self.num_prompt_tokens
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return prompt[start:] + self.output_token_ids[: end - p]

    def hash_blocks(self, num_blocks: int, block_size: int) -> None:
        """Extend ``block_hashes`` over known tokens to ``num_blocks`` full blocks."""
        k = len(self.block_hashes)
        parent = self.block_hashes[-1] if k else tenant_salt(self.tenant)
        tokens = self.known_tokens(k * block_size, num_blocks * block_size)
        self.block_hashes.extend(extend_hashes(parent, tokens, block_size))

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def queue_s(self) -> float | None:
        """Seconds from arrival to first scheduled step (None until scheduled)."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first output token (None until produced)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def latency_s(self) -> float | None:
        """Seconds from arrival to finish (None until finished)."""
        return None if self.finish_time is None else self.finish_time - self.arrival


@dataclass(slots=True, eq=False)
class StepPlan:
    """One engine step: who runs, how many tokens each, and how long it takes."""

    step_id: int
    # Clock reading passed to plan_step (seconds).
    started: float
    # Modelled GPU time of the step (seconds, CostModel.step_time over ``batch``).
    duration: float = 0.0
    requests: list[EngineRequest] = field(default_factory=list)
    # (extend_tokens, seq_len_after) per entry of ``requests``, same order.
    batch: list[tuple[int, int]] = field(default_factory=list)
    # The first ``decode_entries`` entries of ``batch`` are one-token decodes whose
    # seq_len_after values sum to ``decode_ctx`` (step time prices them in aggregate).
    decode_entries: int = 0
    decode_ctx: int = 0
    # Tokens computing KV of generated tokens (1 per running decode).
    decode_tokens: int = 0
    # Tokens of prompt prefill (and of recompute after preemption).
    prefill_tokens: int = 0
    # Ids of requests preempted (by recompute) while planning this step.
    preempted: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        """Tokens batched in the step."""
        return self.decode_tokens + self.prefill_tokens


class StepOutput(msgspec.Struct, gc=False):
    """What one scheduled request got out of a finished step.

    A msgspec Struct rather than a dataclass: one is built per running request per step and
    msgspec builds it in C for half the cost (it was the step loop's largest single item).
    Never on the wire. ``gc=False`` is safe: a StepOutput never takes part in a cycle.
    """

    request_id: str
    # Tokens produced by this step: 1 when the request's known tokens are all computed
    # (decode, or the final prefill chunk), 0 during non-final prefill chunks.
    new_token_ids: list[int]
    # True on the request's last step; finish_reason is then "length" or "stop".
    finished: bool
    finish_reason: str | None
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int
    # True on the step that produced the request's first output token.
    first_token: bool
    # The request itself (timings, counters); read it, do not change it.
    request: EngineRequest


@dataclass(slots=True)
class EngineStats:
    """A load snapshot, shaped for LoadReportEvent (window stats over ``window_s``)."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    block_size: int
    # Decode tokens / all scheduled tokens over the window, in [0, 1].
    decode_share: float
    # Cached prompt tokens / prompt tokens of requests first admitted in the window.
    hit_ratio: float
    # Remaining prompt tokens + remaining output tokens over queued and running requests.
    outstanding_tokens: int
    # Mean seconds from arrival to first schedule of requests admitted in the window.
    avg_queue_s: float
    # Steps finished in the window and their mean duration (seconds, as measured by the
    # caller's clock between plan_step and finish_step).
    steps: int
    avg_step_s: float
    window_s: float
    # Preemptions by recompute since the engine started (cumulative, not windowed).
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """Engine limits; None means "take it from the cost-model profile"."""

    # Tokens batched per step (profiles: 2048).
    max_batched_tokens: int | None = None
    # Running sequences at most (profiles: 256).
    max_num_seqs: int | None = None
    # KV blocks in the pool (profiles: kv_capacity_tokens // block_size).
    num_blocks: int | None = None
    # Tokens per KV block; the prefixmesh block hashes are defined over 16.
    block_size: int = BLOCK_SIZE
    # Cap on one request's prefill chunk per step (vLLM's long_prefill_token_threshold);
    # None = only the step budget limits it.
    max_prefill_chunk: int | None = None
    # Span of the sliding window behind stats() (seconds).
    stats_window_s: float = DEFAULT_STATS_WINDOW_S
    # Token ids generated outputs cycle through (see sim.SimEngine); not empty.
    output_token_pool: tuple[int, ...] = DEFAULT_OUTPUT_TOKEN_POOL

    def __post_init__(self) -> None:
        positive = (self.max_batched_tokens, self.max_num_seqs, self.num_blocks)
        if any(v is not None and v < 1 for v in positive) or self.block_size < 1:
            raise ValueError(f"engine limits must be >= 1: {self}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be >= 1")
        if self.stats_window_s <= 0 or not self.output_token_pool:
            raise ValueError("stats_window_s must be > 0 and output_token_pool not empty")
