"""asynclock itself: ``async with asynclock.lease(redis, name, ttl=...)`` (watchdog on)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

from redis.asyncio import Redis

from .base import LOCK_TTL, AsyncPeer, AsyncSession, Holding


class AsynclockPeer(AsyncPeer):
    key = "asynclock"
    label = "asynclock"
    holds_in_tasks = True
    dist = "asynclock"
    config = (
        f"`asynclock.lease(redis, name, ttl={LOCK_TTL:g})`, blocking, watchdog renewing every "
        "ttl/3; one `redis.asyncio.Redis` per process"
    )

    def probe(self) -> None:
        import asynclock  # noqa: F401

    def version(self) -> str:
        import asynclock

        return asynclock.__version__

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        return _Session(Redis.from_url(url, max_connections=max_connections))


class _Session(AsyncSession):
    def __init__(self, client: Redis) -> None:
        self.client = client

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        import asynclock

        return asynclock.lease(self.client, name, ttl=LOCK_TTL)

    async def hold_many(self, names: Sequence[str], ttl: float, concurrency: int) -> Holding:
        holding = _Holding(self.client, names, ttl)
        await holding.start(concurrency)
        return holding

    async def hold_tasks_only(self, names: Sequence[str], concurrency: int) -> Holding | None:
        holding = _Holding(self.client, names, LOCK_TTL, tasks_only=True)
        await holding.start(concurrency)
        return holding

    async def aclose(self) -> None:
        await self.client.aclose()


class _Holding(Holding):
    """One task per lease, each inside ``async with lease(...)`` until released."""

    def __init__(
        self, client: Redis, names: Sequence[str], ttl: float, *, tasks_only: bool = False
    ) -> None:
        super().__init__([f"asynclock:{{{name}}}" for name in names])
        self._client = client
        self._names = list(names)
        self._ttl = ttl
        self._release = asyncio.Event()
        self._exit_gate = asyncio.Semaphore(1)  # sized by start()
        self._tasks: list[asyncio.Task[None]] = []
        self._lost = 0
        self._tasks_only = tasks_only  # the same tasks, each waiting without a lease

    async def start(self, concurrency: int) -> None:
        gate = asyncio.Semaphore(concurrency)
        self._exit_gate = asyncio.Semaphore(concurrency)
        acquired = asyncio.Event()
        pending = len(self._names)

        def settled() -> None:
            nonlocal pending
            pending -= 1
            if pending == 0:
                acquired.set()

        async def hold(name: str) -> None:
            import asynclock

            await gate.acquire()
            opened = exiting = False
            try:
                async with (
                    _NoLease()
                    if self._tasks_only
                    else asynclock.lease(self._client, name, ttl=self._ttl)
                ):
                    gate.release()
                    opened = True
                    settled()
                    await self._release.wait()
                    await self._exit_gate.acquire()  # releases go out `concurrency` at a time
                    exiting = True
            except asynclock.LockLost:
                self._lost += 1
            except Exception as exc:
                if opened:
                    raise
                self.failed.append(repr(exc))
                self.keys.remove(f"asynclock:{{{name}}}")
            finally:
                if not opened:
                    gate.release()
                    settled()
                if exiting:
                    self._exit_gate.release()

        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(hold(name)) for name in self._names]
        await acquired.wait()

    def lost(self) -> int:
        return self._lost

    async def release_all(self) -> None:
        self._release.set()
        await asyncio.gather(*self._tasks)


class _NoLease:
    """Takes the place of ``asynclock.lease(...)`` in a holder's task (``tasks_only``)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None
