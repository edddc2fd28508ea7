"""``python -m examples.jobqueue chaos``: workers in processes of their own drain a queue
while faults are injected; the tables then say whether every job's effect was committed
exactly once.

Faults, drawn by a seeded random generator: SIGKILL a worker (a new one replaces it),
SIGSTOP a worker past its lease's TTL and resume it, restart Redis without persistence,
FLUSHALL. After ``--seconds`` the faults stop and the survivors drain the queue (bounded);
the last line is ``jobs=N completed=N effects=N duplicate_effects=0 lost=0``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg
from redis.asyncio import Redis

from asynclock.testing import PostgresServer, RedisServer

from .queue import TTL, counts, enqueue, install


@dataclass
class ChaosConfig:
    jobs: int = 200
    workers: int = 4
    seconds: float = 20.0
    seed: int = 1
    fail_rate: float = 0.1
    drain_timeout: float = 60.0
    redis_url: str | None = None
    database_url: str | None = None


@contextlib.contextmanager
def _servers(config: ChaosConfig) -> Iterator[tuple[str, str, RedisServer | None]]:
    """The Redis and PostgreSQL URLs: given ones, or private servers started here."""
    with contextlib.ExitStack() as stack:
        redis_server = None
        redis_url = config.redis_url
        if redis_url is None:
            redis_server = stack.enter_context(RedisServer())
            redis_url = redis_server.url
        database_url = config.database_url
        if database_url is None:
            database_url = stack.enter_context(PostgresServer()).url
        yield redis_url, database_url, redis_server


def _spawn(
    index: int, redis_url: str, database_url: str, config: ChaosConfig
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from examples.jobqueue.queue import worker_main; "
            "worker_main(sys.argv[1:])",
            f"worker-{index}",
            redis_url,
            database_url,
            str(config.fail_rate),
            str(config.seed * 1000 + index),
        ],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )


async def run_chaos(config: ChaosConfig) -> dict[str, int]:
    """Run the scenario and return the final counts (see ``queue.counts``)."""
    rng = random.Random(config.seed)
    with _servers(config) as (redis_url, database_url, redis_server):
        conn = await asyncpg.connect(database_url)
        try:
            await install(conn)
            await conn.execute("TRUNCATE job_effects, jobs RESTART IDENTITY")
            for index in range(config.jobs):
                await enqueue(conn, "demo", {"n": index}, f"job-{config.seed}-{index}")
            await enqueue(conn, "demo", {"n": 0}, f"job-{config.seed}-0")  # (a duplicate)
            workers = [_spawn(i, redis_url, database_url, config) for i in range(config.workers)]
            spawned = config.workers
            faults: dict[str, int] = {}
            try:
                ends = time.monotonic() + config.seconds
                while time.monotonic() < ends:
                    await asyncio.sleep(rng.uniform(0.5, 1.5))
                    fault = rng.choice(["kill", "pause", "restart-redis", "flushall"])
                    if fault in ("restart-redis", "flushall") and redis_server is None:
                        fault = "kill"  # (an existing server is not ours to restart)
                    faults[fault] = faults.get(fault, 0) + 1
                    victim = rng.randrange(len(workers))
                    if fault == "kill":
                        workers[victim].kill()
                        workers[victim].wait()
                        workers[victim] = _spawn(spawned, redis_url, database_url, config)
                        spawned += 1
                    elif fault == "pause":
                        os.kill(workers[victim].pid, signal.SIGSTOP)
                        await asyncio.sleep(TTL * 1.5)
                        os.kill(workers[victim].pid, signal.SIGCONT)
                    elif fault == "restart-redis":
                        assert redis_server is not None
                        redis_server.restart()
                    else:
                        client = Redis.from_url(redis_url)
                        with contextlib.suppress(Exception):
                            await client.flushall()
                        await client.aclose()
                    print(f"fault: {fault}", flush=True)
                drain_ends = time.monotonic() + config.drain_timeout
                while time.monotonic() < drain_ends:
                    left = await conn.fetchval(
                        "SELECT count(*) FROM jobs WHERE state IN ('pending', 'running')"
                    )
                    if left == 0:
                        break
                    print(f"draining: {left} jobs left", flush=True)
                    await asyncio.sleep(1.0)
            finally:
                for worker in workers:
                    worker.terminate()
                for worker in workers:
                    try:
                        worker.wait(10)
                    except subprocess.TimeoutExpired:
                        worker.kill()
                        worker.wait()
            result = await counts(conn)
            result["faults"] = sum(faults.values())
            return result
        finally:
            await conn.close()
