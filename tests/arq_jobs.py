"""The arq recipe of docs/frameworks.md as a real arq worker runs it (tests/test_arq.py
starts two of them: ``python -m arq tests.arq_jobs.WorkerSettings``).

Configured from the environment the test sets: ``ARQ_TEST_URL`` (the test's server),
``ARQ_TEST_PREFIX`` (the test's key prefix: the queue, the leases and the probes' keys all
start with it) and ``ARQ_TEST_EVERY`` (seconds: the period of the ``every()`` started at
the worker's startup; empty for none). The jobs report to the test through Redis keys
under the prefix, and wait for the test's go-ahead on a list (bounded by ``_WAIT``).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any, ClassVar

from arq.connections import RedisSettings

import asynclock

URL = os.environ.get("ARQ_TEST_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("ARQ_TEST_PREFIX", "arq-test:")
EVERY = os.environ.get("ARQ_TEST_EVERY", "")
QUEUE = f"{PREFIX}queue"
_WAIT = 15  # seconds a job waits for the test's go-ahead before it fails


async def _go_ahead(ctx: dict[str, Any], name: str) -> None:
    """Wait for the test to push to ``{PREFIX}go:{name}``."""
    if await ctx["redis"].blpop([f"{PREFIX}go:{name}"], timeout=_WAIT) is None:
        raise TimeoutError(f"no go-ahead for {name} within {_WAIT} s")


@asynclock.exclusive(
    asynclock.client_from("ctx[redis]"), "sync:{user_id}", busy="skip", ttl=5, prefix=PREFIX
)
async def sync_user(ctx: dict[str, Any], user_id: int) -> str:
    """One sync of a user at a time across the workers; a duplicate that finds it
    running is skipped (returns ``None``)."""
    await ctx["redis"].rpush(f"{PREFIX}entered:sync:{user_id}", os.getpid())
    await _go_ahead(ctx, f"sync:{user_id}")
    return f"synced {user_id} in {os.getpid()}"


@asynclock.idempotent(
    asynclock.client_from("ctx[redis]"), key="charge:{order_id}", ttl=5, prefix=PREFIX
)
async def charge(ctx: dict[str, Any], order_id: int) -> str:
    """Charge an order once, however many times the job is enqueued: every duplicate
    returns the first run's result."""
    await ctx["redis"].rpush(f"{PREFIX}entered:charge:{order_id}", os.getpid())
    await _go_ahead(ctx, f"charge:{order_id}")
    return f"charged {order_id} in {os.getpid()}"


async def report(ctx: dict[str, Any]) -> None:
    """The scheduled job: counts its runs per tick (the whole second it started in)."""
    tick = math.floor(time.time())
    await ctx["redis"].hincrby(f"{PREFIX}ticks", str(tick), 1)
    await ctx["redis"].rpush(f"{PREFIX}ran", tick)


async def startup(ctx: dict[str, Any]) -> None:
    await ctx["redis"].rpush(f"{PREFIX}started", os.getpid())
    if EVERY:
        ctx["every"] = asyncio.create_task(
            asynclock.every(ctx["redis"], "report", float(EVERY), report, ctx, prefix=PREFIX)
        )


async def job_started(ctx: dict[str, Any]) -> None:
    await ctx["redis"].rpush(f"{PREFIX}job-started", ctx["job_id"])


async def shutdown(ctx: dict[str, Any]) -> None:
    task: asyncio.Task[None] | None = ctx.get("every")
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class WorkerSettings:
    functions: ClassVar[list[Any]] = [sync_user, charge]
    on_startup = startup
    on_job_start = job_started
    on_shutdown = shutdown
    redis_settings = RedisSettings.from_dsn(URL)
    queue_name = QUEUE
    max_jobs = 1  # (two jobs at once must run on two workers)
    poll_delay = 0.05
    max_tries = 1
    health_check_key = f"{PREFIX}health"
