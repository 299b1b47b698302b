"""Tokenizer requests answered without I/O: one wire request in, one reply out.

The tokenizer service answers ``tok.encode`` with ``handle``; the edge calls the same
function for the short prompts it tokenizes itself, so both validate alike and fail with
the same errors. ``handle`` validates and never raises: a bad request becomes
``ErrorInfo(code="bad_request")`` and an unexpected failure ``ErrorInfo(code="internal")``,
so the NATS shell always has a reply to send and a caller never waits for a timeout.
"""

from __future__ import annotations

import logging

from prefixmesh.shared.text.tokenizer import TextTokenizer
from prefixmesh.shared.wire import (
    DetokenizeReply,
    DetokenizeRequest,
    ErrorInfo,
    TokenizeReply,
    TokenizeRequest,
)

log = logging.getLogger(__name__)

# OpenAI chat roles the ChatML template can carry ("developer" is not one SmolLM2 knows).
ALLOWED_ROLES = frozenset({"system", "user", "assistant", "tool"})
BAD_REQUEST = "bad_request"
INTERNAL = "internal"


class BadRequest(ValueError):
    """A request that can never succeed as sent."""


def handle(
    tok: TextTokenizer, req: TokenizeRequest | DetokenizeRequest
) -> TokenizeReply | DetokenizeReply:
    """Answer one tokenizer request; errors go in the reply, never raised."""
    if isinstance(req, DetokenizeRequest):
        try:
            return DetokenizeReply(request_id=req.request_id, text=detokenize(tok, req))
        except Exception as exc:
            return DetokenizeReply(request_id=req.request_id, error=_error(req.request_id, exc))
    request_id = getattr(req, "request_id", "")
    try:
        if not isinstance(req, TokenizeRequest):
            raise BadRequest(f"not a tokenizer request: {type(req).__name__}")
        return TokenizeReply(request_id=request_id, token_ids=tokenize(tok, req))
    except Exception as exc:
        return TokenizeReply(request_id=request_id, error=_error(request_id, exc))


def prompt_chars(req: TokenizeRequest) -> int:
    """Characters of a request's text or of its messages' contents (its encoding cost)."""
    if req.messages is not None:
        return sum(len(m.content) for m in req.messages)
    return len(req.text or "")


def tokenize(tok: TextTokenizer, req: TokenizeRequest) -> list[int]:
    """Token ids of a request's text or chat messages; raises BadRequest."""
    if req.text is not None and req.messages is not None:
        raise BadRequest("give text or messages, not both")
    if req.messages is None:
        if req.text is None:
            raise BadRequest("give either text or messages")
        return tok.encode(req.text, add_special_tokens=req.add_special_tokens)
    if not req.messages:
        raise BadRequest("messages is empty")
    for i, message in enumerate(req.messages):
        if message.role not in ALLOWED_ROLES:
            raise BadRequest(
                f"messages[{i}].role={message.role!r} is not one of {sorted(ALLOWED_ROLES)}"
            )
    return tok.encode_chat(req.messages, add_generation_prompt=req.add_generation_prompt)


def detokenize(tok: TextTokenizer, req: DetokenizeRequest) -> str:
    """Text of a request's token ids (special tokens skipped); raises BadRequest."""
    for i, token_id in enumerate(req.token_ids):
        # The Rust decoder silently drops unknown ids; an id out of range is a caller bug.
        if not 0 <= token_id < tok.vocab_size:
            raise BadRequest(f"token_ids[{i}]={token_id} is outside [0, {tok.vocab_size})")
    return tok.decode(req.token_ids)


def _error(request_id: str, exc: Exception) -> ErrorInfo:
    if isinstance(exc, BadRequest):
        return ErrorInfo(message=str(exc), code=BAD_REQUEST)
    log.exception("tokenizer request %s failed", request_id)
    return ErrorInfo(message=f"{type(exc).__name__}: {exc}", code=INTERNAL)
