"""``python -m prefixmesh.loadgen.bench_persist`` on the session's Redis: the flushes it
times write a state that loads back whole."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from prefixmesh.loadgen.bench_persist import main
from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.scheduler.policies.e2 import E2Policy
from prefixmesh.services.scheduler.store import StateStore
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("hashes", ["packed", "listed"])
def test_persist_bench_times_flushes_that_load_back(redis_server: str, tmp_path: Path,
                                                    hashes: str) -> None:
    out = tmp_path / "bp.json"
    prefix = f"benchpersist-{hashes}"
    assert main(["--redis-url", redis_server, "--prefix", prefix, "--warmup", "300",
                 "--decisions", "1000", "--every", "400", "--hashes", hashes,
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["decisions"] == 1000 and r["every"] == 400 and r["hashes"] == hashes
    assert r["persist_us_per_decision"] > 0 and r["nodes_per_decision"] > 0
    assert r["segments"] >= 3  # one log segment a flush at least: three flushes
    assert r["full_rewrite_nodes"] == r["tree_nodes"] > 0

    async def load() -> E2Policy:
        client = aioredis.from_url(redis_server)
        try:
            q = E2Policy(PolicyConfig(), CostModel.load(DEFAULT_PROFILE))
            assert await StateStore(client, f"{prefix}:e2").load(q)
            return q
        finally:
            await client.aclose()

    q = asyncio.run(load())
    assert q.tree.n_nodes == r["tree_nodes"] and len(q.workers) == 16
    # Runs routed packed are written and read back as int64 arrays (the requests' own
    # runs; a prefix first stored by a KV event's list of ints stays a tuple).
    runs = {type(n.hashes).__name__ for n in q.tree.nodes()}
    assert ("array" in runs) == (hashes == "packed")


@pytest.mark.parametrize("bad", [["--decisions", "0"], ["--every", "0"], ["--warmup", "-1"]])
def test_persist_bench_refuses_bad_counts(bad: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2 and "must be" in capsys.readouterr().err
