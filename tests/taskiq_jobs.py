"""The taskiq recipe of docs/frameworks.md as a real taskiq worker runs it
(tests/test_taskiq.py starts ``taskiq worker tests.taskiq_jobs:broker --workers 2``).

Configured from the environment the test sets: ``TASKIQ_TEST_URL`` (the test's server)
and ``TASKIQ_TEST_PREFIX`` (the test's key prefix: the queue, the leases and the probes'
keys start with it). The task reports to the test through Redis keys under the prefix,
and waits for the test's go-ahead on a list (bounded by ``_WAIT``).
"""

from __future__ import annotations

import os

from redis.asyncio import Redis
from taskiq import TaskiqEvents, TaskiqState
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

import asynclock

URL = os.environ.get("TASKIQ_TEST_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("TASKIQ_TEST_PREFIX", "taskiq-test:")
_WAIT = 15  # seconds a task waits for the test's go-ahead before it fails

broker = ListQueueBroker(URL, queue_name=f"{PREFIX}queue").with_result_backend(
    RedisAsyncResultBackend(URL, result_ex_time=60, prefix_str=PREFIX.rstrip(":"))
)


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def startup(state: TaskiqState) -> None:
    state.redis = Redis.from_url(URL)
    await state.redis.rpush(f"{PREFIX}started", os.getpid())


@broker.on_event(TaskiqEvents.WORKER_SHUTDOWN)
async def shutdown(state: TaskiqState) -> None:
    await state.redis.aclose()


@broker.task
@asynclock.exclusive(
    lambda: broker.state.redis, "sync:{user_id}", busy="skip", ttl=5, prefix=PREFIX
)
async def sync_user(user_id: int) -> str | None:
    """One sync of a user at a time across the worker processes; a duplicate that finds
    it running is skipped (returns ``None``)."""
    redis: Redis = broker.state.redis
    await redis.rpush(f"{PREFIX}entered:sync:{user_id}", os.getpid())
    if await redis.blpop([f"{PREFIX}go:sync:{user_id}"], timeout=_WAIT) is None:
        raise TimeoutError(f"no go-ahead within {_WAIT} s")
    return f"synced {user_id} in {os.getpid()}"
