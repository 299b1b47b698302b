"""The scheduler's two config groups: service settings and every policy knob, from env/CLI."""

from __future__ import annotations

import dataclasses

from prefixmesh.services.scheduler.__main__ import parse
from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService


def test_policy_knobs_come_from_env_and_cli(monkeypatch):
    monkeypatch.setenv("PM_TH_BAL", "inf")
    monkeypatch.setenv("PM_IMBALANCE_RATIO", "0.7")
    cfg, pcfg = parse(["--window-s", "60", "--policy", "cache_aware", "--ca-balance-abs", "8"])
    assert cfg.policy == "cache_aware"
    assert (pcfg.window_s, pcfg.imbalance_ratio, pcfg.th_bal) == (60.0, 0.7, float("inf"))
    assert pcfg.ca_balance_abs == 8
    # Defaults are PolicyConfig's own (written once).
    assert pcfg.replicate_share == PolicyConfig().replicate_share
    # No knob shadows a service setting.
    names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert not names & {f.name for f in dataclasses.fields(PolicyConfig)}


def test_service_builds_its_policy_with_the_knobs():
    svc = SchedulerService(SchedulerConfig(), PolicyConfig(window_s=42.0, th_bal=2.0))
    assert svc.policy.cfg.window_s == 42.0 and svc.policy.cfg.th_bal == 2.0


def test_an_unknown_policy_is_refused_at_configuration(monkeypatch):
    import pytest

    from prefixmesh.shared.runtime.config import from_sources

    monkeypatch.setenv("PM_POLICY", "nosuch")
    with pytest.raises(SystemExit, match="policy must be one of e2, round_robin"):
        from_sources(SchedulerConfig)
    monkeypatch.setenv("PM_POLICY", "cache_aware")
    assert from_sources(SchedulerConfig).policy == "cache_aware"
