"""A job queue whose every job's effects are committed exactly once.

PostgreSQL holds the jobs and their effects; a Redis lease per job decides who runs it.
The lease alone cannot stop a worker that was paused, or whose key was lost, from going
on: what makes a run's effects count is the transaction that commits them, opened by
``asynclock.postgres.fence()`` (a newer holder's token refuses it) and checking the job's
state (a completed job is not run again). Workers wait on LISTEN/NOTIFY, not in a loop of
sleeps, and wake at the moment a running job's lease could expire, so the job of a worker
that died is taken over within its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
from typing import Any

import asyncpg
from redis.asyncio import Redis
from redis.exceptions import RedisError

import asynclock
import asynclock.postgres

log = logging.getLogger("jobqueue")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id bigserial PRIMARY KEY,
    kind text NOT NULL,
    payload jsonb NOT NULL,
    idempotency_key text UNIQUE NOT NULL,
    state text NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'running', 'completed', 'dead')),
    attempts int NOT NULL DEFAULT 0,
    fence bigint,
    run_after timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS job_effects (   -- deliberately no unique constraint
    job_id bigint NOT NULL REFERENCES jobs (id),
    worker text NOT NULL,
    fencing_token bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT now()
);
"""

MAX_ATTEMPTS = 5
TTL = 2.0  # seconds: a dead worker's job is taken over within this
POLL = 5.0  # seconds: the fallback when no notification comes
CHANNEL = "jobs"


async def install(conn: asyncpg.Connection) -> None:
    """Create the tables (safe on every start)."""
    await asynclock.postgres.install(conn)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(7261)")
        await conn.execute(SCHEMA)


async def enqueue(conn: asyncpg.Connection, kind: str, payload: Any, key: str) -> int:
    """Add a job; a duplicate idempotency key returns the existing job's id."""
    row = await conn.fetchrow(
        "INSERT INTO jobs (kind, payload, idempotency_key) VALUES ($1, $2, $3) "
        "ON CONFLICT (idempotency_key) DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key "
        "RETURNING id",
        kind,
        json.dumps(payload),
        key,
    )
    await conn.execute(f"NOTIFY {CHANNEL}")
    return int(row["id"])


class Worker:
    """Runs jobs until stopped. ``handler(payload)`` does the work; its effect is the
    ``job_effects`` row written in the completing transaction."""

    def __init__(
        self, name: str, redis: Redis, pool: asyncpg.Pool, *, fail_rate: float = 0.0, seed: int = 0
    ) -> None:
        self.name = name
        self.redis = redis
        self.pool = pool
        self.fail_rate = fail_rate
        self.random = random.Random(seed)
        self.wake = asyncio.Event()

    async def handler(self, payload: Any, attempt: int) -> None:
        await asyncio.sleep(self.random.uniform(0.01, 0.05))  # the work
        if attempt < 2 and self.random.random() < self.fail_rate:
            raise RuntimeError("transient failure")

    async def run(self) -> None:
        def notified(*_: object) -> None:
            self.wake.set()

        async with self.pool.acquire() as listener:
            await listener.add_listener(CHANNEL, notified)
            try:
                while True:
                    self.wake.clear()
                    try:
                        wait = await self.sweep()
                    except (RedisError, OSError, asyncpg.PostgresError) as exc:
                        log.warning("%s: %r; trying again", self.name, exc)
                        wait = 0.2
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await self.wake.wait()
            finally:
                await listener.remove_listener(CHANNEL, notified)

    async def sweep(self) -> float:
        """Run a job that is due and free; returns how long to wait before looking again
        (0 after a job: the list has changed; else the soonest a busy job's lease could
        expire, or a retry fall due)."""
        rows = await self.pool.fetch(
            "SELECT id, extract(epoch FROM run_after - now()) AS due_in FROM jobs "
            "WHERE state IN ('pending', 'running') ORDER BY state, run_after, id LIMIT 32"
        )
        wait = POLL
        for row in self.random.sample(list(rows), len(rows)):  # (workers spread out)
            if row["due_in"] > 0:
                wait = min(wait, float(row["due_in"]))
                continue
            try:
                async with asynclock.lease(
                    self.redis, f"job:{row['id']}", ttl=TTL, blocking=False
                ) as lease:
                    await self.attempt(row["id"], lease)
                return 0.0
            except asynclock.LockBusy as busy:  # running elsewhere: look when it may end
                wait = min(wait, busy.retry_after or TTL)
            except asynclock.LockLost as lost:  # (FENCED: a newer holder has committed)
                log.warning("%s: job %s: lease lost (%s)", self.name, row["id"], lost.reason)
        return wait

    async def attempt(self, job_id: int, lease: asynclock.Lease) -> None:
        async with self.pool.acquire() as conn:
            async with conn.transaction():  # mark it running (fenced: we are its holder)
                await asynclock.postgres.fence(conn, lease)
                job = await conn.fetchrow(
                    "UPDATE jobs SET state = 'running', attempts = attempts + 1, fence = $2, "
                    "updated_at = now() WHERE id = $1 AND state IN ('pending', 'running') "
                    "RETURNING payload, attempts",
                    job_id,
                    lease.fencing_token,
                )
            if job is None:
                return  # completed (or dead) meanwhile
            try:
                await self.handler(json.loads(job["payload"]), job["attempts"])
            except Exception as exc:
                await self.fail(conn, job_id, lease, job["attempts"], exc)
                return
            async with conn.transaction():  # the effect and the completion, or neither
                await asynclock.postgres.fence(conn, lease)
                state = await conn.fetchval(
                    "SELECT state FROM jobs WHERE id = $1 FOR UPDATE", job_id
                )
                if state != "running":
                    return
                await conn.execute(
                    "INSERT INTO job_effects (job_id, worker, fencing_token) VALUES ($1, $2, $3)",
                    job_id,
                    self.name,
                    lease.fencing_token,
                )
                await conn.execute(
                    "UPDATE jobs SET state = 'completed', updated_at = now() WHERE id = $1", job_id
                )

    async def fail(
        self,
        conn: asyncpg.Connection,
        job_id: int,
        lease: asynclock.Lease,
        attempts: int,
        exc: Exception,
    ) -> None:
        """Retry later with backoff, or dead-letter it after MAX_ATTEMPTS."""
        dead = attempts >= MAX_ATTEMPTS
        backoff = min(2.0, 0.05 * 2**attempts)
        async with conn.transaction():
            await asynclock.postgres.fence(conn, lease)
            await conn.execute(
                "UPDATE jobs SET state = $2, run_after = now() + make_interval(secs => $3), "
                "updated_at = now() WHERE id = $1 AND state = 'running'",
                job_id,
                "dead" if dead else "pending",
                backoff,
            )
        log.info("%s: job %s failed (%r)%s", self.name, job_id, exc, ", dead" if dead else "")


async def counts(conn: asyncpg.Connection) -> dict[str, int]:
    """What the tables say: jobs, completed, dead, effects, duplicate effects, lost."""
    row = await conn.fetchrow(
        "SELECT (SELECT count(*) FROM jobs) AS jobs, "
        "(SELECT count(*) FROM jobs WHERE state = 'completed') AS completed, "
        "(SELECT count(*) FROM jobs WHERE state = 'dead') AS dead, "
        "(SELECT count(*) FROM job_effects) AS effects, "
        "(SELECT count(*) FROM (SELECT job_id FROM job_effects GROUP BY job_id "
        " HAVING count(*) > 1) d) AS duplicate_effects, "
        "(SELECT count(*) FROM jobs j WHERE state = 'completed' AND NOT EXISTS "
        " (SELECT 1 FROM job_effects e WHERE e.job_id = j.id)) AS lost"
    )
    return {key: int(value) for key, value in row.items()}


async def run_worker(
    name: str, redis_url: str, database_url: str, fail_rate: float, seed: int
) -> None:
    redis = Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    pool = await asyncpg.create_pool(database_url, min_size=2, max_size=4)
    try:
        await Worker(name, redis, pool, fail_rate=fail_rate, seed=seed).run()
    finally:
        await pool.close()
        await redis.aclose()


def worker_main(argv: list[str]) -> None:
    name, redis_url, database_url, fail_rate, seed = argv
    logging.basicConfig(level=os.environ.get("JOBQUEUE_LOG", "WARNING"))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_worker(name, redis_url, database_url, float(fail_rate), int(seed)))
