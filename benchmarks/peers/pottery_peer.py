"""pottery's ``AIORedlock`` on one master: ``async with AIORedlock(key=..., masters={redis})``.

It waits by retrying after a random sleep of up to 0.2 s and has no background renewal.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from typing import ClassVar

from redis.asyncio import Redis

from .base import HOLD, LOCK_TTL, AsyncPeer, AsyncSession


class PotteryPeer(AsyncPeer):
    key = "pottery"
    label = "pottery AIORedlock"
    dist = "pottery"
    config = (
        f"`AIORedlock(key=name, masters={{redis}}, auto_release_time={LOCK_TTL:g})` "
        "(one master), blocking context manager"
    )
    unsupported: ClassVar[dict[str, str]] = {
        HOLD: "no automatic renewal (extend() by hand, at most num_extensions=3 times)"
    }

    def probe(self) -> None:
        import pottery  # noqa: F401

        # pottery logs at INFO on every contended acquire; keep the harness output readable.
        logging.getLogger("pottery").setLevel(logging.WARNING)

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        return _Session(Redis.from_url(url, max_connections=max_connections))


class _Session(AsyncSession):
    def __init__(self, client: Redis) -> None:
        self.client = client
        self.masters = {client}

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        from pottery import AIORedlock

        return AIORedlock(key=name, masters=self.masters, auto_release_time=LOCK_TTL)

    async def aclose(self) -> None:
        await self.client.aclose()
