"""OpenAI request parsing and validation (pure: bytes in, typed request or ApiError out)."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from prefixmesh.shared.wire import ChatMessage, ErrorInfo, SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP_SEQUENCES = 4
MAX_N = 16
DEFAULT_MAX_TOKENS = 16
# Most choices one request may ask for (n times the number of prompts).
MAX_CHOICES = 64
# Most log-probabilities per token: completions ``logprobs`` (OpenAI allows 5, vLLM 20)
# and chat ``top_logprobs`` (OpenAI: 20).
MAX_LOGPROBS = 20
MAX_ALLOWED_TOKENS = 256


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


# A worker's refusal (ErrorInfo.code) as the client's (HTTP status, error type); any other
# code is a 503 with Retry-After (the mesh could not take the request now).
REFUSALS = {"overloaded": (429, "rate_limit_error"),
            "bad_request": (400, "invalid_request_error")}


def refusal_error(err: ErrorInfo) -> ApiError:
    """The client's error for a worker's refusal: 400 naming the option the backend cannot
    serve (never a 503: retrying cannot help), 429 when it is full, else 503."""
    status, kind = REFUSALS.get(err.code, (503, "service_unavailable"))
    return ApiError(status, err.message, type=kind, param=err.param or None, code=err.code,
                    headers={"Retry-After": "1"} if status != 400 else None)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extension: generate exactly max_tokens.
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Read only to refuse them (``_refuse_unsupported``): dropped silently they would change
    # what the client asked for without a word.
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None


class _CompletionBody(_Common):
    prompt: Any = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None
    # vLLM extension: restrict generated tokens to these ids.
    allowed_token_ids: list[int] | None = None


class _ChatMessageBody(msgspec.Struct):
    role: str
    content: Any = None
    name: str | None = None


class _ChatBody(_Common):
    messages: list[_ChatMessageBody] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


@dataclass(slots=True)
class ParsedRequest:
    """A validated completion or chat request."""

    kind: str  # "completion" | "chat"
    model: str
    # Completions: one entry per prompt (text or token ids). Chat: empty.
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[ChatMessage] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    user: str = ""


_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


def decode_body(body: bytes, typ: type) -> Any:
    """Decode a JSON request body into ``typ``; OpenAI-style 400s naming the bad field."""
    if not body.strip():
        raise ApiError(400, "request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _MISSING.search(text) or _PATH.search(text)
        if "Expected `object`, got" in text and m is None:
            raise ApiError(400, "request body must be a JSON object") from None
        raise ApiError(400, f"invalid request: {text}", param=m.group(1) if m else None) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON: {exc}") from None


def _sampling(b: _Common, max_tokens: int | None, context_length: int, cap: int,
              logprobs: int | None) -> SamplingParams:
    # The prompt takes at least one token of the context.
    limit = context_length - 1
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, limit, cap or limit)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if cap and max_tokens > cap:
        raise ApiError(400, f"max_tokens must be at most {cap} on this server, got "
                       f"{max_tokens}", param="max_tokens")
    if max_tokens > limit:
        raise ApiError(400, f"max_tokens is {max_tokens}, but this model's maximum context "
                       f"length is {context_length} tokens (prompt included), so at most "
                       f"{limit}", param="max_tokens", code="context_length_exceeded")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
    temperature = 1.0 if b.temperature is None else b.temperature
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, "temperature must be between 0 and 2", param="temperature")
    top_p = 1.0 if b.top_p is None else b.top_p
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
    if b.stop is None:
        stop: list[str] = []
    elif isinstance(b.stop, str):
        stop = [b.stop]
    else:
        stop = list(b.stop)
    if len(stop) > MAX_STOP_SEQUENCES or any(not s for s in stop):
        raise ApiError(400, f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings",
                       param="stop")
    if b.seed is not None and not -(2**63) <= b.seed < 2**64:
        raise ApiError(400, "seed must fit in 64 bits", param="seed")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          seed=b.seed, stop=stop, ignore_eos=b.ignore_eos, logprobs=logprobs,
                          presence_penalty=_penalty(b.presence_penalty, "presence_penalty"),
                          frequency_penalty=_penalty(b.frequency_penalty, "frequency_penalty"))


def _penalty(value: float | None, name: str) -> float:
    """A presence or frequency penalty: OpenAI's range, -2 to 2 (None: 0)."""
    if value is not None and not -2.0 <= value <= 2.0:
        raise ApiError(400, f"{name} must be between -2 and 2, got {value:g}", param=name)
    return value or 0.0


def check_model(name: str, models: Collection[str]) -> None:
    """400 for an empty model name, OpenAI's 404 for one that is not served."""
    if not name:
        raise ApiError(400, "model must be a non-empty string", param="model")
    if name not in models:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model",
                       code="model_not_found")


def _check_common(b: _Common, models: Mapping[str, int]) -> None:
    check_model(b.model, models)
    if not 1 <= b.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}", param="n")
    _refuse_unsupported(b)


def _refuse_unsupported(b: _Common) -> None:
    """400 naming an OpenAI option no backend here serves, when the request uses it (an
    empty or neutral value passes: clients often send those)."""
    if b.logit_bias:
        raise ApiError(400, "logit_bias is not supported (allowed_token_ids restricts the "
                       "tokens instead)", param="logit_bias")
    if b.response_format and b.response_format.get("type", "text") != "text":
        raise ApiError(400, f"response_format {b.response_format.get('type')!r} is not "
                       "supported: no guided decoding here, only text", param="response_format")
    if isinstance(b, _CompletionBody):
        if b.best_of is not None and b.best_of != b.n:
            raise ApiError(400, "best_of is not supported apart from best_of equal to n "
                           "(n samples are returned as they are)", param="best_of")
        if b.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
    if isinstance(b, _ChatBody) and (b.tools or b.tool_choice not in (None, "none")):
        raise ApiError(400, "tools are not supported: no tool-call parsing here",
                       param="tools" if b.tools else "tool_choice")


def parse_prompts(raw: Any, vocab_size: int) -> list[str | list[int]]:
    """Normalise OpenAI's four prompt shapes: str, [str], [int], [[int]]."""
    if raw is None:
        raise ApiError(400, "prompt is required", param="prompt")
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, int) and not isinstance(x, bool)
                                                for x in raw):
        items = [raw]
    elif isinstance(raw, list):
        items = raw
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids "
                       "or a list of token-id lists", param="prompt")
    if not items:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    out: list[str | list[int]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            out.append(item)
        elif isinstance(item, list) and item and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            bad = next((t for t in item if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is out of range [0, {vocab_size})",
                               param="prompt")
            out.append(item)
        else:
            raise ApiError(400, "each prompt must be a non-empty string or list of token ids",
                           param="prompt")
    return out


def allowed_tokens(ids: list[int] | None, vocab_size: int) -> list[int]:
    """Validate ``allowed_token_ids`` (order kept, duplicates dropped)."""
    if ids is None:
        return []
    if not 1 <= len(ids) <= MAX_ALLOWED_TOKENS:
        raise ApiError(400, f"allowed_token_ids takes 1 to {MAX_ALLOWED_TOKENS} token ids",
                       param="allowed_token_ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is out of range [0, {vocab_size})",
                       param="allowed_token_ids")
    return list(dict.fromkeys(ids))


def check_choices(n: int, prompts: int) -> None:
    if n * prompts > MAX_CHOICES:
        raise ApiError(400, f"n times the number of prompts must be at most {MAX_CHOICES}",
                       param="n")


def parse_completion(body: bytes, models: Mapping[str, int], vocab_size: int,
                     max_tokens_cap: int = 0) -> ParsedRequest:
    """Validate a ``/v1/completions`` body; ``models``: served name -> context length;
    ``max_tokens_cap``: the server's own bound on ``max_tokens`` (0 = none)."""
    b = decode_body(body, _CompletionBody)
    _check_common(b, models)
    if b.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    prompts = parse_prompts(b.prompt, vocab_size)
    check_choices(b.n, len(prompts))
    sampling = _sampling(b, b.max_tokens, models[b.model], max_tokens_cap, b.logprobs)
    sampling.allowed_token_ids = allowed_tokens(b.allowed_token_ids, vocab_size)
    return ParsedRequest(
        kind="completion", model=b.model, prompts=prompts, n=b.n,
        stream=b.stream, include_usage=bool(b.stream_options and b.stream_options.include_usage),
        sampling=sampling, user=b.user or "",
    )


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                raise ApiError(400, "only text content parts are supported",
                               param=f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ApiError(400, "message content must be a string or a list of text parts",
                   param=f"messages[{index}].content")


def parse_chat(body: bytes, models: Mapping[str, int], max_tokens_cap: int = 0
               ) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body (arguments as ``parse_completion``)."""
    b = decode_body(body, _ChatBody)
    _check_common(b, models)
    if not b.messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    messages = []
    for i, m in enumerate(b.messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}",
                           param=f"messages[{i}].role")
        # OpenAI's "developer" role is the newer name of "system"; chat templates know only
        # the latter.
        role = "system" if m.role == "developer" else m.role
        messages.append(ChatMessage(role=role, content=_content_text(m.content, i), name=m.name))
    if all(not m.content for m in messages):
        raise ApiError(400, "messages must contain some text", param="messages")
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    if b.top_logprobs is not None and not b.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (b.top_logprobs or 0) if b.logprobs else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}",
                       param="top_logprobs")
    return ParsedRequest(
        kind="chat", model=b.model, messages=messages, n=b.n, stream=b.stream,
        include_usage=bool(b.stream_options and b.stream_options.include_usage),
        sampling=_sampling(b, max_tokens, models[b.model], max_tokens_cap, logprobs),
        user=b.user or "",
    )
