"""Several sim engines in one worker process: ids, process groups, what is refused."""

from __future__ import annotations

import pytest

from prefixmesh.services.up import worker_groups
from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.group import WorkerGroup, group_ids


def test_worker_groups_split_ids_and_keep_real_engines_alone() -> None:
    assert worker_groups(5, 2, "sim") == [(0, ["w0", "w1"]), (2, ["w2", "w3"]), (4, ["w4"])]
    assert worker_groups(2, 4, "hf") == [(0, ["w0"]), (1, ["w1"])]
    assert worker_groups(3, 0, "sim") == [(0, ["w0"]), (1, ["w1"]), (2, ["w2"])]


def test_group_members_keep_their_own_ids_and_only_the_first_serves_metrics() -> None:
    g = WorkerGroup(WorkerConfig(worker_ids="a, b,c", metrics_port=9999))
    assert [m.worker_id for m in g.members] == ["a", "b", "c"]
    assert [m.cfg.metrics_port for m in g.members] == [9999, 0, 0]
    assert all(m.cfg.worker_ids == "" for m in g.members)


def test_groups_refuse_real_engines_duplicates_and_http() -> None:
    with pytest.raises(SystemExit):
        WorkerGroup(WorkerConfig(worker_ids="a,b", backend="hf"))
    with pytest.raises(SystemExit):
        group_ids("a,b,a")
    with pytest.raises(SystemExit):
        WorkerGroup(WorkerConfig(worker_ids="a,b", http_port=8080))
