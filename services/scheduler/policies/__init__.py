"""Global routing policies: E2 and the baselines, behind one ``GlobalPolicy`` interface."""

from __future__ import annotations

from collections.abc import Callable

from prefixmesh.services.scheduler.policies.base import GlobalPolicy, PolicyConfig
from prefixmesh.services.scheduler.policies.baselines import (
    CacheAwarePolicy,
    KvCostPolicy,
    LeastLoadPolicy,
    PrefixHashPolicy,
    RoundRobinPolicy,
    WeightedPolicy,
)
from prefixmesh.services.scheduler.policies.e2 import E2Policy
from prefixmesh.shared.costmodel import CostModel

_FACTORIES: dict[str, Callable[[PolicyConfig, CostModel], GlobalPolicy]] = {
    "e2": E2Policy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "prefix_hash": PrefixHashPolicy,
    "cache_aware": CacheAwarePolicy,
    "kv_cost": KvCostPolicy,
    "weighted": WeightedPolicy,
}

# Every policy name ``make_policy`` accepts, E2 first.
POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
DEFAULT_POLICY = "e2"


def make_policy(name: str, config: PolicyConfig, cost: CostModel) -> GlobalPolicy:
    """Build the global policy called ``name`` (one of ``POLICY_NAMES``)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown global policy {name!r} (known: {', '.join(POLICY_NAMES)})"
        ) from None
    return factory(config, cost)
