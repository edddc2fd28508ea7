"""Shared (read) leases: ``lease(redis, name, shared=True)`` (issue 20, B).

Shared holders overlap, an exclusive (plain) lease overlaps nobody, a waiting exclusive
lease gets in while shared ones keep coming, and a shared lease is renewed, lost and
released as any lease: across clients and processes, under SIGKILL and cancellation.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import wait_until
from redis.asyncio import Redis

import asynclock
from asynclock import LockBusy, LockLost, LossReason

ROOT = Path(__file__).resolve().parent.parent


async def test_shared_holders_overlap_and_an_exclusive_one_overlaps_nobody(
    redis_server: object, make_client: Callable[..., Redis], prefix: str
) -> None:
    """Readers and writers over three clients (one with str replies) for 2 s: readers
    were inside together, and no writer was ever inside with anyone."""
    clients = [make_client(), make_client(decode_responses=True), make_client()]
    readers = writers = 0
    most_readers = 0
    overlaps: list[str] = []
    rounds = {"reader": 0, "writer": 0}
    stop = time.monotonic() + 2.0
    rng = random.Random(7)

    async def reader(index: int) -> None:
        nonlocal readers, most_readers
        while time.monotonic() < stop:
            async with asynclock.lease(
                clients[index % 3], "doc", shared=True, ttl=2, prefix=prefix
            ):
                readers += 1
                most_readers = max(most_readers, readers)
                if writers:
                    overlaps.append("reader beside a writer")
                await asyncio.sleep(rng.uniform(0.005, 0.03))
                readers -= 1
                rounds["reader"] += 1

    async def writer(index: int) -> None:
        nonlocal writers
        while time.monotonic() < stop:
            async with asynclock.lease(clients[index % 3], "doc", ttl=2, prefix=prefix):
                writers += 1
                if writers > 1 or readers:
                    overlaps.append("writer beside another holder")
                await asyncio.sleep(rng.uniform(0.002, 0.01))
                writers -= 1
                rounds["writer"] += 1
            await asyncio.sleep(rng.uniform(0.01, 0.05))

    tasks = [reader(i) for i in range(6)] + [writer(i) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert not overlaps, overlaps[:3]
    assert most_readers >= 2
    assert rounds["reader"], rounds
    assert rounds["writer"], rounds
    assert not await clients[0].exists(prefix + "{doc}", prefix + "{doc}:readers")


async def test_a_waiting_writer_gets_in_while_readers_keep_coming(
    client: Redis, prefix: str
) -> None:
    """Readers arrive every 20 ms, each holding 150 ms, so the lock is never free of
    them; a writer that asks gets in within a bound, not never."""
    stop = asyncio.Event()

    async def read_once() -> None:
        async with asynclock.lease(client, "busy-doc", shared=True, ttl=2, prefix=prefix):
            await asyncio.sleep(0.15)

    async def readers() -> None:
        running: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            task = asyncio.create_task(read_once())
            running.add(task)
            task.add_done_callback(running.discard)
            await asyncio.sleep(0.02)
        await asyncio.gather(*running)

    arrivals = asyncio.create_task(readers())
    await asyncio.sleep(0.3)  # (readers overlap by now)
    asked = time.monotonic()
    async with asynclock.lease(client, "busy-doc", ttl=2, prefix=prefix):
        waited = time.monotonic() - asked
    stop.set()
    await asyncio.wait_for(arrivals, 10)
    assert waited < 1.5, waited  # (the readers inside drain in 0.15 s)


async def test_a_shared_lease_is_renewed_and_lost_as_any_lease(client: Redis, prefix: str) -> None:
    """ttl 0.3 s, held 1 s: renewed, still ours. Its hold (a member of the readers'
    set, beside another reader) removed from outside: its holder is cancelled with
    LockLost(not_owner), the other reader goes on."""
    async with asynclock.lease(client, "renewed", shared=True, ttl=0.3, prefix=prefix) as held:
        await asyncio.sleep(1.0)
        assert await held.is_held(verify=True)
    other_done = asyncio.Event()

    async def other() -> None:
        async with asynclock.lease(client, "lost", shared=True, ttl=0.6, prefix=prefix):
            await asyncio.sleep(1.2)
        other_done.set()

    task = asyncio.create_task(other())
    await asyncio.sleep(0.05)
    with pytest.raises(LockLost) as lost:
        async with asynclock.lease(client, "lost", shared=True, ttl=0.6, prefix=prefix) as held:
            await client.zrem(held.key, f"{held.token}:{held.fencing_token}")
            await asyncio.Event().wait()
    assert lost.value.reason is LossReason.NOT_OWNER
    await asyncio.wait_for(task, 10)
    assert other_done.is_set()


_READER = """
import asyncio, sys
from redis.asyncio import Redis
import asynclock

async def main(url, prefix):
    redis = Redis.from_url(url)
    async with asynclock.lease(redis, "killed", shared=True, ttl=1.0, prefix=prefix):
        print("held", flush=True)
        await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_sigkilled_readers_hold_ends_with_its_ttl(
    client: Redis, redis_server: object, prefix: str
) -> None:
    """A reader process is SIGKILLed: a writer waiting for the lock gets it once the
    reader's TTL (1 s) has run out."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    url = redis_server.url  # type: ignore[attr-defined]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _READER, url, prefix, stdout=asyncio.subprocess.PIPE, env=env
    )
    try:
        assert child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 30)).strip() == b"held"
        with pytest.raises(LockBusy):
            await asynclock.acquire(client, "killed", ttl=5, prefix=prefix, blocking=False)
        killed_at = time.monotonic()
        child.send_signal(signal.SIGKILL)
        async with asynclock.lease(client, "killed", ttl=5, prefix=prefix, blocking_timeout=10):
            waited = time.monotonic() - killed_at
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    assert 0.3 < waited < 4.0, waited


async def test_cancelled_shared_acquires_leave_nothing_behind(client: Redis, prefix: str) -> None:
    """Shared acquires cancelled at random moments, while a writer holds and after it
    left: afterwards no reader is left, and an exclusive lease is taken at once."""
    rng = random.Random(21)

    async def read() -> None:
        async with asynclock.lease(client, "cancel", shared=True, ttl=5, prefix=prefix):
            await asyncio.sleep(0.01)

    writer = await asynclock.acquire(client, "cancel", ttl=5, prefix=prefix)
    waiting = [asyncio.create_task(read()) for _ in range(4)]
    await asyncio.sleep(0.05)
    for task in waiting[:2]:
        task.cancel()
    await writer.release()
    for task in waiting[2:]:
        await asyncio.sleep(rng.uniform(0, 0.003))
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for _ in range(20):
        task = asyncio.create_task(read())
        await asyncio.sleep(rng.uniform(0, 0.002))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: _free(client, prefix), what="the readers gone")
    held = await asynclock.acquire(client, "cancel", ttl=5, prefix=prefix, blocking=False)
    await held.release()


async def _free(client: Redis, prefix: str) -> bool:
    return not await client.exists(prefix + "{cancel}", prefix + "{cancel}:readers")


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"shared": "yes"}, TypeError, "shared must be a bool"),
        ({"shared": True, "limit": 2}, ValueError, "cannot be given with limit"),
        ({"shared": True, "fair": True}, ValueError, "cannot be given with limit, fair"),
        ({"shared": True, "hold_at_least": 1.0}, ValueError, "hold_at_least"),
    ],
)
async def test_bad_shared_arguments_are_refused_before_any_io(
    kwargs: dict[str, object], error: type[Exception], text: str
) -> None:
    nowhere = Redis(host="127.0.0.1", port=1)  # (nothing listens there)
    with pytest.raises(error, match=text):
        asynclock.lease(nowhere, "x", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match=text):
        await asynclock.acquire(nowhere, "x", **kwargs)  # type: ignore[arg-type]
    await nowhere.aclose()


async def test_a_task_holding_a_shared_lease_cannot_take_the_lock_again(
    client: Redis, prefix: str
) -> None:
    """Not re-entrant, as any lease: exclusively it would wait for its own shared hold,
    and shared again it would wait behind a writer that waits for it."""
    async with asynclock.lease(client, "again", shared=True, ttl=5, prefix=prefix):
        with pytest.raises(RuntimeError, match="not re-entrant"):
            await asynclock.acquire(client, "again", ttl=5, prefix=prefix)
        with pytest.raises(RuntimeError, match="not re-entrant"):
            await asynclock.acquire(client, "again", shared=True, ttl=5, prefix=prefix)
