"""Tenants: API keys -> tenant, per-tenant rate limits and in-flight shares (pure logic).

Keys come from a TOML file (``--api-keys-file``)::

    [tenants.acme]
    keys = ["sk-acme-1", "sk-acme-2"]
    rate_rps = 20.0        # sustained requests per second (token bucket refill)
    burst = 40             # bucket size: requests that may arrive at once
    max_inflight = 64      # requests of this tenant running at once (its share)

and, when ``--api-keys-redis`` is on, from the Redis hash ``<redis_prefix>:apikeys``
(field = key, value = tenant name; limits then come from ``[tenants.<name>]`` or the
defaults). With no file and Redis lookup off, auth is off: every request belongs to the
anonymous tenant "" and only the edge-wide limits apply.

The tenant name salts block hashes (prefixmesh.shared.blocks.tenant_salt), so one tenant's cached
prefixes are invisible to another's, in the workers' caches and the scheduler's tree.
"""

from __future__ import annotations

import math
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from prefixmesh.shared.openai.schema import ApiError

# The tenant of every request when auth is off: it has no limits of its own, only the
# edge-wide bound applies (an operator who turned auth off has no tenants to share between).
ANONYMOUS = ""
# Defaults for a tenant whose limits are not written down.
DEFAULT_RATE_RPS = 50.0
DEFAULT_BURST = 100
DEFAULT_MAX_INFLIGHT = 256


@dataclass(frozen=True, slots=True)
class TenantLimits:
    rate_rps: float = DEFAULT_RATE_RPS  # requests per second, sustained (0 = unlimited)
    burst: int = DEFAULT_BURST  # requests, bucket capacity
    max_inflight: int = DEFAULT_MAX_INFLIGHT  # requests running at once


# The anonymous tenant's limits: no rate limit (0), no in-flight share of its own.
UNLIMITED = TenantLimits(rate_rps=0.0, burst=1, max_inflight=sys.maxsize)


@dataclass(slots=True)
class ApiKeys:
    """Key -> tenant, and each tenant's limits."""

    keys: dict[str, str] = field(default_factory=dict)
    limits: dict[str, TenantLimits] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        """Read the TOML key file (format in the module doc); raises ValueError if bad."""
        try:
            doc = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read API keys from {path}: {exc}") from None
        out = cls()
        for name, spec in doc.get("tenants", {}).items():
            if not name or not isinstance(spec, dict):
                raise ValueError(f"{path}: [tenants.{name}] must be a table")
            base = TenantLimits()
            out.limits[name] = TenantLimits(
                rate_rps=float(spec.get("rate_rps", base.rate_rps)),
                burst=int(spec.get("burst", base.burst)),
                max_inflight=int(spec.get("max_inflight", base.max_inflight)))
            for key in spec.get("keys", []):
                if key in out.keys:
                    raise ValueError(f"{path}: key {key[:6]}... belongs to two tenants")
                out.keys[key] = name
        return out

    def limits_of(self, tenant: str) -> TenantLimits:
        if tenant == ANONYMOUS:
            return UNLIMITED
        return self.limits.get(tenant) or TenantLimits()


class TokenBucket:
    """Requests per second with a burst; ``take`` answers 0 or the seconds to wait."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = max(burst, 1)
        self.tokens = float(self.burst)
        self.at = now

    def take(self, now: float) -> float:
        if self.rate <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def bearer_key(header: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ("" when absent)."""
    if not header:
        return ""
    scheme, _, value = header.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def too_many(message: str, wait_s: float, code: str) -> ApiError:
    retry = max(1, math.ceil(wait_s))
    return ApiError(429, message, type="rate_limit_error", code=code,
                    headers={"Retry-After": str(retry)})


class Admission:
    """Edge-wide and per-tenant admission: rate limits, in-flight shares, a global bound.

    One per edge process. ``enter`` raises ApiError (429 per tenant, 503 edge-wide, both
    with Retry-After) or counts the request in; ``leave`` counts it out.
    """

    def __init__(self, keys: ApiKeys, max_inflight: int) -> None:
        self.keys = keys
        self.max_inflight = max_inflight
        self.inflight = 0
        self._by_tenant: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}

    def enter(self, tenant: str, now: float) -> None:
        if self.inflight >= self.max_inflight:
            raise ApiError(503, f"the edge is at its limit of {self.max_inflight} requests "
                           "in flight; retry shortly", type="service_unavailable",
                           code="overloaded", headers={"Retry-After": "1"})
        limits = self.keys.limits_of(tenant)
        if self._by_tenant.get(tenant, 0) >= limits.max_inflight:
            raise too_many(f"tenant has {limits.max_inflight} requests in flight, its share; "
                           "retry when one finishes", 1.0, "tenant_inflight_limit")
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(limits.rate_rps, limits.burst, now)
        wait = bucket.take(now)
        if wait > 0:
            raise too_many(f"rate limit of {limits.rate_rps:g} requests/s exceeded",
                           wait, "rate_limit_exceeded")
        self.inflight += 1
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1

    def leave(self, tenant: str) -> None:
        self.inflight -= 1
        left = self._by_tenant.get(tenant, 1) - 1
        if left:
            self._by_tenant[tenant] = left
        else:
            self._by_tenant.pop(tenant, None)
