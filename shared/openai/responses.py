"""OpenAI response bodies (pure): completions, chat completions, their stream chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixmesh.shared.wire import GenerateChunkEvent, RequestDoneEvent, TokenLogprob


@dataclass(slots=True)
class ChoiceResult:
    """What one choice produced, accumulated from its stream."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    worker_id: str = ""
    # Per output token, when the request asked for logprobs (else None).
    logprobs: list[TokenLogprob] | None = None
    # True when the sim backend produced it (no model: tokens and logprobs simulated).
    simulated: bool = False

    @classmethod
    def start(cls, index: int, prompt_tokens: int, logprobs: bool) -> ChoiceResult:
        """An empty result; ``logprobs``: collect the tokens' log-probabilities."""
        return cls(index=index, prompt_tokens=prompt_tokens, logprobs=[] if logprobs else None)

    def take(self, event: GenerateChunkEvent | RequestDoneEvent) -> None:
        """Fold one event of the choice's stream into the result."""
        if isinstance(event, GenerateChunkEvent):
            self.text += event.text
            self.completion_tokens += len(event.token_ids)
            self.cached_tokens = event.cached_tokens
            if self.logprobs is not None:
                self.logprobs.extend(event.logprobs)
            return
        self.finish_reason = event.finish_reason
        self.completion_tokens = event.completion_tokens
        self.cached_tokens = event.cached_tokens
        self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
        self.worker_id = event.worker_id
        self.simulated = event.simulated
        if event.error is not None:
            self.error = event.error.message


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, c: ChoiceResult, count_prompt: bool) -> None:
        if count_prompt:
            self.prompt_tokens += c.prompt_tokens
            self.cached_tokens += c.cached_tokens
        self.completion_tokens += c.completion_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class ResponseMeta:
    id: str
    created: int
    model: str
    kind: str  # "completion" | "chat"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object; ``offset``: text length before them."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object (``content`` only)."""
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**one(e.token, e.logprob),
                         "top_logprobs": [one(t.token, t.logprob) for t in e.top]}
                        for e in entries],
            "refusal": None}


def logprobs_body(kind: str, entries: list[TokenLogprob] | None,
                  offset: int = 0) -> dict[str, Any] | None:
    """A choice's ``logprobs`` field in the shape of ``kind`` (None when not asked for)."""
    if entries is None:
        return None
    return chat_logprobs(entries) if kind == "chat" else completion_logprobs(entries, offset)


def _choice(meta: ResponseMeta, c: ChoiceResult) -> dict[str, Any]:
    lp = logprobs_body(meta.kind, c.logprobs)
    if meta.kind == "chat":
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": lp, "finish_reason": c.finish_reason}
    return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}


def full_response(meta: ResponseMeta, choices: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
    """A non-streaming response body."""
    return {
        "id": meta.id, "object": meta.object, "created": meta.created, "model": meta.model,
        "choices": [_choice(meta, c) for c in sorted(choices, key=lambda c: c.index)],
        "usage": usage.body(), **meta.extra,
    }


def chunk(meta: ResponseMeta, index: int, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    """One streaming chunk for one choice (``logprobs`` from ``logprobs_body``)."""
    if meta.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
    return {"id": meta.id, "object": meta.chunk_object, "created": meta.created,
            "model": meta.model, "choices": [choice]}


def usage_chunk(meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
    """The final chunk with ``stream_options.include_usage``: no choices, only usage."""
    return {"id": meta.id, "object": meta.chunk_object, "created": meta.created,
            "model": meta.model, "choices": [], "usage": usage.body()}
