"""Every message that crosses a process boundary, in one place.

All messages are msgspec Structs encoded as msgpack. Each NATS subject carries one tagged
union (the ``tag`` is the class name), decoded by one module-level decoder. Schemas evolve
only by adding fields at the end, with defaults.

KV events follow vLLM's ``kv_events`` schema (``EventBatch`` of ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) so that vLLM replicas and the simulated GPU are
consumed by the same scheduler code. Block hashes on our bus are always prefixmesh block
hashes (``prefixmesh.shared.blocks``); the vLLM bridge re-hashes from ``token_ids``.
"""

from __future__ import annotations

import msgspec

from prefixmesh.shared.blocks import pack_hashes


class _Msg(msgspec.Struct, tag=True, omit_defaults=True, array_like=False):
    """Base of all wire messages: tagged by class name, defaults omitted on the wire."""


# --------------------------------------------------------------------------- common


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """One chat turn, OpenAI shape (text content only)."""

    role: str
    content: str = ""
    name: str | None = None


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling parameters carried from the edge to the engine."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    # vLLM extension: generate exactly max_tokens, ignoring end-of-sequence.
    ignore_eos: bool = False
    # Workload-attached output length (tokens) for the sim engine; 0 = unknown.
    output_len_hint: int = 0
    # Log-probabilities of this many most likely tokens per output token (None = none).
    logprobs: int | None = None
    # Restrict the next token to these ids (vLLM's ``allowed_token_ids``; prefill-only
    # scoring asks for one token over a few candidates). Empty = no restriction.
    allowed_token_ids: list[int] = []
    # Also report these tokens' log-probabilities at each output position, whatever their
    # rank (``/v1/score``: every candidate's). Empty = only the ``logprobs`` most likely.
    logprob_token_ids: list[int] = []
    # OpenAI's penalties on tokens already generated (-2..2): each next token's logit is
    # lowered by ``presence_penalty`` if the token occurred in the output so far and by
    # ``frequency_penalty`` times the times it did.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class ErrorInfo(msgspec.Struct, omit_defaults=True):
    """An error carried in a reply instead of raising across the bus."""

    message: str
    # Machine-readable kind: "bad_request", "overloaded", "unavailable", "internal", ...
    code: str = "internal"
    # True when the caller may retry the same request elsewhere.
    retriable: bool = False
    # The request option at fault, for a "bad_request" (the edge's 400 names it).
    param: str = ""


# --------------------------------------------------------------------------- tokenizer


class TokenizeRequest(_Msg):
    """Text or chat messages to token ids (subject ``tok.encode``)."""

    request_id: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    # Add BOS etc. for plain text; chat prompts get the chat template instead.
    add_special_tokens: bool = True
    # For chat: append the assistant turn header so the model answers.
    add_generation_prompt: bool = True


class TokenizeReply(_Msg):
    request_id: str
    token_ids: list[int] = []
    error: ErrorInfo | None = None


class DetokenizeRequest(_Msg):
    """Token ids to text (subject ``tok.encode`` too; same queue group)."""

    request_id: str
    token_ids: list[int]


class DetokenizeReply(_Msg):
    request_id: str
    text: str = ""
    error: ErrorInfo | None = None


TokenizerRequest = TokenizeRequest | DetokenizeRequest
TokenizerReply = TokenizeReply | DetokenizeReply


# --------------------------------------------------------------------------- predictor


class PredictLengthRequest(_Msg):
    """Initial output-length prediction for a prompt (subject ``predict.length``)."""

    request_id: str
    prompt_tokens: int
    workload: str = ""
    token_ids: list[int] = []


class LengthDistribution(msgspec.Struct, omit_defaults=True):
    """A predicted output length as TRAIL's bin distribution (shared/trail/lengths.py)."""

    # Bin edges in output tokens: bin i is [edges[i], edges[i+1]); the last one is open.
    edges: list[float]
    # Probability of each bin (len(edges) - 1 values, summing to 1).
    probs: list[float]


class PredictLengthReply(_Msg):
    request_id: str
    # Predicted number of output tokens.
    predicted_tokens: float = 0.0
    error: ErrorInfo | None = None
    # The trained model's distribution behind predicted_tokens (None from the prior); the
    # worker seeds its in-process refinement with it.
    distribution: LengthDistribution | None = None


# --------------------------------------------------------------------------- scheduler


class TokenizedRequest(_Msg):
    """A request once its prompt is token ids: what the edge asks the scheduler to route
    (subject ``sched.route``) and then submits to the chosen worker
    (``worker.<id>.submit``), one message for both stages.

    The scheduler needs the prompt's block hashes and length, not its tokens: the edge
    routes a copy with ``token_ids`` empty (a long prompt's ids would be most of the bytes
    the scheduler reads) and the hashes packed (``routing_copy``), and ``prompt_tokens``
    says how long the prompt is."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    # prefixmesh block hashes of the prompt's full 16-token blocks (tenant-salted chain):
    # the scheduler matches them against its prefix tree, the engine against its cache.
    block_hashes: list[int] = []
    # Prompt length (tokens); 0 = len(token_ids).
    prompt_tokens: int = 0
    # Subject the worker streams GenerateChunkEvent / RequestDoneEvent to.
    reply_to: str = ""
    tenant: str = ""
    # Predicted output tokens (0 = none: the scheduler uses its windowed average, the
    # local policy its own).
    predicted_output: float = 0.0
    # The predictor's bin distribution behind predicted_output (None = none).
    predicted_distribution: LengthDistribution | None = None
    # Offline batch id for batch-group scheduling ("" = interactive).
    batch_id: str = ""
    # Absolute wall-clock deadline (unix seconds, 0 = none).
    deadline: float = 0.0
    # Creation time at the edge (unix seconds) for queue-time accounting.
    created: float = 0.0
    # Workers the edge already tried for this request (retry after a failure).
    exclude: list[str] = []
    # The edge reads ``RequestDoneEvent.last``: the worker may put the last chunk inside the
    # done event (False: an edge from before it, which gets every chunk on its own).
    done_carries_last: bool = False
    # Where the worker may send this request's stream events together with those of the
    # edge's other requests ready at the same time (``StreamBatch``); "" = each event on
    # its own to ``reply_to``.
    stream_batch_to: str = ""
    # The block hashes as little-endian int64s, 8 bytes each (``blocks.pack_hashes``), in
    # place of ``block_hashes``, on the copy the edge routes (``routing_copy``): the
    # scheduler's tree walk reads a few of a prompt's hashes where decoding a list makes an
    # int object of every one. A scheduler from before this field routes such a copy as
    # if the prompt shared nothing: upgrade the schedulers before the edges.
    packed_hashes: bytes = b""


class RouteReply(_Msg):
    request_id: str
    worker_id: str = ""
    # Why: "exploit", "explore", "pd_balance", "rebalance", "replicate", "round_robin", ...
    decision: str = ""
    # Tokens the scheduler believes are cached on the chosen worker.
    matched_tokens: int = 0
    error: ErrorInfo | None = None


class ResyncRequest(_Msg):
    """Scheduler asks a worker to re-send its whole cache state (sequence gap detected)."""

    worker_id: str
    reason: str = ""


class RouteBatchRequest(_Msg):
    """Several routing requests in one message (subject ``sched.route``): what an edge
    asks in one turn of its event loop goes together, so a busy edge pays one NATS message
    per batch instead of one per request. Decided in order."""

    requests: list[TokenizedRequest]


class RouteBatchReply(_Msg):
    """The answers to a ``RouteBatchRequest``, one ``RouteReply`` per request, in order."""

    replies: list[RouteReply]


SchedulerRequest = TokenizedRequest | RouteBatchRequest


# --------------------------------------------------------------------------- worker


class AbortRequest(_Msg):
    """Abort a request on a worker (subject ``worker.<id>.abort``)."""

    request_id: str
    reason: str = ""


class ResumeRequest(_Msg):
    """Resend a request's stream from output token ``from_index`` on, and its done event
    if it ended (``worker.<id>.submit``): the edge may have missed events, e.g. across a
    NATS restart. Refused (``not_found``) when the worker no longer knows the request."""

    request_id: str
    from_index: int = 0


class SubmitReply(_Msg):
    """A worker's acknowledgement of a TokenizedRequest: queued, or refused with a reason."""

    request_id: str
    worker_id: str = ""
    accepted: bool = True
    error: ErrorInfo | None = None


class SubmitBatch(_Msg):
    """Several requests to queue, in one message: an edge's placements of one turn of its
    event loop (``sched.place``), and the scheduler's share of them for one worker
    (``worker.<id>.submit``). Answered by ``SubmitReplies``."""

    requests: list[TokenizedRequest]


class SubmitReplies(_Msg):
    """The answers to a ``SubmitBatch``, one ``SubmitReply`` per request, in order."""

    replies: list[SubmitReply]


WorkerRequest = TokenizedRequest | AbortRequest | ResyncRequest | ResumeRequest | SubmitBatch


class TopLogprob(msgspec.Struct, omit_defaults=True, array_like=True):
    """One candidate token and its log-probability (natural log)."""

    token_id: int
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, omit_defaults=True, array_like=True):
    """Log-probability of one generated token and the most likely alternatives."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = []


class GenerateChunkEvent(_Msg):
    """Newly generated tokens of one request, streamed to ``TokenizedRequest.reply_to``."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    # Index of the first token of this chunk in the output.
    index: int = 0
    # One entry per token of ``token_ids`` when the request asked for logprobs.
    logprobs: list[TokenLogprob] = []
    # Prompt tokens served from the prefix cache (known from the first token on), so an
    # edge that ends a stream early (stop string) still reports cached tokens.
    cached_tokens: int = 0


class RequestDoneEvent(_Msg):
    """A request's end, one message for two readers: the last message of its stream (to
    ``TokenizedRequest.reply_to``) and its completion record (subject ``done``: the
    scheduler's load window, the metrics service)."""

    request_id: str
    worker_id: str
    finish_reason: str = "length"  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens served from the prefix cache.
    cached_tokens: int = 0
    # Seconds spent waiting in the worker before the first scheduled step.
    queue_s: float = 0.0
    # Seconds from arrival at the worker to the first output token.
    ttft_s: float = 0.0
    # Seconds from arrival at the worker to completion.
    latency_s: float = 0.0
    tenant: str = ""
    error: ErrorInfo | None = None
    # True when no model ran (the sim backend): tokens and log-probabilities are simulated.
    simulated: bool = False
    # On the stream only: the request's last chunk, carried by its done event (one message
    # fewer; a one-token request is then one message). The edge reads it as the chunk
    # that precedes the done event; never set on ``done``.
    last: GenerateChunkEvent | None = None


StreamEvent = GenerateChunkEvent | RequestDoneEvent


class StreamBatch(_Msg):
    """Stream events of several of one edge's requests that a worker had ready at once
    (one engine step), in order, in one message (``TokenizedRequest.stream_batch_to``):
    one message per edge and step instead of one per event."""

    events: list[StreamEvent]


StreamMessage = StreamEvent | StreamBatch


class RequestDoneBatch(_Msg):
    """The completion records one worker had ready at once (subject ``done``; a single
    record goes as itself): one message per engine step instead of one per request."""

    events: list[RequestDoneEvent]


def done_records(msg: object) -> list[RequestDoneEvent]:
    """The completion records a message on ``done`` carries: itself, a batch's, or none."""
    if isinstance(msg, RequestDoneEvent):
        return [msg]
    if isinstance(msg, RequestDoneBatch):
        return msg.events
    return []


# ------------------------------------------------------------------ KV events (vLLM schema)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks newly cached on a worker; ``token_ids`` covers all of them in order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks evicted from a worker's cache."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """The worker's whole prefix cache was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(_Msg):
    """vLLM's EventBatch plus the worker id and a per-worker sequence number (``kv.<id>``)."""

    worker_id: str
    seq: int
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None
    # The engine instance that sent the batch (``LoadReportEvent.engine_id``).
    engine_id: str = ""


# --------------------------------------------------------------------------- load and completion


class LoadReportEvent(_Msg):
    """A worker's periodic load snapshot (subject ``load.<id>``, every 250 ms by default)."""

    worker_id: str
    ts: float
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    # Fraction of the last window's scheduled tokens that were decode tokens, in [0, 1].
    decode_share: float = 0.0
    # Cached prompt tokens / prompt tokens over the last window, in [0, 1].
    hit_ratio: float = 0.0
    # Sum of (remaining prompt + remaining output) tokens queued or running.
    outstanding_tokens: int = 0
    backend: str = "sim"
    model: str = ""
    # Mean seconds a request waited in this worker's queue over the last window.
    avg_queue_s: float = 0.0
    # Last sequence number published on ``kv.<id>`` (lets the scheduler spot losses).
    kv_seq: int = 0
    # Steps executed over the last window and mean step duration (seconds).
    steps: int = 0
    avg_step_s: float = 0.0
    # The worker's cost-model profile (shared/profiles): E2 prices its GPU time with it,
    # so a fleet that mixes GPUs is priced per GPU. Empty: the scheduler's own profile.
    profile: str = ""
    # Id of the engine instance, new at every engine start ("": not told, an older
    # worker): another id under the same worker id means the engine restarted, its cache
    # empty, before its first KV event says anything.
    engine_id: str = ""


class BatchProgressEvent(_Msg):
    """An offline batch's progress, from the edge running it (subject ``batch.progress``)."""

    batch_id: str
    # OpenAI batch status: "validating", "in_progress", "finalizing", "completed", ...
    status: str
    total: int = 0
    completed: int = 0
    failed: int = 0
    ts: float = 0.0


class HotPrefix(msgspec.Struct, omit_defaults=True):
    """One of the scheduler's most requested prefixes (a prefix-tree node)."""

    # Last block hash of the prefix, hex (block hashes chain, so it names the whole prefix).
    prefix_id: str
    # Prefix length from the start of the prompt (tokens).
    tokens: int
    # Requests routed through this prefix in the policy window, over all workers.
    requests: int
    # Workers believed to cache the whole prefix.
    workers: list[str] = []
    # Window requests per worker under this prefix.
    requests_by_worker: dict[str, int] = {}


class SchedulerStatsEvent(_Msg):
    """The active scheduler's periodic summary for the metrics service (``sched.stats``)."""

    scheduler_id: str
    ts: float
    policy: str
    # Decisions since this instance started, by kind ("exploit", "explore", ...).
    decisions: dict[str, int] = {}
    # Prefix-tree size (0 for policies without a tree).
    tree_nodes: int = 0
    tree_tokens: int = 0
    workers: int = 0
    hot_prefixes: list[HotPrefix] = []
    # Mean age of KV event batches on arrival over the last period (seconds, wall clock).
    kv_lag_s: float = 0.0
    kv_gaps: int = 0
    # Hot-prefix replicas added / dropped by the policy's background task since start.
    replicas_added: int = 0
    replicas_dropped: int = 0


class RoutedRequest(msgspec.Struct, omit_defaults=True, array_like=True):
    """One routing decision, as much of the request as a peer needs to charge it."""

    request_id: str
    worker_id: str
    # The prompt's block hashes: the peer records the prefix on the worker's tree path.
    # Empty when ``packed_hashes`` carries them.
    block_hashes: list[int]
    prompt_tokens: int
    max_tokens: int = 0
    # The edge's predicted output tokens (0: none; the peer uses its window average).
    predicted_output: float = 0.0
    tenant: str = ""
    # The decision's kind ("exploit", "pd_balance", ...) and the prompt tokens the deciding
    # replica believed cached on the worker (the prefill it charged is prompt - this).
    kind: str = ""
    matched_tokens: int = 0
    # The block hashes as little-endian int64s, 8 bytes each (block hashes are Python
    # hashes: signed 64-bit). The peer reads the few its tree walk needs in place, where
    # decoding a list makes one int object per block (half the cost of a peer's decision).
    packed_hashes: bytes = b""


class RoutingDecisionsEvent(_Msg):
    """What one scheduler replica routed in one turn (``sched.decisions``): every other
    replica charges these as if it had routed them, so N replicas splitting the traffic
    each still see the whole in-flight load."""

    scheduler_id: str
    ts: float
    decisions: list[RoutedRequest]


BusEvent = (KvEventBatch | LoadReportEvent | RequestDoneEvent | BatchProgressEvent
            | SchedulerStatsEvent | RoutingDecisionsEvent | RequestDoneBatch)


# --------------------------------------------------------------------------- codecs

ENCODER = msgspec.msgpack.Encoder()

# The union decoders are annotated: mypy types ``Decoder(A | B)`` as ``Decoder[Any]``, and the
# annotation is what lets Bus.request/serve/subscribe check replies and handlers.
_Decoder = msgspec.msgpack.Decoder

TOKENIZER_REQUEST: _Decoder[TokenizerRequest] = _Decoder(TokenizerRequest)
TOKENIZER_REPLY: _Decoder[TokenizerReply] = _Decoder(TokenizerReply)
PREDICT_REQUEST = _Decoder(PredictLengthRequest)
PREDICT_REPLY = _Decoder(PredictLengthReply)
ROUTE_REQUEST: _Decoder[SchedulerRequest] = _Decoder(SchedulerRequest)
ROUTE_REPLY = _Decoder(RouteReply)
ROUTE_BATCH_REPLY: _Decoder[RouteReply | RouteBatchReply] = _Decoder(RouteReply | RouteBatchReply)
PLACE_REQUEST = _Decoder(SubmitBatch)
WORKER_REQUEST: _Decoder[WorkerRequest] = _Decoder(WorkerRequest)
SUBMIT_REPLY = _Decoder(SubmitReply)
SUBMIT_REPLIES: _Decoder[SubmitReply | SubmitReplies] = _Decoder(SubmitReply | SubmitReplies)
STREAM_EVENT: _Decoder[StreamMessage] = _Decoder(StreamMessage)
BUS_EVENT: _Decoder[BusEvent] = _Decoder(BusEvent)


def encode(msg: msgspec.Struct) -> bytes:
    """Encode any wire message to msgpack bytes."""
    return ENCODER.encode(msg)


def routing_copy(req: TokenizedRequest) -> TokenizedRequest:
    """What the edge asks the scheduler to route for ``req``: no token ids (the scheduler
    reads the hashes and the length) and the hashes packed (a list where they do not pack)."""
    packed = pack_hashes(req.block_hashes)
    if not packed:
        return msgspec.structs.replace(req, token_ids=[])
    return msgspec.structs.replace(req, token_ids=[], block_hashes=[], packed_hashes=packed)


def route_message(requests: list[TokenizedRequest]) -> SchedulerRequest:
    """What ``sched.route`` carries for ``requests``: one goes as itself (any scheduler
    reads it), several as a ``RouteBatchRequest``."""
    return requests[0] if len(requests) == 1 else RouteBatchRequest(requests=requests)


def submit_replies(data: bytes) -> list[SubmitReply]:
    """The replies in the answer to a ``SubmitBatch``, in order (the caller checks their
    count). ValueError for one ``SubmitReply`` answering the whole message (a receiver
    that could not read it: a malformed batch) or bytes that do not decode."""
    reply = SUBMIT_REPLIES.decode(data)
    if isinstance(reply, SubmitReply):
        why = reply.error.message if reply.error else "one reply"
        raise ValueError(f"the batch answered as a whole: {why}")
    return reply.replies


def route_replies(data: bytes) -> list[RouteReply]:
    """The ``RouteReply`` list of a ``sched.route`` reply (one reply or a batch's)."""
    reply = ROUTE_BATCH_REPLY.decode(data)
    return [reply] if isinstance(reply, RouteReply) else reply.replies
