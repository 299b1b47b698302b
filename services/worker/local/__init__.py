"""Local (per-worker) scheduling policies: the waiting queue and its admission order.

Build one by name with ``make_local_policy``; docs/design.md section 6 lists the policies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixmesh.services.worker.local.base import (
    CacheProbe,
    EngineView,
    LocalPolicy,
    WaitingQueue,
    prefill_estimate,
    tokens_to_prefill,
)
from prefixmesh.services.worker.local.batch_groups import (
    BatchGroupsConfig,
    BatchGroupsPolicy,
)
from prefixmesh.services.worker.local.fcfs import FcfsConfig, FcfsPolicy
from prefixmesh.services.worker.local.prefix_fair import (
    PrefixFairConfig,
    PrefixFairPolicy,
)
from prefixmesh.services.worker.local.sprpt import SprptConfig, SprptPolicy
from prefixmesh.services.worker.local.srjf import SrjfConfig, SrjfPolicy

# Each policy by name, in docs/design.md section 6's order: its class (called with a config
# of its own type, or None) and its config type.
_POLICIES: dict[str, tuple[Callable[[Any], LocalPolicy], type]] = {
    "fcfs": (FcfsPolicy, FcfsConfig),
    "prefix_fair": (PrefixFairPolicy, PrefixFairConfig),
    "sprpt_limited": (SprptPolicy, SprptConfig),
    "srjf_calibrated": (SrjfPolicy, SrjfConfig),
    "batch_groups": (BatchGroupsPolicy, BatchGroupsConfig),
}
# Names accepted by make_local_policy.
LOCAL_POLICIES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_LOCAL_POLICY = "prefix_fair"

LocalPolicyConfig = (
    FcfsConfig | PrefixFairConfig | SprptConfig | SrjfConfig | BatchGroupsConfig
)
# Each policy's config type (its knobs), by name.
LOCAL_POLICY_CONFIGS: dict[str, type] = {name: kind for name, (_, kind) in _POLICIES.items()}


def make_local_policy(name: str, config: LocalPolicyConfig | None = None) -> LocalPolicy:
    """A fresh policy by name; ``config`` must be that policy's config type (None = defaults)."""
    if name not in _POLICIES:
        raise ValueError(f"unknown local policy {name!r} (known: {', '.join(LOCAL_POLICIES)})")
    cls, kind = _POLICIES[name]
    if config is not None and not isinstance(config, kind):
        raise TypeError(f"local policy {name!r} takes {kind.__name__}, "
                        f"not {type(config).__name__}")
    return cls(config)


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
