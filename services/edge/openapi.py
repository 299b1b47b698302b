"""The edge's OpenAPI 3.0 document, served at ``/openapi.json``.

Written by hand beside the parser (``schema.py``, ``scoring.py``) and built from the edge's
config, so the limits it states (models, max_tokens, vocabulary) are the ones enforced.
``tests/e2e/test_fuzz.py`` fuzzes the live edge from this document with schemathesis: a
request the document allows must never get a 5xx, one it forbids must get a 4xx.
The Batch API (``/v1/files``, ``/v1/batches``) is not described here yet.
"""

from __future__ import annotations

from typing import Any

from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.shared.openai.schema import (
    CHAT_ROLES,
    MAX_ALLOWED_TOKENS,
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_SEQUENCES,
)

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_responses(*codes: int) -> dict[str, Any]:
    why = {400: "invalid request", 401: "missing or invalid API key",
           404: "unknown model or route", 413: "request body too large",
           429: "tenant rate limit or in-flight share exceeded (see Retry-After)",
           503: "mesh overloaded or unavailable (see Retry-After)",
           504: "request deadline passed"}
    return {str(c): {"description": why[c], "content": {JSON: {"schema": _ref("Error")}}}
            for c in codes}


def _schemas(cfg: EdgeConfig) -> dict[str, Any]:
    token_id = {"type": "integer", "minimum": 0, "maximum": cfg.vocab_size - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    prompt = {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
         "maxItems": MAX_CHOICES},
        token_ids,
        {"type": "array", "items": token_ids, "minItems": 1, "maxItems": MAX_CHOICES},
    ], "description": "text, texts, token ids, or lists of token ids (one choice set each)"}
    max_tokens = max(cfg.context_lengths.values()) - 1  # a prompt has at least one token
    if cfg.max_tokens_limit:
        max_tokens = min(max_tokens, cfg.max_tokens_limit)
    common = {
        "model": {"type": "string", "enum": list(cfg.model_names)},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens,
                       "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1,
                  "nullable": True},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N,
              "description": f"choices per prompt; n x prompts <= {MAX_CHOICES}"},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean"}}},
        "stop": {"nullable": True, "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1},
             "maxItems": MAX_STOP_SEQUENCES}]},
        "seed": {"type": "integer", "nullable": True, "minimum": -(2**63),
                 "maximum": 2**63 - 1},
        "user": {"type": "string", "nullable": True},
        "ignore_eos": {"type": "boolean", "description": "vLLM extension: generate exactly "
                       "max_tokens"},
        "presence_penalty": {"type": "number", "nullable": True, "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "nullable": True, "minimum": -2, "maximum": 2},
    }
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens",
                                            "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {
            "cached_tokens": {"type": "integer"}}}}}
    content_part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True}}}}},
        "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "properties": {
            **common, "prompt": prompt,
            "echo": {"type": "boolean", "enum": [False], "description": "not supported"},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                         "nullable": True},
            "allowed_token_ids": {"type": "array", "items": token_id, "minItems": 1,
                                  "maxItems": MAX_ALLOWED_TOKENS, "nullable": True,
                                  "description": "vLLM extension: restrict output tokens"}}},
        "ChatMessage": {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": list(CHAT_ROLES)},
            "content": {"nullable": True, "oneOf": [
                {"type": "string"}, {"type": "array", "items": content_part}]},
            "name": {"type": "string", "nullable": True}}},
        "ChatCompletionRequest": {"type": "object", "required": ["model", "messages"],
                                  "properties": {
            **common,
            "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1,
                         "description": "at least one message with text"},
            "max_completion_tokens": {"type": "integer", "minimum": 1,
                                      "maximum": max_tokens, "nullable": True},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                             "nullable": True, "description": "needs logprobs: true"}}},
        "ScoreRequest": {"type": "object", "required": ["model", "prompt"], "properties": {
            "model": common["model"], "prompt": prompt, "user": common["user"],
            "candidates": {"type": "array", "items": {"type": "string", "minLength": 1},
                           "minItems": 1, "maxItems": MAX_ALLOWED_TOKENS,
                           "description": "single-token continuations; exactly one of "
                           "candidates, candidate_token_ids"},
            "candidate_token_ids": {"type": "array", "items": token_id, "minItems": 1,
                                    "maxItems": MAX_ALLOWED_TOKENS}}},
        "Usage": usage,
        "CompletionResponse": {"type": "object", "required": ["id", "object", "created",
                                                              "model", "choices"],
                               "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"}, "text": {"type": "string"},
                "logprobs": {"type": "object", "nullable": True},
                "finish_reason": {"type": "string", "nullable": True}}}},
            "usage": _ref("Usage")}},
        "ChatCompletionResponse": {"type": "object", "required": ["id", "object", "created",
                                                                  "model", "choices"],
                                   "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"},
                "message": {"type": "object", "properties": {
                    "role": {"type": "string"}, "content": {"type": "string"}}},
                "logprobs": {"type": "object", "nullable": True},
                "finish_reason": {"type": "string", "nullable": True}}}},
            "usage": _ref("Usage")}},
        "ScoreResponse": {"type": "object", "required": ["id", "object", "data"], "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["list"]},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "simulated": {"type": "boolean", "description": "true: the sim backend answered "
                          "(no model; pseudo-probabilities)"},
            "data": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"}, "object": {"type": "string"},
                "scores": {"type": "array", "items": {"type": "object", "properties": {
                    "candidate": {"type": "string", "nullable": True},
                    "token_id": {"type": "integer"},
                    "logprob": {"type": "number", "nullable": True},
                    "probability": {"type": "number", "nullable": True}}}}}}},
            "usage": _ref("Usage")}},
        "Model": {"type": "object", "required": ["id", "object"], "properties": {
            "id": {"type": "string"}, "object": {"type": "string"},
            "created": {"type": "integer"}, "owned_by": {"type": "string"}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"type": "string"}, "data": {"type": "array", "items": _ref("Model")}}},
    }


def _post(summary: str, request: str, response: str, streams: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {JSON: {"schema": _ref(response)}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {"200": {"description": "the result (server-sent events with "
                              "stream: true)" if streams else "the result", "content": ok},
                      **_error_responses(400, 401, 404, 413, 429, 503, 504)}}}


def openapi_document(cfg: EdgeConfig) -> dict[str, Any]:
    """The OpenAPI 3.0 document of this edge."""
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "prefixmesh edge", "version": "0.1.0",
                 "description": "OpenAI-compatible API of a prefix-aware serving mesh. "
                 "Every response carries x-request-id."},
        "paths": {
            "/v1/completions": _post("Text completion", "CompletionRequest",
                                     "CompletionResponse", True),
            "/v1/chat/completions": _post("Chat completion", "ChatCompletionRequest",
                                          "ChatCompletionResponse", True),
            "/v1/score": _post("Prefill-only scoring of single-token continuations",
                               "ScoreRequest", "ScoreResponse", False),
            "/v1/models": {"get": {"summary": "Models served", "responses": {
                "200": {"description": "models", "content": {JSON: {
                    "schema": _ref("ModelList")}}}, **_error_responses(401)}}},
            "/v1/models/{model}": {"get": {
                "summary": "One model",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "content": {JSON: {
                    "schema": _ref("Model")}}}, **_error_responses(401, 404)}}},
            "/health": {"get": {"summary": "Liveness", "security": [],
                                "responses": {"200": {"description": "alive"}}}},
        },
        "components": {"schemas": _schemas(cfg)},
    }
    if cfg.auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
