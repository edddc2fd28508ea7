"""The example job queue (``examples/jobqueue``): enqueue, LISTEN/NOTIFY, recovery of a
dead worker's job within its TTL, and a bounded chaos run (issue 19, B)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from asynclock.testing import RedisServer

asyncpg = pytest.importorskip("asyncpg")

from examples.jobqueue.chaos import ChaosConfig, run_chaos  # noqa: E402
from examples.jobqueue.queue import TTL, Worker, counts, enqueue, install  # noqa: E402


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[Any]:
    pool = await asyncpg.create_pool(database_url, min_size=2, max_size=6)
    async with pool.acquire() as conn:
        await install(conn)
    yield pool
    await pool.close()


async def _until_completed(pool: Any, count: int, within: float) -> float:
    started = time.monotonic()
    while True:
        done = await pool.fetchval("SELECT count(*) FROM jobs WHERE state = 'completed'")
        if done >= count:
            return time.monotonic() - started
        assert time.monotonic() - started < within, f"{done} of {count} completed"
        await asyncio.sleep(0.02)


async def test_enqueue_notifies_and_a_duplicate_key_returns_the_job(
    pool: Any, redis_server: Any
) -> None:
    """A worker waiting on LISTEN runs a new job at once (not at its 5 s poll); the same
    idempotency key enqueued twice is one job, run once."""
    redis = Redis.from_url(redis_server.url)
    worker = asyncio.create_task(Worker("w", redis, pool).run())
    try:
        await asyncio.sleep(0.3)  # (the worker listens)
        async with pool.acquire() as conn:
            first = await enqueue(conn, "demo", {"n": 1}, "same-key")
            again = await enqueue(conn, "demo", {"n": 1}, "same-key")
        assert first == again
        assert await _until_completed(pool, 1, within=3.0) < 1.5
        async with pool.acquire() as conn:
            result = await counts(conn)
        assert (result["jobs"], result["effects"], result["duplicate_effects"]) == (1, 1, 0)
    finally:
        worker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await worker
        await redis.aclose()


_DEAD_WORKER = """
import asyncio, sys
import redis.asyncio as aioredis
import asynclock
async def main():
    client = aioredis.Redis.from_url(sys.argv[1])
    await asynclock.acquire(client, "job:1", ttl=float(sys.argv[2]))
    print("holding", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_a_dead_workers_job_is_taken_over_within_its_ttl(
    pool: Any, redis_server: Any
) -> None:
    """A worker holding job 1's lease is SIGKILLed: another runs the job within the TTL
    plus a second, woken by the lease's expiry (no reconciliation loop)."""
    async with pool.acquire() as conn:
        await enqueue(conn, "demo", {"n": 1}, "orphan")
        await conn.execute("UPDATE jobs SET state = 'running'")
    dead = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _DEAD_WORKER,
        redis_server.url,
        str(TTL),
        stdout=subprocess.PIPE,
    )
    assert dead.stdout is not None
    assert (await asyncio.wait_for(dead.stdout.readline(), 20)).strip() == b"holding"
    redis = Redis.from_url(redis_server.url)
    worker = asyncio.create_task(Worker("w", redis, pool).run())
    try:
        await asyncio.sleep(0.3)  # (it found the job busy, and waits for the lease)
        dead.kill()
        await dead.wait()
        assert await _until_completed(pool, 1, within=TTL + 3) < TTL + 1.0
    finally:
        worker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await worker
        await redis.aclose()


async def test_chaos_run_commits_every_effect_exactly_once(database_url: str) -> None:
    """A bounded run of ``python -m examples.jobqueue chaos``: workers killed, paused past
    their TTL, Redis restarted without persistence and flushed."""
    with RedisServer() as redis_server:
        config = ChaosConfig(
            jobs=80,
            workers=3,
            seconds=8,
            seed=5,
            redis_url=redis_server.url,
            database_url=database_url,
        )
        result = await run_chaos(config)
    assert result["faults"] >= 4
    assert result["duplicate_effects"] == 0
    assert result["lost"] == 0
    assert result["completed"] + result["dead"] == result["jobs"] == 80
    assert result["effects"] == result["completed"]
