"""``asynclock.postgres``: the fencing token checked in the transaction of the effects
(issue 19, A and C), against a real PostgreSQL with both drivers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

import asynclock
import asynclock.postgres
from asynclock.testing import ServerInfo

Connect = Callable[[], Awaitable[Any]]


@pytest.fixture(params=["asyncpg", "psycopg"])
async def connect(request: pytest.FixtureRequest, postgres_url: str) -> AsyncIterator[Connect]:
    """``await connect()``: a new connection of the driver under test (closed after)."""
    opened: list[Any] = []

    async def make() -> Any:
        if request.param == "asyncpg":
            import asyncpg

            conn = await asyncpg.connect(postgres_url)
        else:
            import psycopg

            conn = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        await conn.close()


async def _rows(conn: Any, sql: str) -> list[tuple[Any, ...]]:
    if hasattr(conn, "fetch"):
        return [tuple(row) for row in await conn.fetch(sql)]
    cursor = await conn.execute(sql)
    return [tuple(row) for row in await cursor.fetchall()]


async def _execute(conn: Any, sql: str, *args: Any) -> None:
    if hasattr(conn, "fetch"):
        await conn.execute(sql, *args)
    else:
        await conn.execute(sql.replace("$1", "%s").replace("$2", "%s"), args)


@pytest.fixture
async def tables(connect: Connect, prefix: str) -> tuple[str, str]:
    """A fence table and an effects table of this test's own."""
    conn = await connect()
    suffix = prefix.replace(":", "_").strip("_")
    fences, effects = f"fences_{suffix}", f"effects_{suffix}"
    await asynclock.postgres.install(conn, fences)
    await _execute(conn, f"CREATE TABLE {effects} (who text, token bigint)")
    return fences, effects


async def _fenced_write(conn: Any, lease: asynclock.Lease, tables: tuple[str, str]) -> None:
    fences, effects = tables
    async with conn.transaction():
        await asynclock.postgres.fence(conn, lease, fences)
        await _execute(
            conn, f"INSERT INTO {effects} VALUES ($1, $2)", lease.name, lease.fencing_token
        )


async def test_install_is_safe_concurrently(connect: Connect, prefix: str) -> None:
    """Many processes start at once: install() from five connections, twice."""
    conns = [await connect() for _ in range(5)]
    table = "fences_" + prefix.replace(":", "_").strip("_")
    for _ in range(2):
        await asyncio.gather(*(asynclock.postgres.install(c, table) for c in conns))
    assert await _rows(conns[0], f"SELECT count(*) FROM {table}") == [(0,)]


async def test_a_holder_fences_many_transactions(
    connect: Connect, redis: Redis, prefix: str, tables: tuple[str, str]
) -> None:
    conn = await connect()
    async with asynclock.lease(redis, "job", prefix=prefix) as lease:
        await _fenced_write(conn, lease, tables)
        await _fenced_write(conn, lease, tables)  # (the same token again: accepted)
    assert await _rows(conn, f"SELECT token FROM {tables[0]}") == [(lease.fencing_token,)]
    assert len(await _rows(conn, f"SELECT * FROM {tables[1]}")) == 2


async def test_a_stale_holder_is_refused_and_rolled_back(
    connect: Connect, redis: Redis, prefix: str, tables: tuple[str, str]
) -> None:
    """The old holder's key vanished and a newer holder wrote: the old one, still
    believing it holds the lease, is refused (FENCED) and its effects roll back."""
    conn = await connect()
    old = await asynclock.acquire(redis, "job", ttl=10, prefix=prefix)
    await redis.delete(old.key)
    async with asynclock.lease(redis, "job", prefix=prefix) as new:
        await _fenced_write(conn, new, tables)
    assert old.state is asynclock.LeaseState.HELD  # (it does not know yet)
    with pytest.raises(asynclock.LockLost) as lost:
        await _fenced_write(conn, old, tables)
    assert lost.value.reason is asynclock.LossReason.FENCED
    assert await _rows(conn, f"SELECT who, token FROM {tables[1]}") == [("job", new.fencing_token)]
    with pytest.raises(asynclock.LockLost):
        await old.release()


async def test_transactions_of_one_lock_serialize(
    connect: Connect, redis: Redis, prefix: str, tables: tuple[str, str]
) -> None:
    """The fenced row stays locked until the transaction ends: a newer holder's fence
    waits for an older holder's open transaction, and commits after it."""
    first, second = await connect(), await connect()
    old = await asynclock.acquire(redis, "job", ttl=10, prefix=prefix)
    order: list[str] = []
    fenced = asyncio.Event()
    done = asyncio.Event()

    async def older() -> None:
        async with first.transaction():
            await asynclock.postgres.fence(first, old, tables[0])
            fenced.set()
            await asyncio.sleep(0.3)
            order.append("old commits")
        done.set()

    task = asyncio.create_task(older())
    await fenced.wait()
    await redis.delete(old.key)
    async with asynclock.lease(redis, "job", prefix=prefix) as new, second.transaction():
        await asynclock.postgres.fence(second, new, tables[0])  # (waits for older)
        order.append("new fenced")
    await task
    assert order == ["old commits", "new fenced"]
    with pytest.raises(asynclock.LockLost):
        await old.release()


async def test_the_fence_survives_a_redis_flushall(
    private_server: Any, connect: Connect, prefix: str, tables: tuple[str, str]
) -> None:
    """Redis loses every key (its fence counters too): the next holder's token is still
    higher (floored at Redis's clock) and passes the fence."""
    client = Redis.from_url(private_server.url)
    conn = await connect()
    try:
        async with asynclock.lease(client, "job", prefix=prefix) as first:
            await _fenced_write(conn, first, tables)
        await client.flushall()
        async with asynclock.lease(client, "job", prefix=prefix) as second:
            await _fenced_write(conn, second, tables)
        assert second.fencing_token > first.fencing_token
    finally:
        await client.aclose()


async def test_outside_a_transaction(connect: Connect, redis: Redis, prefix: str) -> None:
    conn = await connect()
    async with asynclock.lease(redis, "job", prefix=prefix) as lease:
        with pytest.raises(RuntimeError, match="inside the transaction"):
            await asynclock.postgres.fence(conn, lease)


async def test_a_lease_known_lost_raises_without_a_query(
    connect: Connect, redis: Redis, prefix: str
) -> None:
    """The watchdog knows the lease is lost: LockLost at once (a closed connection
    shows that nothing is sent)."""
    conn = await connect()
    lease = await asynclock.acquire(redis, "job", ttl=10, prefix=prefix)
    await redis.delete(lease.key)
    assert not await lease.is_held(verify=True)
    await conn.close()
    with pytest.raises(asynclock.LockLost) as lost:
        await asynclock.postgres.fence(conn, lease)
    assert lost.value.reason is asynclock.LossReason.NOT_OWNER
    with pytest.raises(asynclock.LockLost):
        await lease.release()


async def test_a_lease_given_back(connect: Connect, redis: Redis, prefix: str) -> None:
    conn = await connect()
    async with asynclock.lease(redis, "job", prefix=prefix) as lease:
        pass
    with pytest.raises(RuntimeError, match="given back"):
        await asynclock.postgres.fence(conn, lease)


async def test_bad_input(connect: Connect, redis: Redis, prefix: str) -> None:
    conn = await connect()
    async with asynclock.lease(redis, "job", prefix=prefix) as lease:
        with pytest.raises(ValueError, match="identifier"):
            await asynclock.postgres.fence(conn, lease, table="x; DROP TABLE y")
        with pytest.raises(TypeError, match="conn must be"):
            await asynclock.postgres.fence(redis, lease)
        with pytest.raises(TypeError, match="lease must be"):
            await asynclock.postgres.fence(conn, "lease")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="identifier"):
            await asynclock.postgres.install(conn, table="")


_STALE_HOLDER = """
import asyncio, sys
import asyncpg
import redis.asyncio as aioredis
import asynclock, asynclock.postgres

redis_url, pg_url, prefix, fences, effects = sys.argv[1:6]

async def main():
    client = aioredis.Redis.from_url(redis_url)
    conn = await asyncpg.connect(pg_url)
    lease = await asynclock.acquire(client, "job", ttl=0.6, prefix=prefix)
    print("acquired", flush=True)
    sys.stdin.readline()  # (paused with SIGSTOP around here, then resumed)
    try:
        async with conn.transaction():
            await asynclock.postgres.fence(conn, lease, fences)
            await conn.execute(f"INSERT INTO {effects} VALUES ('stale', $1)",
                               lease.fencing_token)
        print("committed", flush=True)
    except asynclock.LockLost as lost:
        print("lost", lost.reason, flush=True)
    await conn.close()
    try:
        await lease.release()
    except asynclock.LockLost:
        pass
    await client.aclose()

asyncio.run(main())
"""


async def test_a_paused_holder_cannot_commit(
    redis_server: ServerInfo,
    redis: Redis,
    postgres_url: str,
    connect: Connect,
    prefix: str,
    tables: tuple[str, str],
) -> None:
    """A holder SIGSTOPped past its TTL while another takes over and writes: resumed,
    its transaction is refused (FENCED, or lost locally first), and never commits."""
    holder = await asyncio.create_subprocess_exec(
        *[sys.executable, "-c", _STALE_HOLDER, redis_server.url, postgres_url, prefix, *tables],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    conn = await connect()
    try:
        assert holder.stdout is not None
        assert (await asyncio.wait_for(holder.stdout.readline(), 20)).strip() == b"acquired"
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            async with asynclock.lease(redis, "job", prefix=prefix, blocking_timeout=5) as new:
                await _fenced_write(conn, new, tables)
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        out, _ = await asyncio.wait_for(holder.communicate(b"go\n"), 20)
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
    assert out.startswith(b"lost"), out
    assert await _rows(conn, f"SELECT who FROM {tables[1]}") == [("job",)]
