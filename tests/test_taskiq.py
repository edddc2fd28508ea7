"""The taskiq recipe of docs/frameworks.md against a real broker and worker (issue 30):
``taskiq worker`` with two processes on the test's server runs ``tests/taskiq_jobs.py``
(a ``ListQueueBroker`` with a Redis result backend); a task holding a lease through
``exclusive`` runs once when kicked twice at once, and again once it has ended.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from asynclock.testing import ServerInfo

pytest.importorskip("taskiq_redis", reason="taskiq-redis is installed by the test-taskiq extra")

ROOT = Path(__file__).resolve().parent.parent
WAIT = 20.0  # seconds any one wait of this test may take


@contextmanager
def worker(url: str, prefix: str, log: Path) -> Iterator[None]:
    """``taskiq worker tests.taskiq_jobs:broker --workers 2`` (its own process group),
    stopped with SIGTERM, then SIGKILL, on the way out."""
    env = os.environ | {
        "TASKIQ_TEST_URL": url,
        "TASKIQ_TEST_PREFIX": prefix,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "taskiq",
                "worker",
                "tests.taskiq_jobs:broker",
                "--workers",
                "2",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


async def pop(redis: Redis, key: str, log: Path) -> bytes:
    """The next item pushed to ``key``, waited for at most WAIT seconds."""
    got = await redis.blpop([key], timeout=WAIT)
    if got is None:
        pytest.fail(f"nothing pushed to {key} within {WAIT} s; the worker's log:\n{tail(log)}")
    return bytes(got[1])


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def test_a_task_kicked_twice_at_once_runs_once(
    redis_server: ServerInfo, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKIQ_TEST_URL", redis_server.url)
    monkeypatch.setenv("TASKIQ_TEST_PREFIX", prefix)
    sys.modules.pop("tests.taskiq_jobs", None)  # (its broker is made from the environment)
    taskiq_jobs = importlib.import_module("tests.taskiq_jobs")

    log = tmp_path / "worker.log"
    redis = Redis.from_url(redis_server.url)
    await taskiq_jobs.broker.startup()
    try:
        with worker(redis_server.url, prefix, log):
            pids = {await pop(redis, f"{prefix}started", log) for _ in range(2)}
            assert len(pids) == 2  # (two worker processes)
            tasks = [await taskiq_jobs.sync_user.kiq(7) for _ in range(2)]
            ran_in = await pop(redis, f"{prefix}entered:sync:7", log)
            results: dict[asyncio.Task[Any], Any] = {
                asyncio.create_task(task.wait_result(timeout=WAIT)): task for task in tasks
            }
            done, pending = await asyncio.wait(
                results, timeout=WAIT, return_when=asyncio.FIRST_COMPLETED
            )
            assert len(done) == 1, f"neither task ended while the other ran:\n{tail(log)}"
            skipped = done.pop().result()
            assert not skipped.is_err, skipped.error
            assert skipped.return_value is None  # (the other held the key)
            await redis.rpush(f"{prefix}go:sync:7", "go")
            ran = await pending.pop()
            assert not ran.is_err, ran.error
            assert ran.return_value == f"synced 7 in {ran_in.decode()}"
            assert await redis.llen(f"{prefix}entered:sync:7") == 0  # (entered once only)

            again = await taskiq_jobs.sync_user.kiq(7)  # (the key is free again)
            await pop(redis, f"{prefix}entered:sync:7", log)
            await redis.rpush(f"{prefix}go:sync:7", "go")
            result = await again.wait_result(timeout=WAIT)
            assert not result.is_err, result.error
            assert result.return_value is not None
    finally:
        await taskiq_jobs.broker.shutdown()
        await redis.aclose()
