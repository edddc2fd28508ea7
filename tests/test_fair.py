"""Fair locks: ``lease(redis, name, fair=True)`` is taken in arrival order (issue 20, B).

Waiters queue in Redis by the server's clock; across clients and processes they enter
in the order they came, one that gives up leaves at once, and one that dies holds the
queue up for a bounded time only.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import wait_until
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

import asynclock
from asynclock import AcquireTimeout, LimitConflict, LockBusy
from asynclock._session._connections import companion_for
from asynclock.testing import FaultProxy, RedisServer

ROOT = Path(__file__).resolve().parent.parent


def _queue(prefix: str, name: str) -> str:
    return f"{prefix}{{{name}}}:queue"


async def test_waiters_of_many_clients_enter_in_arrival_order(
    redis_server: object, make_client: Callable[..., Redis], prefix: str
) -> None:
    """8 waiters over 4 clients (one with str replies), each queued before the next
    comes: once the holder releases, they enter in exactly that order."""
    clients = [make_client(), make_client(decode_responses=True), make_client(), make_client()]
    observer = make_client()
    holder = await asynclock.acquire(clients[0], "line", ttl=5, fair=True, prefix=prefix)
    order: list[int] = []

    async def waiter(index: int) -> None:
        async with asynclock.lease(clients[index % 4], "line", ttl=5, fair=True, prefix=prefix):
            order.append(index)
            await asyncio.sleep(0.005)

    tasks = []
    for index in range(8):
        tasks.append(asyncio.create_task(waiter(index)))
        count = index + 1
        await wait_until(
            lambda count=count: _counted(observer, _queue(prefix, "line"), count), what="queued"
        )
    await holder.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert order == list(range(8))
    assert not await observer.exists(_queue(prefix, "line"))  # (nobody left in it)


async def _counted(client: Redis, key: str, count: int) -> bool:
    return bool(await client.zcard(key) >= count)


_WAITER = """
import asyncio, sys
from redis.asyncio import Redis
import asynclock

async def main(url, prefix, me):
    redis = Redis.from_url(url)
    async with asynclock.lease(redis, "procs", ttl=5, fair=True, prefix=prefix):
        await redis.rpush(prefix + "entered", me)
    await redis.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


async def test_processes_enter_in_arrival_order(
    client: Redis, redis_server: object, prefix: str
) -> None:
    """Four processes queue one after another behind our holder: they enter in the
    order they queued."""
    url = redis_server.url  # type: ignore[attr-defined]
    holder = await asynclock.acquire(client, "procs", ttl=5, fair=True, prefix=prefix)
    procs = []
    try:
        for index in range(4):
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable, "-c", _WAITER, url, prefix, str(index), env=_env()
                )
            )
            count = index + 1
            await wait_until(
                lambda count=count: _counted(client, _queue(prefix, "procs"), count),
                limit=30,
                what="queued",
            )
        await holder.release()
        codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), 60)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert codes == [0, 0, 0, 0]
    entered = [int(x) for x in await client.lrange(prefix + "entered", 0, -1)]
    assert entered == [0, 1, 2, 3]


async def test_a_waiter_that_gives_up_leaves_the_queue_at_once(client: Redis, prefix: str) -> None:
    """The first in the queue is cancelled, the second times out: the third enters as
    soon as the holder releases, and the queue holds nobody who left."""
    holder = await asynclock.acquire(client, "leave", ttl=5, fair=True, prefix=prefix)
    queue = _queue(prefix, "leave")

    async def wait(blocking_timeout: float | None = None) -> None:
        async with asynclock.lease(
            client, "leave", ttl=5, fair=True, prefix=prefix, blocking_timeout=blocking_timeout
        ):
            pass

    first = asyncio.create_task(wait())
    await wait_until(lambda: _counted(client, queue, 1), what="first queued")
    second = asyncio.create_task(wait(blocking_timeout=0.5))
    await wait_until(lambda: _counted(client, queue, 2), what="second queued")
    third = asyncio.create_task(wait())
    await wait_until(lambda: _counted(client, queue, 3), what="third queued")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(AcquireTimeout):
        await second
    assert await client.zcard(queue) == 1  # (only the third)
    released = time.monotonic()
    await holder.release()
    await asyncio.wait_for(third, 5)
    assert time.monotonic() - released < 0.5


_DOOMED = """
import asyncio, sys
from redis.asyncio import Redis
import asynclock

async def main(url, prefix):
    redis = Redis.from_url(url)
    async with asynclock.lease(redis, "dead", ttl=5, fair=True, prefix=prefix):
        pass

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_dead_waiter_holds_the_queue_up_for_a_bounded_time(
    client: Redis, redis_server: object, prefix: str
) -> None:
    """A process queued first is SIGKILLed; our waiter, queued behind it, enters within
    FAIR_PATIENCE (2 s) plus a retry period of the holder's release, not never."""
    url = redis_server.url  # type: ignore[attr-defined]
    holder = await asynclock.acquire(client, "dead", ttl=5, fair=True, prefix=prefix)
    queue = _queue(prefix, "dead")
    doomed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _DOOMED, url, prefix, env=_env()
    )
    try:
        await wait_until(lambda: _counted(client, queue, 1), limit=30, what="doomed queued")
        doomed.send_signal(signal.SIGKILL)
        await doomed.wait()
        ours = asyncio.create_task(
            asynclock.acquire(client, "dead", ttl=5, fair=True, prefix=prefix)
        )
        await wait_until(lambda: _counted(client, queue, 2), what="ours queued")
        released = time.monotonic()
        await holder.release()
        lease = await asyncio.wait_for(ours, 10)
        waited = time.monotonic() - released
        await lease.release()
    finally:
        if doomed.returncode is None:
            doomed.kill()
            await doomed.wait()
    assert waited < 2.0 + 1.0 + 1.0, waited  # FAIR_PATIENCE, a retry period, slack


async def test_no_waiting_for_a_held_fair_lock(client: Redis, prefix: str) -> None:
    async with asynclock.lease(client, "busy", ttl=5, fair=True, prefix=prefix):
        with pytest.raises(LockBusy) as busy:  # (another task: another contender)
            await asyncio.create_task(
                asynclock.acquire(client, "busy", fair=True, blocking=False, prefix=prefix)
            )
    assert busy.value.retry_after is not None
    assert not await client.exists(_queue(prefix, "busy"))  # (a single try never queues)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"fair": "yes"}, TypeError, "fair must be a bool"),
        ({"fair": 1}, TypeError, "fair must be a bool"),
        ({"fair": True, "limit": 2}, ValueError, "cannot be given with limit"),
    ],
)
async def test_bad_fair_arguments_are_refused_before_any_io(
    kwargs: dict[str, object], error: type[Exception], text: str
) -> None:
    nowhere = Redis(host="127.0.0.1", port=1)  # (nothing listens there)
    with pytest.raises(error, match=text):
        asynclock.lease(nowhere, "x", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match=text):
        await asynclock.acquire(nowhere, "x", **kwargs)  # type: ignore[arg-type]
    await nowhere.aclose()


async def test_a_waiter_refused_for_a_semaphore_of_the_name_leaves_the_queue(
    client: Redis, prefix: str
) -> None:
    """A fair waiter queued behind a holder; the lock freed and a permit of a semaphore
    of the name taken before the waiter's next attempt: that attempt is refused
    (LimitConflict), and the waiter, giving up, leaves the queue at once (it does not
    hold up those queued behind it until its liveness runs out)."""
    key, queue = prefix + "{conflict}", _queue(prefix, "conflict")
    await client.set(key, "someone:1", px=5000)  # (a holder that releases unannounced)
    waiter = asyncio.create_task(
        asynclock.acquire(client, "conflict", ttl=5, fair=True, prefix=prefix)
    )
    await wait_until(lambda: _counted(client, queue, 1), what="queued")
    # Right after one of the waiter's attempts (its liveness renewed), so that its next
    # one (FAIR_PATIENCE / 2 later) cannot come between the delete and the permit.
    alive = queue + ":alive"
    before = await client.hgetall(alive)

    async def attempted() -> bool:
        return bool(await client.hgetall(alive) != before)

    await wait_until(attempted, what="the waiter's next attempt")
    await client.delete(key)
    permit = await asynclock.acquire(client, "conflict", limit=2, prefix=prefix)
    try:
        with pytest.raises(LimitConflict):
            await asyncio.wait_for(waiter, 5)
        assert await client.zcard(queue) == 0
    finally:
        await permit.release()


async def test_a_slow_subscription_does_not_let_a_live_waiter_lapse(
    redis_server: object, make_client: Callable[..., Redis], prefix: str
) -> None:
    """A waiter whose subscription to the lock's releases takes its full bound (up to
    a second to connect, one to be confirmed) and is not confirmed: it counts the pause
    before its next attempt from its last reply, not from the end of the subscription,
    so it tries at least every FAIR_PATIENCE / 2 and keeps its place. A waiter queued
    behind it, trying as the holder's key expires, does not take the lock ahead of it."""
    first_client, second_client, observer = make_client(), make_client(), make_client()
    key, queue = prefix + "{lapse}", _queue(prefix, "lapse")
    room = companion_for(first_client).room

    async def slow_subscription(channel: str, deadline: float | None = None) -> bool:
        await asyncio.sleep(1.9)  # (within its bounds: connect, then confirmation)
        return False

    room.subscribe = slow_subscription  # type: ignore[method-assign]
    await observer.set(key, "someone:1", px=2300)  # (expires unannounced)
    order: list[str] = []

    async def waiter(client: Redis, me: str) -> None:
        async with asynclock.lease(client, "lapse", ttl=5, fair=True, prefix=prefix):
            order.append(me)

    first = asyncio.create_task(waiter(first_client, "first"))
    await wait_until(lambda: _counted(observer, queue, 1), what="first queued")
    second = asyncio.create_task(waiter(second_client, "second"))
    await wait_until(lambda: _counted(observer, queue, 2), what="second queued")
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert order == ["first", "second"]


async def test_a_waiter_cut_off_for_a_moment_leaves_the_queue_once_redis_answers(
    private_server: RedisServer, prefix: str
) -> None:
    """A fair waiter's connections are reset and new ones refused for half a second: its
    attempt fails and the error reaches its caller only once its place in the queue is
    gone (the undo is tried again until Redis answers, within ``release_timeout``), so
    the waiter queued behind it enters as soon as the holder releases, not after the
    dead place's FAIR_PATIENCE."""
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        cut = Redis.from_url(proxy.url)
        direct = Redis.from_url(private_server.url)
        queue = _queue(prefix, "blip")
        try:
            holder = await asynclock.acquire(direct, "blip", ttl=5, fair=True, prefix=prefix)
            first = asyncio.create_task(
                asynclock.acquire(cut, "blip", ttl=5, fair=True, prefix=prefix)
            )
            await wait_until(lambda: _counted(direct, queue, 1), what="first queued")
            second = asyncio.create_task(
                asynclock.acquire(direct, "blip", ttl=5, fair=True, prefix=prefix)
            )
            await wait_until(lambda: _counted(direct, queue, 2), what="second queued")
            proxy.refuse_new = True
            await proxy.reset_all()
            await asyncio.sleep(0.5)
            assert not first.done()  # (its undo waits for Redis)
            proxy.refuse_new = False
            with pytest.raises(RedisConnectionError):
                await asyncio.wait_for(first, 5)
            assert await direct.zcard(queue) == 1  # (only the second)
            released = time.monotonic()
            await holder.release()
            lease = await asyncio.wait_for(second, 5)
            assert time.monotonic() - released < 1.0
            await lease.release()
        finally:
            await cut.aclose()
            await direct.aclose()
