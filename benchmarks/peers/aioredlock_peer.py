"""aioredlock (on aioredis 1.x): ``await manager.lock(name)`` with its auto-extend watchdog.

``lock()`` tries ``retry_count`` (3) times, 0.1-0.3 s apart, then raises ``LockError``;
waiting for a busy lock means calling it again, which is what this adapter does. Without
``lock_timeout`` each lock gets a watchdog task that re-sets it every 0.6 x the TTL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from .base import LOCK_TTL, AsyncPeer, AsyncSession, Holding


class AioredlockPeer(AsyncPeer):
    key = "aioredlock"
    label = "aioredlock"
    dist = "aioredlock"
    config = (
        f"`Aioredlock([url], internal_lock_timeout={LOCK_TTL:g})`, `await lock(name)` "
        "(auto-extend every 0.6 x TTL), called again on LockError to wait"
    )

    def probe(self) -> None:
        import aioredlock  # type: ignore[import-untyped]  # noqa: F401

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        # aioredis 1.x pools (maxsize 100) make callers wait for a connection instead of
        # raising; max_connections is left to that default.
        from aioredlock import Aioredlock

        return _Session(url, Aioredlock([url], internal_lock_timeout=LOCK_TTL))


class _Session(AsyncSession):
    def __init__(self, url: str, manager: Any) -> None:
        self.url = url
        self.manager = manager
        self.others: list[Any] = []

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        return self._lock(name)

    @asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[object]:
        from aioredlock import LockError

        while True:
            try:
                held = await self.manager.lock(name)
                break
            except LockError:
                continue
        try:
            yield held
        finally:
            await self.manager.unlock(held)

    async def hold_many(self, names: Sequence[str], ttl: float, concurrency: int) -> Holding:
        from aioredlock import Aioredlock

        manager = Aioredlock([self.url], internal_lock_timeout=ttl)
        self.others.append(manager)
        holding = _Holding(manager, names)
        await holding.start(concurrency)
        return holding

    async def aclose(self) -> None:
        for manager in [self.manager, *self.others]:
            await manager.destroy()


class _Holding(Holding):
    def __init__(self, manager: Any, names: Sequence[str]) -> None:
        super().__init__(names)
        self._manager = manager
        self._names = list(names)
        self._locks: list[Any] = []

    async def start(self, concurrency: int) -> None:
        gate = asyncio.Semaphore(concurrency)

        async def take(name: str) -> Any:
            async with gate:
                try:
                    return await self._manager.lock(name)
                except Exception as exc:
                    self.failed.append(repr(exc))
                    self.keys.remove(name)
                    return None

        taken = await asyncio.gather(*(take(name) for name in self._names))
        self._locks = [held for held in taken if held is not None]

    def lost(self) -> int:
        return sum(1 for held in self._locks if not held.valid)

    async def release_all(self) -> None:
        gate = asyncio.Semaphore(64)

        async def give(held: Any) -> None:
            async with gate:
                await self._manager.unlock(held)

        await asyncio.gather(*(give(held) for held in self._locks if held.valid))
