"""asynclock's detached form: ``lease = await asynclock.acquire(redis, name, ttl=...)``.

The lease is held and renewed by the library's watchdog (coalesced per client) with no
task of the caller's, until ``await lease.release()``: the shape of aioredlock's
``await lock(name)`` handle. Acquiring, renewing and releasing run the same code as
``async with asynclock.lease(...)`` (the ``asynclock`` peer), so this peer takes part only
where holding without a task changes the figures: many leases held at once. The burst
runs every acquisition in a task of its own for either form, so it would measure the
same thing twice (and lengthen ``--quick``). ``lock()`` (``acquire()``, then
``release()`` on exit) only warms the session up before the leases are taken.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, ClassVar

from redis.asyncio import Redis

from .asynclock_peer import AsynclockPeer
from .base import BURST, CONTEND, CYCLE, LOCK_TTL, AsyncSession, Holding

if TYPE_CHECKING:
    from asynclock import Lease

_SAME_PATH = "the same code path as asynclock's `async with`; measured there"
_SAME_BURST = (
    "the burst runs each acquisition in a task of its own for either form: the same code "
    "path as asynclock's `async with`; measured there"
)


class AsynclockAcquirePeer(AsynclockPeer):
    key = "asynclock-acquire"
    label = "asynclock acquire()"
    holds_in_tasks = False
    config = (
        f"`lease = await asynclock.acquire(redis, name, ttl={LOCK_TTL:g})`, blocking, held "
        "and renewed every ttl/3 by the watchdog until `await lease.release()`, no task of "
        "the caller's per lease; one `redis.asyncio.Redis` per process"
    )
    unsupported: ClassVar[dict[str, str]] = {
        CYCLE: _SAME_PATH,
        CONTEND: _SAME_PATH,
        BURST: _SAME_BURST,
    }

    def probe(self) -> None:
        from asynclock import acquire  # noqa: F401 - an asynclock without it is skipped

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        return _Session(Redis.from_url(url, max_connections=max_connections))


class _Session(AsyncSession):
    def __init__(self, client: Redis) -> None:
        self.client = client

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        return self._lock(name)

    @asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[object]:
        import asynclock

        held = await asynclock.acquire(self.client, name, ttl=LOCK_TTL)
        try:
            yield held
        finally:
            await held.release()

    async def hold_many(self, names: Sequence[str], ttl: float, concurrency: int) -> Holding:
        holding = _Holding(self.client, names, ttl)
        await holding.start(concurrency)
        return holding

    async def aclose(self) -> None:
        await self.client.aclose()


class _Holding(Holding):
    """Every lease a ``Lease`` in a list, renewed by the library until released.

    The acquisitions are made as the aioredlock peer makes its own (one coroutine per
    name, ``concurrency`` at a time), so the two differ only in the library.
    """

    def __init__(self, client: Redis, names: Sequence[str], ttl: float) -> None:
        super().__init__([f"asynclock:{{{name}}}" for name in names])
        self._client = client
        self._names = list(names)
        self._ttl = ttl
        self._concurrency = 1  # set by start()
        self._leases: list[Lease] = []
        self._lost_on_release: set[int] = set()  # indices into _leases

    async def start(self, concurrency: int) -> None:
        import asynclock

        self._concurrency = concurrency
        gate = asyncio.Semaphore(concurrency)

        async def take(name: str) -> Lease | None:
            async with gate:
                try:
                    return await asynclock.acquire(self._client, name, ttl=self._ttl)
                except Exception as exc:
                    self.failed.append(repr(exc))
                    self.keys.remove(f"asynclock:{{{name}}}")
                    return None

        taken = await asyncio.gather(*(take(name) for name in self._names))
        self._leases = [held for held in taken if held is not None]

    def lost(self) -> int:
        from asynclock import LeaseState

        lost = {i for i, held in enumerate(self._leases) if held.state is LeaseState.LOST}
        return len(lost | self._lost_on_release)

    async def release_all(self) -> None:
        import asynclock

        gate = asyncio.Semaphore(self._concurrency)

        async def give(index: int, held: Lease) -> None:
            async with gate:
                try:
                    await held.release()
                except asynclock.LockLost:
                    self._lost_on_release.add(index)

        await asyncio.gather(*(give(i, held) for i, held in enumerate(self._leases)))
