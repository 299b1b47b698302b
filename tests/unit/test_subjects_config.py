"""Subject names and typed configuration."""

import argparse
from dataclasses import dataclass

import pytest

from prefixmesh.shared.runtime.config import (
    CommonConfig,
    add_arguments,
    from_sources,
    option,
)
from prefixmesh.shared.subjects import Subjects


def test_every_subject_starts_with_the_prefix() -> None:
    s = Subjects("tx")
    names = [s.tokenize, s.predict_length, s.route, s.worker_submit("w1"), s.worker_abort("w1"),
             s.worker_resync("w1"), s.kv("w1"), s.kv_all, s.load("w1"), s.load_all, s.done,
             s.control("x"), s.stream_inbox("e1"), s.stream_reply("e1", "r1")]
    assert all(n.startswith("tx.") for n in names)
    assert len(set(names)) == len(names)
    assert s.worker_submit("w1") == "tx.worker.w1.submit"


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", ""])
def test_subject_tokens_are_validated(bad: str) -> None:
    with pytest.raises(ValueError):
        Subjects("pm").worker_submit(bad)


def test_bad_prefix_is_refused() -> None:
    with pytest.raises(ValueError):
        Subjects("p m")


@dataclass(frozen=True)
class _Cfg(CommonConfig):
    workers: int = option(4, "how many")
    ratio: float = option(0.5, "a ratio")
    flag: bool = option(False, "a flag")


def _parse(argv: list[str], env: dict[str, str]) -> _Cfg:
    p = argparse.ArgumentParser()
    add_arguments(p, _Cfg)
    return from_sources(_Cfg, p.parse_args(argv), env)


def test_defaults_env_then_cli_precedence() -> None:
    assert _parse([], {}).workers == 4
    assert _parse([], {"PM_WORKERS": "8"}).workers == 8
    assert _parse(["--workers", "2"], {"PM_WORKERS": "8"}).workers == 2
    cfg = _parse(["--flag"], {"PM_RATIO": "0.25", "PM_NATS_URL": "nats://x:1"})
    assert cfg.flag is True and cfg.ratio == 0.25 and cfg.nats_url == "nats://x:1"
    assert _parse(["--no-flag"], {"PM_FLAG": "true"}).flag is False


def test_bad_env_value_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="PM_WORKERS"):
        _parse([], {"PM_WORKERS": "many"})


def test_a_port_out_of_range_is_refused_from_the_env_and_the_cli() -> None:
    with pytest.raises(SystemExit, match="metrics_port must be between 0 and 65535, got 99999"):
        _parse(["--metrics-port", "99999"], {})
    with pytest.raises(SystemExit, match="metrics_port must be between 0 and 65535, got -1"):
        _parse([], {"PM_METRICS_PORT": "-1"})
    assert _parse([], {"PM_METRICS_PORT": "65535"}).metrics_port == 65535
