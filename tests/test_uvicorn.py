"""asynclock.fastapi under a real ``uvicorn --workers 2`` (issue 30): the app of
``tests/uvicorn_app.py`` served on a free loopback port, asked through real HTTP (a new
connection per request, so each may land on either worker).

A request for a key that a request served by one worker holds answers 409 from the other
worker too (or waits for it, ``busy="wait"``); a lease taken away mid-request (its key
deleted) answers 503 and the endpoint is cancelled (it leaves a file saying so).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deployments import free_port, wait_until
from redis.asyncio import Redis

from asynclock.testing import ServerInfo

fastapi = pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
if "scope" not in inspect.signature(fastapi.Depends).parameters:
    pytest.skip("Depends(scope=...) came in FastAPI 0.121", allow_module_level=True)
pytest.importorskip("httpx")

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WAIT = 15.0  # seconds any one wait of these tests may take
STARTED = "Application startup complete"


@dataclass(frozen=True)
class Served:
    url: str
    prefix: str
    records: Path  # where a cancelled endpoint leaves its file
    workers: frozenset[int]  # the worker processes' pids


@pytest.fixture(scope="module")
def served(redis_server: ServerInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """uvicorn with 2 workers serving tests/uvicorn_app.py, both workers started; stopped
    (SIGTERM to the supervisor, then SIGKILL to its process group) on the way out."""
    records = tmp_path_factory.mktemp("uvicorn")
    log_path = records / "uvicorn.log"
    port = free_port()
    prefix = f"t:{uuid.uuid4().hex[:8]}:"
    env = os.environ | {
        "UVICORN_TEST_URL": redis_server.url,
        "UVICORN_TEST_PREFIX": prefix,
        "UVICORN_TEST_DIR": str(records),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "uvicorn", "tests.uvicorn_app:app", "--workers", "2"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--no-access-log"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_until(lambda: log_path.read_text().count(STARTED) == 2, "both workers started", WAIT)
        yield Served(f"http://127.0.0.1:{port}", prefix, records, _workers(log_path, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=WAIT)
        with contextlib.suppress(ProcessLookupError):  # (a worker left behind, if any)
            os.killpg(proc.pid, signal.SIGKILL)


def _workers(log_path: Path, supervisor: int) -> frozenset[int]:
    """The pids of the worker processes, from uvicorn's "Started server process [pid]"."""
    log = log_path.read_text()
    pids = {
        int(line.rsplit("[", 1)[1].rstrip("]"))
        for line in log.splitlines()
        if "Started server process" in line
    }
    pids.discard(supervisor)
    assert len(pids) == 2, log
    return frozenset(pids)


def http() -> httpx.AsyncClient:
    """A client opening a new connection for each request (either worker may take it)."""
    return httpx.AsyncClient(timeout=WAIT, limits=httpx.Limits(max_keepalive_connections=0))


async def entered(redis: Redis, served: Served, account: int) -> tuple[int, int]:
    """Wait for an endpoint of ``account`` to run: (its worker's pid, its fencing token)."""
    popped = await redis.blpop([f"{served.prefix}entered:{account}"], timeout=WAIT)
    assert popped is not None, f"no endpoint of account {account} ran within {WAIT:g} s"
    pid, token = popped[1].split()
    return int(pid), int(token)


async def release(redis: Redis, served: Served, account: int) -> None:
    """Let one endpoint of ``account`` finish."""
    await redis.rpush(f"{served.prefix}release:{account}", b"go")


async def test_busy_answers_409_from_both_workers(served: Served, redis: Redis) -> None:
    """One request holds the key; the same key asked again answers 409, from the holder's
    worker and from the other one (the lease is in Redis, not in a worker)."""
    async with http() as client:
        holder = asyncio.create_task(client.post(f"{served.url}/accounts/7/sync"))
        holder_pid, _ = await entered(redis, served, 7)
        assert holder_pid in served.workers
        answered_by: set[int] = set()
        for _ in range(60):  # (until both workers answered: the kernel picks one each time)
            busy = await client.post(f"{served.url}/accounts/7/sync")
            assert busy.status_code == 409, busy.text
            assert busy.headers["retry-after"] == "1"  # (ttl 0.5 s, rounded up)
            answered_by.add(int(busy.headers["x-worker"]))
            if answered_by == served.workers:
                break
        assert answered_by == served.workers
        await release(redis, served, 7)
        done = await asyncio.wait_for(holder, WAIT)
    assert done.status_code == 200, done.text
    assert done.json()["worker"] == holder_pid
    assert await redis.exists(f"{served.prefix}{{sync:7}}") == 0  # (given back)


async def test_the_wait_policy_waits_for_the_holder(served: Served, redis: Redis) -> None:
    """busy="wait": a second request enters only once the first has finished, with a
    greater fencing token."""
    async with http() as client:
        first = asyncio.create_task(client.post(f"{served.url}/accounts/5/queue"))
        _, first_token = await entered(redis, served, 5)
        second = asyncio.create_task(client.post(f"{served.url}/accounts/5/queue"))
        # (0.6 s: longer than the TTL, renewed meanwhile; the second must still wait)
        assert await redis.blpop([f"{served.prefix}entered:5"], timeout=0.6) is None
        await release(redis, served, 5)
        _, second_token = await entered(redis, served, 5)
        await release(redis, served, 5)
        answers = await asyncio.wait_for(asyncio.gather(first, second), WAIT)
    assert [answer.status_code for answer in answers] == [200, 200]
    assert second_token > first_token
    assert [answer.json()["token"] for answer in answers] == [first_token, second_token]


async def test_a_lost_lease_answers_503_and_cancels_the_endpoint(
    served: Served, redis: Redis
) -> None:
    async with http() as client:
        request = asyncio.create_task(client.post(f"{served.url}/accounts/3/sync"))
        pid, _ = await entered(redis, served, 3)
        assert await redis.delete(f"{served.prefix}{{sync:3}}") == 1  # (taken away)
        answer = await asyncio.wait_for(request, WAIT)
    assert answer.status_code == 503, answer.text
    assert "lost" in answer.json()["detail"]
    assert int(answer.headers["x-worker"]) == pid
    assert (served.records / "cancelled-3").read_text() == str(pid)  # (written by the endpoint)
