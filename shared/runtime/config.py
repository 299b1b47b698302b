"""Typed configuration, one dataclass per service, loaded from defaults < env < CLI.

Every field is declared once with its default and a help text (units!). The environment
variable for field ``nats_url`` is ``PM_NATS_URL``; the CLI flag is ``--nats-url``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "PM_"

T = TypeVar("T", bound="DataclassInstance")


# ``bounds`` of a TCP port option (0: any free port, or none, as its help says).
PORT = (0, 65535)


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config field with a default and a help text (shown in ``--help``); ``choices``
    (the values allowed) and ``bounds`` (lowest, highest) are checked at load."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass(frozen=True)
class CommonConfig:
    """Settings every service shares: where the bus and store are, and how to name things."""

    nats_url: str = option("nats://127.0.0.1:4222", "NATS server URL(s), comma-separated")
    redis_url: str = option("redis://127.0.0.1:6379/0", "Redis URL for scheduler state")
    subject_prefix: str = option("pm", "prefix of every NATS subject (isolates clusters)")
    redis_prefix: str = option("pm", "prefix of every Redis key")
    log_level: str = option("INFO", "logging level: DEBUG, INFO, WARNING, ERROR")
    log_json: bool = option(False, "log one JSON object per line instead of text")
    drain_timeout_s: float = option(5.0, "seconds to finish in-flight work on shutdown")
    metrics_port: int = option(0, "port of a Prometheus /metrics endpoint (0 = none)",
                               bounds=PORT)


def _field_type(cls: type, f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(cls)
    tp = hints[f.name]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    return tp


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(tp: type, raw: str) -> Any:
    if tp is bool:
        return _parse_bool(raw)
    if tp in (int, float, str, Path):
        return tp(raw)
    raise TypeError(f"unsupported config type {tp}")


def _converter(tp: type) -> Callable[[str], Any]:
    """argparse's ``type=`` for a field of type ``tp``."""
    return lambda raw: _convert(tp, raw)


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """Add one ``--flag`` per field of config dataclass ``cls`` (not for fields declared
    with ``cli=False``: those are set by code only)."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        tp = _field_type(cls, f)
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r}; env {env})"
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=_converter(tp),
                                default=None, metavar=f.name.upper(), help=help_text,
                                choices=f.metadata.get("choices"))


def from_sources(cls: type[T], args: argparse.Namespace | None = None,
                 env: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from defaults, overridden by ``PM_*`` env vars, overridden by CLI args."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        tp = _field_type(cls, f)
        key = ENV_PREFIX + f.name.upper()
        if key in env:
            try:
                values[f.name] = _convert(tp, env[key])
            except (TypeError, ValueError) as exc:
                raise SystemExit(f"bad value for {key}: {exc}") from None
        cli = getattr(args, f.name, None) if args is not None else None
        if cli is not None:
            values[f.name] = cli
        choices = f.metadata.get("choices")
        if choices and f.name in values and values[f.name] not in choices:
            raise SystemExit(f"{f.name} must be one of {', '.join(choices)}")
        bounds = f.metadata.get("bounds")
        if bounds and f.name in values and not bounds[0] <= values[f.name] <= bounds[1]:
            raise SystemExit(f"{f.name} must be between {bounds[0]} and {bounds[1]}, got "
                             f"{values[f.name]}")
    return cls(**values)


def parse(cls: type[T], argv: Sequence[str] | None, prog: str, description: str) -> T:
    """Parse a service's command line into its config dataclass (``--help`` lists all)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls)
    return from_sources(cls, parser.parse_args(argv))
