"""The arq recipe of docs/frameworks.md against real arq workers (issue 30): two worker
processes on the test's server run ``tests/arq_jobs.py``; a job enqueued twice runs once
(``idempotent``), a duplicate of a running job is skipped (``exclusive``), and a job
scheduled with ``every()`` from the workers' startup runs once per tick across them.

arq pins redis-py below 6, so it is not in the ``test`` extra (the main venv has the
newest redis-py): ``tests/matrix.py``'s leg on Python 3.11 and the oldest redis-py
installs the ``test-arq`` extra and runs this file; elsewhere it is skipped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from asynclock.testing import ServerInfo

pytest.importorskip("arq", reason="arq is installed by the test-arq extra (tests/matrix.py)")

from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.jobs import Job

ROOT = Path(__file__).resolve().parent.parent
WAIT = 15.0  # seconds any one wait of these tests may take


@contextmanager
def workers(url: str, prefix: str, log_dir: Path, every: str = "") -> Iterator[None]:
    """Two arq worker processes running tests/arq_jobs.py, stopped (SIGTERM, then
    SIGKILL) on the way out."""
    env = os.environ | {
        "ARQ_TEST_URL": url,
        "ARQ_TEST_PREFIX": prefix,
        "ARQ_TEST_EVERY": every,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for n in range(2):
            log = (log_dir / f"worker{n}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "arq", "tests.arq_jobs.WorkerSettings"],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@asynccontextmanager
async def started(
    redis_server: ServerInfo, prefix: str, tmp_path: Path, every: str = ""
) -> AsyncIterator[tuple[Redis, ArqRedis]]:
    """Both workers started (each has run its on_startup), a client and an arq pool."""
    redis = Redis.from_url(redis_server.url)
    pool = await create_pool(
        RedisSettings.from_dsn(redis_server.url), default_queue_name=f"{prefix}queue"
    )
    try:
        with workers(redis_server.url, prefix, tmp_path, every):
            pids = {await pop(redis, f"{prefix}started", tmp_path) for _ in range(2)}
            assert len(pids) == 2
            yield redis, pool
    finally:
        await pool.aclose()
        await redis.aclose()


async def pop(redis: Redis, key: str, log_dir: Path) -> bytes:
    """The next item pushed to ``key``, waited for at most WAIT seconds."""
    got = await redis.blpop([key], timeout=WAIT)
    if got is None:
        pytest.fail(
            f"nothing pushed to {key} within {WAIT} s; the workers' logs:\n{tails(log_dir)}"
        )
    return bytes(got[1])


def tails(log_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(log_dir.glob("*.log")))


async def test_a_job_enqueued_twice_runs_once(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    async with started(redis_server, prefix, tmp_path) as (redis, pool):
        first = await pool.enqueue_job("charge", 9)
        second = await pool.enqueue_job("charge", 9)
        assert first is not None
        assert second is not None
        ran_in = await pop(redis, f"{prefix}entered:charge:9", tmp_path)
        started_jobs = {await pop(redis, f"{prefix}job-started", tmp_path) for _ in range(2)}
        # (both started, so on both workers: each runs one job at a time)
        assert started_jobs == {first.job_id.encode(), second.job_id.encode()}
        await redis.rpush(f"{prefix}go:charge:9", "go")
        expected = f"charged 9 in {ran_in.decode()}"
        assert await first.result(timeout=WAIT, poll_delay=0.05) == expected
        assert await second.result(timeout=WAIT, poll_delay=0.05) == expected
        third = await pool.enqueue_job("charge", 9)  # (after it ran: the stored result)
        assert third is not None
        assert await third.result(timeout=WAIT, poll_delay=0.05) == expected
        assert await redis.llen(f"{prefix}entered:charge:9") == 0  # (entered once only)


async def test_a_duplicate_of_a_running_job_is_skipped(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    async with started(redis_server, prefix, tmp_path) as (redis, pool):
        jobs = [await pool.enqueue_job("sync_user", 7) for _ in range(2)]
        assert None not in jobs
        ran_in = await pop(redis, f"{prefix}entered:sync:7", tmp_path)
        results: dict[asyncio.Task[Any], Job] = {
            asyncio.create_task(job.result(timeout=WAIT, poll_delay=0.05)): job  # type: ignore[union-attr]
            for job in jobs
        }
        done, pending = await asyncio.wait(
            results, timeout=WAIT, return_when=asyncio.FIRST_COMPLETED
        )
        assert len(done) == 1, "neither job ended while the other held the key"
        assert done.pop().result() is None  # (skipped: the other held the key)
        await redis.rpush(f"{prefix}go:sync:7", "go")
        assert await pending.pop() == f"synced 7 in {ran_in.decode()}"
        assert await redis.llen(f"{prefix}entered:sync:7") == 0
        ran_again = await pool.enqueue_job("sync_user", 7)  # (the key is free again)
        assert ran_again is not None
        await pop(redis, f"{prefix}entered:sync:7", tmp_path)
        await redis.rpush(f"{prefix}go:sync:7", "go")
        assert await ran_again.result(timeout=WAIT, poll_delay=0.05) is not None


async def test_every_runs_once_per_tick_across_workers(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    async with started(redis_server, prefix, tmp_path, every="1") as (redis, _):
        for _ in range(4):
            await pop(redis, f"{prefix}ran", tmp_path)
        ticks = {int(t): int(n) for t, n in (await redis.hgetall(f"{prefix}ticks")).items()}
    assert all(n == 1 for n in ticks.values()), f"runs per tick: {ticks}"
    assert len(ticks) >= 4
