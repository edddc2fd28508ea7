"""asynclock's other kinds in the hand-over scenarios: a semaphore's permit and a shared
lease, each handed from one contender to the next, to be read beside python-redis-lock's
mutex (and asynclock's own).

- ``asynclock-semaphore``: ``lease(redis, name, limit=2)``. One of the two permits is held
  for the whole run by a blocker (``acquire(redis, name, limit=2)``, taken by the session
  that wins a non-blocking election on ``<name>:blocker``, before any contender tries),
  so the contenders share the other one, one at a time: every turn is a permit released
  by one contender and taken by the next (a release publishes, the head of each client's
  line tries), and the figures of a mutex (handoffs, latency, overlaps, fairness) apply.
- ``asynclock-shared``: contenders 0, 1, 4, 5 take a plain (exclusive) lease, 2, 3, 6, 7 a
  shared one (``shared=True``), so with the two processes of ``handoff-np`` each process
  has two of each. Readers may hold together; the hand-overs are those where a writer
  is involved (a writer's release to the next holder, the last reader's release to a
  writer), and an *overlap* is a turn that intersects a writer's (see ``stats``). Writers
  that go straight back keep the readers out (a waiting writer is let in first, and
  writers hand the lock over among themselves): readers get a turn about once a second
  each, as a Jain index near 0.5 shows; the hand-overs measured are then mostly a
  writer's to a writer, through the shared kind's scripts and waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import ClassVar

from redis.asyncio import Redis

from .base import BURST, CYCLE, HOLD, LOCK_TTL, AsyncPeer, AsyncSession

__all__ = ["AsynclockSemaphorePeer", "AsynclockSharedPeer"]

_ONLY_HANDOFFS = "measured in the hand-over scenarios only (the mutex's cycle is asynclock's)"
_WARM_UP = ":warm-up"


class _KindPeer(AsyncPeer):
    dist = "asynclock"
    unsupported: ClassVar[dict[str, str]] = {
        CYCLE: _ONLY_HANDOFFS,
        HOLD: _ONLY_HANDOFFS,
        BURST: _ONLY_HANDOFFS,
    }

    def probe(self) -> None:
        import asynclock  # noqa: F401

    def version(self) -> str:
        import asynclock

        return asynclock.__version__


class AsynclockSemaphorePeer(_KindPeer):
    key = "asynclock-semaphore"
    label = "asynclock semaphore"
    config = (
        f"`asynclock.lease(redis, name, limit=2, ttl={LOCK_TTL:g})`, one permit held by a "
        "blocker all along: the contenders hand the other one over"
    )

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        return _SemaphoreSession(Redis.from_url(url, max_connections=max_connections))


class AsynclockSharedPeer(_KindPeer):
    key = "asynclock-shared"
    label = "asynclock shared lease"
    config = (
        f"`asynclock.lease(redis, name, ttl={LOCK_TTL:g})` for contenders 0, 1, 4, 5 and "
        "the same with `shared=True` for 2, 3, 6, 7"
    )

    def reader(self, contender: int) -> bool:
        return (contender // 2) % 2 == 1

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        return _SharedSession(Redis.from_url(url, max_connections=max_connections), self)


class _SemaphoreSession(AsyncSession):
    def __init__(self, client: Redis) -> None:
        self.client = client
        self._ready: dict[str, asyncio.Lock] = {}
        self._done: set[str] = set()  # semaphores whose blocker is settled
        self._held: list[object] = []  # (the blocker's leases and the election's)

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        return self._lock(name)

    @asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[object]:
        import asynclock

        semaphore = name.removesuffix(_WARM_UP)
        if semaphore not in self._done:
            async with self._ready.setdefault(semaphore, asyncio.Lock()):
                if semaphore not in self._done:  # (the first turns wait for the blocker)
                    await self._block(semaphore)
        lease = asynclock.lease(self.client, name, limit=2, ttl=LOCK_TTL)
        async with lease as held:
            yield held

    async def _block(self, semaphore: str) -> None:
        """Hold one permit of ``semaphore`` for the session's life, if this session wins
        the election (the other sessions' contenders find it held already: the election
        and the blocker run in every process's warm-up, before the contenders start)."""
        import asynclock

        try:
            elected = await asynclock.acquire(
                self.client, semaphore + ":blocker", ttl=LOCK_TTL, blocking=False
            )
        except asynclock.LockBusy:
            self._done.add(semaphore)
            return
        blocker = await asynclock.acquire(self.client, semaphore, limit=2, ttl=LOCK_TTL)
        self._held += [elected, blocker]
        self._done.add(semaphore)

    async def aclose(self) -> None:
        for held in reversed(self._held):
            await held.release()  # type: ignore[attr-defined]
        await self.client.aclose()


class _SharedSession(AsyncSession):
    def __init__(self, client: Redis, peer: AsynclockSharedPeer) -> None:
        self.client = client
        self._peer = peer

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        import asynclock

        return asynclock.lease(self.client, name, ttl=LOCK_TTL)

    def lock_as(self, name: str, contender: int) -> AbstractAsyncContextManager[object]:
        import asynclock

        shared = self._peer.reader(contender)
        return asynclock.lease(self.client, name, ttl=LOCK_TTL, shared=shared)

    async def aclose(self) -> None:
        await self.client.aclose()
