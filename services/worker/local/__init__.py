"""Local (per-worker) scheduling policies: the waiting queue and its admission order.

Build one by name with ``make_local_policy``; DESIGN.md section 6 lists the policies.
"""

from __future__ import annotations

from typing import TypeVar

from services.worker.local.base import (
    CacheProbe,
    EngineView,
    LocalPolicy,
    WaitingQueue,
    prefill_estimate,
    tokens_to_prefill,
)
from services.worker.local.batch_groups import BatchGroupsConfig, BatchGroupsPolicy
from services.worker.local.fcfs import FcfsConfig, FcfsPolicy
from services.worker.local.prefix_fair import PrefixFairConfig, PrefixFairPolicy
from services.worker.local.sprpt import SprptConfig, SprptPolicy
from services.worker.local.srjf import SrjfConfig, SrjfPolicy

# Names accepted by make_local_policy, in DESIGN.md section 6's order.
LOCAL_POLICIES: tuple[str, ...] = (
    "fcfs",
    "prefix_fair",
    "sprpt_limited",
    "srjf_calibrated",
    "batch_groups",
)
DEFAULT_LOCAL_POLICY = "prefix_fair"

LocalPolicyConfig = (
    FcfsConfig | PrefixFairConfig | SprptConfig | SrjfConfig | BatchGroupsConfig
)
# Each policy's config type (its knobs), by name.
LOCAL_POLICY_CONFIGS: dict[str, type] = {
    "fcfs": FcfsConfig,
    "prefix_fair": PrefixFairConfig,
    "sprpt_limited": SprptConfig,
    "srjf_calibrated": SrjfConfig,
    "batch_groups": BatchGroupsConfig,
}
_C = TypeVar("_C")


def make_local_policy(name: str, config: LocalPolicyConfig | None = None) -> LocalPolicy:
    """A fresh policy by name; ``config`` must be that policy's config type (None = defaults)."""
    match name:
        case "fcfs":
            return FcfsPolicy(_checked(name, config, FcfsConfig))
        case "prefix_fair":
            return PrefixFairPolicy(_checked(name, config, PrefixFairConfig))
        case "sprpt_limited":
            return SprptPolicy(_checked(name, config, SprptConfig))
        case "srjf_calibrated":
            return SrjfPolicy(_checked(name, config, SrjfConfig))
        case "batch_groups":
            return BatchGroupsPolicy(_checked(name, config, BatchGroupsConfig))
    raise ValueError(f"unknown local policy {name!r} (known: {', '.join(LOCAL_POLICIES)})")


def _checked(name: str, config: object, kind: type[_C]) -> _C | None:
    if config is None or isinstance(config, kind):
        return config
    raise TypeError(f"local policy {name!r} takes {kind.__name__}, not {type(config).__name__}")


__all__ = [
    "DEFAULT_LOCAL_POLICY",
    "LOCAL_POLICIES",
    "LOCAL_POLICY_CONFIGS",
    "BatchGroupsConfig",
    "BatchGroupsPolicy",
    "CacheProbe",
    "EngineView",
    "FcfsConfig",
    "FcfsPolicy",
    "LocalPolicy",
    "LocalPolicyConfig",
    "PrefixFairConfig",
    "PrefixFairPolicy",
    "SprptConfig",
    "SprptPolicy",
    "SrjfConfig",
    "SrjfPolicy",
    "WaitingQueue",
    "make_local_policy",
    "prefill_estimate",
    "tokens_to_prefill",
]
