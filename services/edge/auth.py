"""API key -> tenant resolution for the edge: the key file, then (optionally) Redis.

Redis lookups are cached for ``REDIS_CACHE_S`` so a hot key costs one round trip per
period, and a Redis outage answers 503 (retriable) rather than 401: a valid key must never
be refused because the store is briefly away.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from prefixmesh.services.edge.tenants import ApiKeys, bearer_key
from prefixmesh.shared.openai.schema import ApiError

log = logging.getLogger(__name__)

# Seconds a Redis answer (tenant or "no such key") is reused.
REDIS_CACHE_S = 10.0
# Seconds to wait for Redis per lookup.
REDIS_TIMEOUT_S = 1.0
# Most cached Redis answers (bounded: unknown keys must not grow memory without end).
REDIS_CACHE_MAX = 10_000


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


class KeyResolver:
    """Finds the tenant of an ``Authorization`` header; ``enabled`` False = auth off."""

    def __init__(self, keys: ApiKeys, enabled: bool, redis: aioredis.Redis | None = None,
                 redis_key: str = "") -> None:
        self.keys = keys
        self.enabled = enabled
        self._redis = redis
        self._redis_key = redis_key
        self._cache: dict[str, tuple[float, str]] = {}

    async def tenant(self, authorization: str | None) -> str:
        """The tenant of the request ("" with auth off); raises 401 or 503 ApiError."""
        if not self.enabled:
            return ""
        key = bearer_key(authorization)
        if not key:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        tenant = self.keys.keys.get(key)
        if tenant is None and self._redis is not None:
            tenant = await self._from_redis(self._redis, key)
        if not tenant:
            raise unauthorized("invalid API key")
        return tenant

    async def _from_redis(self, redis: aioredis.Redis, key: str) -> str:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            raw = await redis.hget(self._redis_key, key)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("API key lookup in Redis failed: %s", exc)
            raise ApiError(503, "API key store unavailable; retry shortly",
                           type="service_unavailable", code="service_unavailable",
                           headers={"Retry-After": "1"}) from None
        tenant = raw.decode() if isinstance(raw, bytes) else (raw or "")
        if len(self._cache) >= REDIS_CACHE_MAX:
            self._cache.clear()
        self._cache[key] = (now + REDIS_CACHE_S, tenant)
        return tenant
