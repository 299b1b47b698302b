"""Test session fixtures: a real nats-server and redis-server started by the session itself.

Each test gets its own subject prefix and Redis key prefix, so tests never see each other's
traffic even though they share one server of each.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from prefixmesh.shared.runtime.servers import start_nats, start_redis
from tests.helpers import REQUIRE_EXTRAS_ENV


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require-extras", action="store_true",
                     help="fail, instead of skipping, tests whose optional extras ([ml], "
                     "[peers]) are not installed (make test sets it)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("require_extras"):
        os.environ[REQUIRE_EXTRAS_ENV] = "1"


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a nats-server (JetStream on) private to this test session."""
    d = tmp_path_factory.mktemp("nats")
    proc, url = start_nats(data_dir=d / "js", log_path=d / "nats.log")
    yield url
    proc.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server private to this test session."""
    d = tmp_path_factory.mktemp("redis")
    proc, url = start_redis(data_dir=d, log_path=d / "redis.log")
    yield url
    proc.stop()


@pytest.fixture
def prefix() -> str:
    """A subject / key prefix unique to one test."""
    return "t" + uuid.uuid4().hex[:10]
