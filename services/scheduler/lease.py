"""Active/standby election for the scheduler: a lease key in Redis.

The active instance holds ``<prefix>:sched:lease`` (SET NX PX) and renews it every third of
its TTL; a standby polls at the same period and takes over once the key has lapsed. If Redis
is unreachable nobody can take over, so the active instance keeps routing (availability
first): a renewal only demotes when Redis answers that another instance holds the lease.
"""

from __future__ import annotations

import logging
from enum import Enum

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# Extend the lease only if we still hold it (compare-and-extend, atomic in Redis).
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class LeaseState(Enum):
    HELD = "held"
    LOST = "lost"  # Redis answered: another instance holds it
    UNKNOWN = "unknown"  # Redis unreachable


class Lease:
    """One instance's view of the scheduler lease."""

    def __init__(self, client: aioredis.Redis, key: str, holder: str, ttl_s: float) -> None:
        self.client = client
        self.key = key
        self.holder = holder
        self.ttl_ms = max(int(ttl_s * 1000), 100)

    async def try_acquire(self) -> LeaseState:
        """Take the lease if nobody holds it."""
        try:
            ok = await self.client.set(self.key, self.holder, nx=True, px=self.ttl_ms)
            if ok:
                return LeaseState.HELD
            current = await self.client.get(self.key)
        except (RedisError, OSError) as exc:
            log.debug("lease acquire: redis unavailable (%s)", exc)
            return LeaseState.UNKNOWN
        # Bytes from our clients (no decode_responses); a decoding client gives str.
        held_by = current.decode() if isinstance(current, bytes) else current
        if held_by == self.holder:
            return LeaseState.HELD
        return LeaseState.LOST

    async def renew(self) -> LeaseState:
        """Extend our lease; LOST only when Redis says someone else holds it."""
        try:
            ok = await self.client.eval(_RENEW, 1, self.key, self.holder, self.ttl_ms)
        except (RedisError, OSError) as exc:
            log.debug("lease renew: redis unavailable (%s)", exc)
            return LeaseState.UNKNOWN
        if ok:
            return LeaseState.HELD
        # Our key lapsed (e.g. Redis restarted empty): take it back if it is free.
        return await self.try_acquire()

    async def release(self) -> None:
        """Give the lease up on a clean shutdown so a standby takes over at once."""
        try:
            await self.client.eval(_RELEASE, 1, self.key, self.holder)
        except (RedisError, OSError) as exc:
            log.debug("lease release failed: %s", exc)
