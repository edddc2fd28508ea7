"""python-redis-lock (``redis_lock.Lock``): blocking, in threads; waiters sleep in ``BLPOP``.

A release pushes to a signal list, which wakes one ``BLPOP`` waiter. It is used without
``auto_renewal`` (that starts one renewal thread per held lock).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, ClassVar

import redis

from .base import HOLD, LOCK_TTL, SyncSession, ThreadPeer


class RedisLockPeer(ThreadPeer):
    key = "python-redis-lock"
    label = "python-redis-lock"
    dist = "python-redis-lock"
    config = (
        f"`redis_lock.Lock(redis, name, expire={int(LOCK_TTL)})` in threads (one sync "
        "`redis.Redis` per process), no auto_renewal"
    )
    unsupported: ClassVar[dict[str, str]] = {
        HOLD: "auto_renewal starts one renewal thread per held lock (10,000 threads)"
    }

    def probe(self) -> None:
        import redis_lock  # type: ignore[import-untyped]  # noqa: F401

    def open(self, url: str, *, max_connections: int | None = None) -> SyncSession:
        return _Session(redis.Redis.from_url(url, max_connections=max_connections))


class _Session(SyncSession):
    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def lock(self, name: str) -> AbstractContextManager[object]:
        import redis_lock

        made: Any = redis_lock.Lock(self.client, name, expire=int(LOCK_TTL))
        return made  # type: ignore[no-any-return]

    def close(self) -> None:
        self.client.close()
