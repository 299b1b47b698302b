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


def test_a_late_message_of_a_replaced_engine_is_stale_not_another_restart():
    ids = EngineIds()
    ids.restarted("w", "a")
    assert ids.restarted("w", "b")  # the engine restarted
    # A KV batch of engine a, sent before the restart, arrives after b's report.
    assert ids.stale("w", "a") and not ids.restarted("w", "a")
    assert ids.ids["w"] == "b" and not ids.restarted("w", "b")  # no flip back
    assert not ids.stale("w", "b") and not ids.stale("v", "a") and not ids.stale("w", "")
