"""NATS subject names. Every subject starts with a configurable prefix (default ``pm``) so
that tests and several clusters can share one NATS server; no other module spells one."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "pm"

# Queue-group names: members of a group share a subject's messages (one gets each).
TOKENIZER_GROUP = "tokenizer"
PREDICTOR_GROUP = "predictor"
SCHEDULER_GROUP = "scheduler"


@dataclass(frozen=True, slots=True)
class Subjects:
    """All subject names under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in " *>\t\r\n"):
            raise ValueError(f"invalid subject prefix {self.prefix!r}")

    @property
    def tokenize(self) -> str:
        return f"{self.prefix}.tok.encode"

    @property
    def predict_length(self) -> str:
        return f"{self.prefix}.predict.length"

    @property
    def route(self) -> str:
        return f"{self.prefix}.sched.route"

    def worker_submit(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{_token(worker_id)}.submit"

    def worker_abort(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{_token(worker_id)}.abort"

    def worker_resync(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{_token(worker_id)}.resync"

    def kv(self, worker_id: str) -> str:
        return f"{self.prefix}.kv.{_token(worker_id)}"

    @property
    def kv_all(self) -> str:
        return f"{self.prefix}.kv.*"

    def load(self, worker_id: str) -> str:
        return f"{self.prefix}.load.{_token(worker_id)}"

    @property
    def load_all(self) -> str:
        return f"{self.prefix}.load.*"

    @property
    def done(self) -> str:
        return f"{self.prefix}.done"

    @property
    def batch_progress(self) -> str:
        return f"{self.prefix}.batch.progress"

    @property
    def sched_stats(self) -> str:
        """The active scheduler's periodic summary (decision mix, hot prefixes)."""
        return f"{self.prefix}.sched.stats"

    def control(self, name: str) -> str:
        return f"{self.prefix}.control.{_token(name)}"

    def stream_inbox(self, edge_id: str) -> str:
        """Wildcard under which one edge receives its requests' token streams."""
        return f"{self.prefix}.stream.{_token(edge_id)}.*"

    def stream_reply(self, edge_id: str, request_id: str) -> str:
        return f"{self.prefix}.stream.{_token(edge_id)}.{_token(request_id)}"


def _token(part: str) -> str:
    """Validate one subject token (no dots, wildcards or whitespace)."""
    if not part or any(c in part for c in ". *>\t\r\n"):
        raise ValueError(f"invalid subject token {part!r}")
    return part
