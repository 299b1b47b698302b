"""NATS subject names. Every subject starts with a configurable prefix (default ``pm``) so
that tests and several clusters can share one NATS server; no other module spells one."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_PREFIX = "pm"

# Queue-group names: members of a group share a subject's messages (one gets each).
TOKENIZER_GROUP = "tokenizer"
PREDICTOR_GROUP = "predictor"
SCHEDULER_GROUP = "scheduler"

# The subjects that take no id, by attribute name: what follows the prefix.
_FIXED = {
    "tokenize": "tok.encode",  # tokenizer queue group: TokenizeRequest -> TokenizeReply
    "predict_length": "predict.length",  # predictor queue group: output-length prediction
    "route": "sched.route",  # scheduler: TokenizedRequest -> RouteReply (or batches of them)
    # scheduler: TokenizedRequest with its token ids -> handed to the chosen worker, whose
    # SubmitReply answers (a SubmitReply without worker id from the scheduler: none)
    "place": "sched.place",
    "kv_all": "kv.*",  # every worker's KV events
    "load_all": "load.*",  # every worker's load reports
    "done": "done",  # completion records (RequestDoneEvent), one per request
    "batch_progress": "batch.progress",  # offline batches' progress
    "sched_stats": "sched.stats",  # a scheduler's summary (decisions, hot prefixes)
    # every scheduler replica's routing decisions (RoutingDecisionsEvent), to all replicas
    "sched_decisions": "sched.decisions",
}


@dataclass(frozen=True, slots=True)
class Subjects:
    """All subject names under one prefix."""

    prefix: str = DEFAULT_PREFIX
    # The fixed subjects (``_FIXED``), spelled out once the prefix is known.
    tokenize: str = field(init=False)
    predict_length: str = field(init=False)
    route: str = field(init=False)
    place: str = field(init=False)
    kv_all: str = field(init=False)
    load_all: str = field(init=False)
    done: str = field(init=False)
    batch_progress: str = field(init=False)
    sched_stats: str = field(init=False)
    sched_decisions: str = field(init=False)

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in " *>\t\r\n"):
            raise ValueError(f"invalid subject prefix {self.prefix!r}")
        for name, rest in _FIXED.items():
            object.__setattr__(self, name, f"{self.prefix}.{rest}")

    def _per(self, kind: str, id_: str, *rest: str) -> str:
        """``prefix.kind.<id>[.rest...]``, the id validated as one subject token."""
        return ".".join((self.prefix, kind, _token(id_), *rest))

    def worker_submit(self, worker_id: str) -> str:
        return self._per("worker", worker_id, "submit")

    def worker_abort(self, worker_id: str) -> str:
        return self._per("worker", worker_id, "abort")

    def worker_resync(self, worker_id: str) -> str:
        return self._per("worker", worker_id, "resync")

    def kv(self, worker_id: str) -> str:
        """One worker's KV events."""
        return self._per("kv", worker_id)

    def load(self, worker_id: str) -> str:
        """One worker's load reports."""
        return self._per("load", worker_id)

    def control(self, name: str) -> str:
        return self._per("control", name)

    def stream_inbox(self, edge_id: str) -> str:
        """Wildcard under which one edge receives its requests' token streams."""
        return self._per("stream", edge_id, "*")

    def stream_reply(self, edge_id: str, request_id: str) -> str:
        return self._per("stream", edge_id, _token(request_id))

    def stream_batch(self, edge_id: str) -> str:
        """Where a worker sends one edge the stream events of several of its requests in
        one message (``StreamBatch``); under ``stream_inbox``, so the same subscription
        reads it (events name their request)."""
        return self._per("stream", edge_id, "_batch")


# What a subject token must not hold: dots, wildcards, whitespace.
_NOT_IN_TOKEN = re.compile(r"[. *>\t\r\n]")


def _token(part: str) -> str:
    """Validate one subject token (no dots, wildcards or whitespace); checked for every
    request's stream subject, so one regex search rather than a scan per character."""
    if not part or _NOT_IN_TOKEN.search(part):
        raise ValueError(f"invalid subject token {part!r}")
    return part
