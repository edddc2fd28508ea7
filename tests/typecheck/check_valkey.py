"""Type-checked use of the public API with valkey-py's clients (checked by mypy in
./dev lint, never run): they are accepted wherever redis-py's are."""

from __future__ import annotations

from typing import assert_type

from valkey.asyncio import Valkey
from valkey.asyncio.cluster import ValkeyCluster

import asynclock
from asynclock import Lease


async def every_way_in(valkey: Valkey, cluster: ValkeyCluster) -> None:
    async with asynclock.lease(valkey, "orders:42", ttl=10) as lock:
        assert_type(lock, Lease)
    async with asynclock.lease(cluster, "orders:42", limit=3) as permit:
        assert_type(permit, Lease)
    lease = await asynclock.acquire(valkey, "orders:43")
    await lease.release()
    async with asynclock.lease([valkey, Valkey(), Valkey()], "redlocked"):
        pass
    info = await asynclock.inspect(valkey, "orders:42")
    assert_type(info.held, bool)
    stats = await asynclock.statistics(cluster, "orders:42")
    assert_type(stats.held, bool)


async def jobs(valkey: Valkey) -> None:
    async def charge(order_id: int) -> float:
        return 1.0 * order_id

    assert_type(await asynclock.once(valkey, "charge:{order_id}", charge, 3), float)

    @asynclock.exclusive(valkey, "sync:{user_id}", ttl=20)
    async def sync(user_id: int) -> str:
        return str(user_id)

    @asynclock.idempotent(lambda: valkey, key="charge:{order_id}")
    async def charged(order_id: int) -> float:
        return 2.0

    await sync(1)
    await charged(2)
