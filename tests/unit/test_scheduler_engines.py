"""Telling an engine restart from the engine id a worker sends (services/scheduler/engines.py)."""

from __future__ import annotations

from prefixmesh.services.scheduler.engines import EngineIds


def test_another_engine_id_under_a_known_worker_is_a_restart():
    ids = EngineIds()
    assert not ids.restarted("w", "a")  # first seen: nothing to compare with
    assert not ids.restarted("w", "a")
    assert not ids.restarted("v", "b")  # another worker's engine
    assert ids.restarted("w", "c")
    assert not ids.restarted("w", "c")


def test_a_worker_that_sends_no_engine_id_is_never_taken_for_restarted():
    ids = EngineIds()
    assert not ids.restarted("w", "")
    assert not ids.restarted("w", "a")
    assert not ids.restarted("w", "")  # an old worker's report: keeps what was known
    assert ids.ids["w"] == "a"
