"""Test session fixtures: a real nats-server and redis-server started by the session itself.

Each test gets its own subject prefix and Redis key prefix, so tests never see each other's
traffic even though they share one server of each.

A test's kind is the folder it lives in: ``tests/unit/...`` is marked ``unit``,
``tests/integration/...`` ``integration``, and so on (``pytest_collection_modifyitems``
below), so ``pytest -m unit`` selects by folder without a marker line in every module.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixmesh.shared.runtime.servers import start_nats, start_nats_cluster, start_redis
from tests.helpers import REQUIRE_EXTRAS_ENV


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require-extras", action="store_true",
                     help="fail, instead of skipping, tests whose optional extras ([ml], "
                     "[peers]) are not installed (make test sets it)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("require_extras"):
        os.environ[REQUIRE_EXTRAS_ENV] = "1"


# Folder under tests/ -> the marker every test in it gets (registered in pyproject.toml).
FOLDER_MARKERS = {"unit": "unit", "integration": "integration", "e2e": "e2e", "ml": "ml",
                  "gpu": "gpu"}
TESTS = Path(__file__).resolve().parent


def folder_marker(path: Path) -> str | None:
    """The marker of a test file's folder under tests/ (None outside those folders)."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return FOLDER_MARKERS.get(parts[0]) if len(parts) > 1 else None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        marker = folder_marker(item.path)
        if marker is not None:
            item.add_marker(marker)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a nats-server (JetStream on) private to this test session."""
    d = tmp_path_factory.mktemp("nats")
    proc, url = start_nats(data_dir=d / "js", log_path=d / "nats.log")
    yield url
    proc.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path):
    """A 3-node nats cluster (JetStream clustered) private to one test, which may kill and
    restart its nodes; ``.url`` lists all three."""
    cluster = start_nats_cluster(3, data_dir=tmp_path / "js", log_dir=tmp_path)
    yield cluster
    cluster.stop()


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


@pytest.fixture
async def connect_bus(nats_server: str, prefix: str):
    """``await connect_bus(subject_prefix=None, name="test-client")``: a ``Bus`` on the
    session's nats-server under ``subject_prefix`` (the test's ``prefix`` by default);
    every bus it connected is closed after the test."""
    from prefixmesh.shared.bus import Bus
    from prefixmesh.shared.subjects import Subjects

    buses: list[Bus] = []

    async def connect(subject_prefix: str | None = None, name: str = "test-client") -> Bus:
        b = await Bus.connect(nats_server, Subjects(subject_prefix or prefix), name)
        buses.append(b)
        return b

    yield connect
    for b in reversed(buses):
        await b.close()


@pytest.fixture
async def bus(connect_bus):
    """A ``Bus`` under the test's ``prefix`` (closed after the test)."""
    return await connect_bus()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding the default (SmolLM2) tokenizer, built once per session (~5 s)."""
    from prefixmesh.shared.text.gguf_vocab import ensure_default_tokenizer

    root = tmp_path_factory.mktemp("tokcache")
    ensure_default_tokenizer(root)
    return root


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path):
    """The default tokenizer, loaded from ``tokenizer_dir``."""
    from prefixmesh.shared.text.tokenizer import TextTokenizer

    return TextTokenizer.load(cache_dir=tokenizer_dir)
