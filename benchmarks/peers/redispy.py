"""redis-py's own ``redis.asyncio.lock.Lock``: ``async with redis.lock(name, ...)``.

It waits by polling (``sleep``, 0.1 s by default) and never renews by itself. The default
``timeout=None`` would leave the key without expiry; a lease needs one, so every use here
passes ``timeout`` (the same TTL as the other peers). Two variants: the default poll and a
1 ms poll.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import ClassVar

from redis.asyncio import Redis

from .base import HOLD, LOCK_TTL, AsyncPeer, AsyncSession

_NO_RENEWAL = "no automatic renewal (extend() must be called by hand)"


class RedisPyLockPeer(AsyncPeer):
    key = "redispy"
    label = "redis-py Lock"
    dist = None
    sleep: ClassVar[float] = 0.1
    config = f"`redis.lock(name, timeout={LOCK_TTL:g})`: default poll, `sleep=0.1`"
    unsupported: ClassVar[dict[str, str]] = {HOLD: _NO_RENEWAL}

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        return _Session(Redis.from_url(url, max_connections=max_connections), self.sleep)


class RedisPyLockFastPeer(RedisPyLockPeer):
    key = "redispy-1ms"
    label = "redis-py Lock 1 ms poll"
    sleep = 0.001
    config = f"`redis.lock(name, timeout={LOCK_TTL:g}, sleep=0.001)`"


class _Session(AsyncSession):
    def __init__(self, client: Redis, sleep: float) -> None:
        self.client = client
        self.sleep = sleep

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        return self.client.lock(name, timeout=LOCK_TTL, sleep=self.sleep)

    async def aclose(self) -> None:
        await self.client.aclose()
