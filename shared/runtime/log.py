"""Structured logging with the current request id attached to every record."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _ContextFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.service = self.service
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "service": getattr(record, "service", ""),
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(service: str, level: str = "INFO", as_json: bool = False) -> None:
    """Configure the root logger for one service process (stderr, text or JSON lines)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter(service))
    if as_json:
        handler.setFormatter(_JsonFormatter())
    else:
        fmt = logging.Formatter(
            "%(asctime)s %(levelname)s %(service)s %(name)s [%(request_id)s] %(message)s"
        )
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # nats-py logs every reconnect attempt at ERROR; keep them visible but not noisy.
    logging.getLogger("nats").setLevel(logging.WARNING)


def bind_request(request_id: str) -> contextvars.Token:
    """Attach ``request_id`` to log records of the current task."""
    return REQUEST_ID.set(request_id)
