"""``asynclock.statistics()``: holders and waiters of every kind of lock (issue 20, B)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from helpers import wait_until
from redis.asyncio import Redis

import asynclock


async def test_a_free_lock(client: Redis, prefix: str) -> None:
    stats = await asynclock.statistics(client, "nothing", prefix=prefix)
    assert not stats.held
    assert (stats.exclusive, stats.shared_holders, stats.permits_in_use) == (False, 0, 0)
    assert (stats.limit, stats.time_left, stats.waiting_clients, stats.queued) == (
        None,
        None,
        0,
        0,
    )
    assert stats.local_waiters == 0


async def test_an_exclusive_holder_and_its_waiters(
    redis_server: object, make_client: Callable[..., Redis], prefix: str
) -> None:
    """Held by one client; two tasks of another wait (one client registered, two local
    waiters there, none here)."""
    holder, other = make_client(), make_client()
    lock = await asynclock.acquire(holder, "x", ttl=5, prefix=prefix)
    waiters = [
        asyncio.create_task(asynclock.acquire(other, "x", ttl=5, prefix=prefix)) for _ in range(2)
    ]

    async def registered() -> bool:
        return (await asynclock.statistics(holder, "x", prefix=prefix)).waiting_clients == 1

    await wait_until(registered, what="the other client registered as waiting")
    seen_here = await asynclock.statistics(holder, "x", prefix=prefix)
    seen_there = await asynclock.statistics(other, "x", prefix=prefix)
    assert seen_here.exclusive
    assert seen_here.held
    assert seen_here.time_left is not None
    assert 0 < seen_here.time_left <= 5
    assert seen_here.local_waiters == 0
    assert seen_there.local_waiters == 2
    await lock.release()
    for next_one in asyncio.as_completed(waiters):  # (whichever got it first)
        await (await next_one).release()


async def test_shared_holders_permits_and_a_fair_queue(client: Redis, prefix: str) -> None:
    readers = [  # (acquire(): one task may not enter two blocks of one lock)
        await asynclock.acquire(client, "doc", shared=True, prefix=prefix) for _ in range(2)
    ]
    stats = await asynclock.statistics(client, "doc", prefix=prefix)
    assert (stats.exclusive, stats.shared_holders, stats.held) == (False, 2, True)
    for reader in readers:
        await reader.release()
    async with (
        asynclock.lease(client, "sem", limit=3, prefix=prefix),
        asynclock.lease(client, "sem", limit=3, prefix=prefix),
    ):
        stats = await asynclock.statistics(client, "sem", prefix=prefix)
        assert (stats.permits_in_use, stats.limit, stats.exclusive) == (2, 3, False)
    held = await asynclock.acquire(client, "fair", fair=True, prefix=prefix)
    queued = [
        asyncio.create_task(asynclock.acquire(client, "fair", fair=True, prefix=prefix))
        for _ in range(2)
    ]

    async def both_queued() -> bool:
        return (await asynclock.statistics(client, "fair", prefix=prefix)).queued == 2

    await wait_until(both_queued, what="two fair waiters queued")
    stats = await asynclock.statistics(client, "fair", prefix=prefix)
    assert stats.exclusive
    assert stats.local_waiters == 2
    await held.release()
    for next_one in asyncio.as_completed(queued):
        await (await next_one).release()


async def test_bad_arguments_are_refused_before_any_io() -> None:
    nowhere = Redis(host="127.0.0.1", port=1)
    with pytest.raises(ValueError, match="name must not be empty"):
        await asynclock.statistics(nowhere, "")
    with pytest.raises(TypeError, match="prefix must be a str"):
        await asynclock.statistics(nowhere, "x", prefix=3)  # type: ignore[arg-type]
    await nowhere.aclose()
