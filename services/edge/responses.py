"""OpenAI response bodies (pure): completions, chat completions, their stream chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


def _choice(meta: ResponseMeta, c: ChoiceResult) -> dict[str, Any]:
    if meta.kind == "chat":
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": None, "finish_reason": c.finish_reason}
    return {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}


def full_response(meta: ResponseMeta, choices: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
    """A non-streaming response body."""
    return {
        "id": meta.id, "object": meta.object, "created": meta.created, "model": meta.model,
        "choices": [_choice(meta, c) for c in sorted(choices, key=lambda c: c.index)],
        "usage": usage.body(), **meta.extra,
    }


def chunk(meta: ResponseMeta, index: int, text: str | None = None, role: bool = False,
          finish_reason: str | None = None) -> dict[str, Any]:
    """One streaming chunk for one choice."""
    if meta.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
    return {"id": meta.id, "object": meta.chunk_object, "created": meta.created,
            "model": meta.model, "choices": [choice]}


def usage_chunk(meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
    """The final chunk with ``stream_options.include_usage``: no choices, only usage."""
    return {"id": meta.id, "object": meta.chunk_object, "created": meta.created,
            "model": meta.model, "choices": [], "usage": usage.body()}
