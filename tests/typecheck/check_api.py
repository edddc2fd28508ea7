"""Type-checked use of the public API (checked by mypy in ./dev lint, never run).

If a change to asynclock's signatures breaks a user's typed code, mypy fails here.
"""

from __future__ import annotations

from typing import assert_type

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

import asynclock
from asynclock import Lease, LeaseState, LockLost, LossReason


async def typical(redis: Redis) -> int:
    async with asynclock.lease(redis, "orders:42", ttl=10, blocking_timeout=5) as lock:
        assert_type(lock, Lease)
        assert_type(lock.fencing_token, int)
        assert_type(lock.token, str)
        assert_type(lock.time_left, float)
        assert_type(lock.state, LeaseState)
        assert_type(await lock.is_held(), bool)
        assert_type(await lock.is_held(verify=True), bool)
        await lock.extend()
        return lock.fencing_token


def reasons(error: LockLost) -> str:
    assert_type(error.reason, LossReason)
    return error.reason.value


def hook(event: asynclock.LeaseEvent) -> None:
    assert_type(event.kind, asynclock.LeaseEventKind)
    assert_type(event.at, float)


async def with_hook(redis: Redis) -> None:
    async with asynclock.lease(redis, "x", on_event=hook, blocking=False):
        pass


async def held_without_a_block(redis: Redis) -> None:
    lock = await asynclock.acquire(redis, "partition-7", ttl=30, on_event=hook)
    assert_type(lock, Lease)
    async with lock.guard() as guarded:
        assert_type(guarded, Lease)
    await lock.release()


async def deployments(cluster: RedisCluster, r1: Redis, r2: Redis, r3: Redis) -> int:
    async with asynclock.lease(cluster, "x", min_replicas=1, wait_aof=True) as on_cluster:
        assert_type(on_cluster, Lease)
    async with asynclock.lease([r1, r2, r3], "x", ttl=5) as redlock:
        assert_type(redlock, asynclock.RedlockLease)
        assert_type(redlock.held_on, int)
    held = await asynclock.acquire([r1, r2, r3], "x")
    assert_type(held, asynclock.RedlockLease)
    await held.release()
    single = await asynclock.acquire(r1, "x")
    assert_type(single, Lease)
    await single.release()
    return redlock.fencing_token
