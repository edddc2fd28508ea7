"""The example job queue's throughput and recovery: ``python -m benchmarks.jobqueue``.

- jobs per second with 4 workers: ``examples.jobqueue`` (a lease per job, fenced commits)
  vs the same queue without asynclock, claiming rows with ``SELECT ... FOR UPDATE SKIP
  LOCKED`` and holding the row lock (and a transaction) for the whole job;
- recovery: how long after a worker holding a job dies another one completes it
  (asynclock: the lease's expiry wakes a waiting worker; target within TTL + 1 s, against
  the 30 s reconciliation loop such queues usually run).

Private Redis and PostgreSQL servers are started. The report is printed; ``--update``
writes ``benchmarks/jobqueue-results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
from redis.asyncio import Redis

from asynclock.testing import PostgresServer, RedisServer
from examples.jobqueue.queue import TTL, Worker, enqueue, install

RESULTS = Path(__file__).with_name("jobqueue-results.md")
WORK = 0.01  # seconds each job's handler takes


class _Fixed(Worker):
    async def handler(self, payload: object, attempt: int) -> None:
        await asyncio.sleep(WORK)


async def _fill(pool: asyncpg.Pool, jobs: int, tag: str) -> None:
    async with pool.acquire() as conn:
        await conn.execute("TRUNCATE job_effects, jobs RESTART IDENTITY")
        for index in range(jobs):
            await enqueue(conn, "demo", {"n": index}, f"{tag}-{index}")


async def _drained(pool: asyncpg.Pool) -> None:
    while await pool.fetchval("SELECT count(*) FROM jobs WHERE state <> 'completed'"):
        await asyncio.sleep(0.01)


async def with_asynclock(pool: asyncpg.Pool, redis_url: str, jobs: int) -> float:
    await _fill(pool, jobs, "a")
    clients = [Redis.from_url(redis_url) for _ in range(4)]
    started = time.perf_counter()
    workers = [asyncio.create_task(_Fixed(f"w{i}", c, pool).run()) for i, c in enumerate(clients)]
    await _drained(pool)
    elapsed = time.perf_counter() - started
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    for client in clients:
        await client.aclose()
    return jobs / elapsed


async def skip_locked_worker(pool: asyncpg.Pool) -> None:
    """The baseline: a row lock held, in a transaction, for the whole job."""
    while True:
        async with pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                "SELECT id FROM jobs WHERE state = 'pending' ORDER BY id "
                "FOR UPDATE SKIP LOCKED LIMIT 1"
            )
            if row is None:
                await asyncio.sleep(0.01)
                continue
            await asyncio.sleep(WORK)
            await conn.execute(
                "INSERT INTO job_effects (job_id, worker, fencing_token) VALUES ($1, 'b', 0)",
                row["id"],
            )
            await conn.execute("UPDATE jobs SET state = 'completed' WHERE id = $1", row["id"])


async def with_skip_locked(pool: asyncpg.Pool, jobs: int) -> float:
    await _fill(pool, jobs, "b")
    started = time.perf_counter()
    workers = [asyncio.create_task(skip_locked_worker(pool)) for _ in range(4)]
    await _drained(pool)
    elapsed = time.perf_counter() - started
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return jobs / elapsed


_HOLDER = """
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


async def recovery(pool: asyncpg.Pool, redis_url: str) -> float:
    """Seconds from a holder's SIGKILL to its job's completion by another worker."""
    await _fill(pool, 1, "r")
    await pool.execute("UPDATE jobs SET state = 'running'")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, redis_url, str(TTL)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    holder.stdout.readline()
    client = Redis.from_url(redis_url)
    worker = asyncio.create_task(_Fixed("w", client, pool).run())
    await asyncio.sleep(0.3)
    holder.kill()
    holder.communicate()
    killed = time.perf_counter()
    await _drained(pool)
    took = time.perf_counter() - killed
    worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    await client.aclose()
    return took


async def fence_cost(pool: asyncpg.Pool, redis_url: str, count: int = 2000) -> tuple[float, float]:
    """Seconds per ``fence()`` and per ``SELECT 1``, each inside an open transaction,
    measured in alternating blocks."""
    import asynclock
    import asynclock.postgres

    client = Redis.from_url(redis_url)
    lease = await asynclock.acquire(client, "bench:fence", ttl=30)
    fences: list[float] = []
    selects: list[float] = []
    try:
        async with pool.acquire() as conn, conn.transaction():
            for block in range(10):
                for kind in ("fence", "select") if block % 2 else ("select", "fence"):
                    started = time.perf_counter()
                    for _ in range(count // 10):
                        if kind == "fence":
                            await asynclock.postgres.fence(conn, lease)
                        else:
                            await conn.fetchval("SELECT 1")
                    took = (time.perf_counter() - started) / (count // 10)
                    (fences if kind == "fence" else selects).append(took)
    finally:
        await lease.release()
        await client.aclose()
    fences.sort()
    selects.sort()
    return fences[len(fences) // 2], selects[len(selects) // 2]


async def run(redis_url: str, database_url: str, jobs: int) -> str:
    pool = await asyncpg.create_pool(database_url, min_size=4, max_size=16)
    try:
        async with pool.acquire() as conn:
            await install(conn)
        ours = await with_asynclock(pool, redis_url, jobs)
        base = await with_skip_locked(pool, jobs)
        recovered = await recovery(pool, redis_url)
        fenced, select = await fence_cost(pool, redis_url)
    finally:
        await pool.close()
    return "\n".join(
        [
            "# Job queue benchmarks",
            "",
            f"`python -m benchmarks.jobqueue --jobs {jobs}`, {time.strftime('%Y-%m-%d')}: "
            f"4 workers (asyncio tasks, one process), a {WORK * 1000:.0f} ms job, private "
            "Redis and PostgreSQL on loopback.",
            "",
            "| what | figure |",
            "|---|---|",
            f"| examples.jobqueue (asynclock lease + fenced commit) | {ours:.0f} jobs/s |",
            f"| SELECT ... FOR UPDATE SKIP LOCKED, row lock held for the job | {base:.0f} jobs/s |",
            f"| ratio | {ours / base:.2f}x |",
            f"| `fence()` in an open transaction vs `SELECT 1` | {fenced * 1e6:.0f} vs "
            f"{select * 1e6:.0f} µs ({fenced / select:.2f}x: one statement, one round trip; the rest is the upsert itself) |",
            f"| a killed worker's job completed by another after | {recovered:.2f} s "
            f"(TTL {TTL:g} s; target TTL + 1 s: {'met' if recovered < TTL + 1 else 'not met'}) |",
            "",
            json.dumps(
                {
                    "jobs_per_s": ours,
                    "skip_locked_jobs_per_s": base,
                    "recovery_s": recovered,
                    "fence_s": fenced,
                    "select_s": select,
                }
            ),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.jobqueue",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--update", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    with RedisServer() as redis_server, PostgresServer() as postgres:
        report = asyncio.run(run(redis_server.url, postgres.url, args.jobs))
    print(report)
    if args.update:
        RESULTS.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
