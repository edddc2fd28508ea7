"""Redlock, experimental (issue 21, D): ``lease([r1, r2, r3], name)`` over three real,
independent servers; faults by SIGSTOP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

import asynclock
from asynclock import AcquireTimeout, LeaseEventKind, LockBusy, LockLost, LossReason
from asynclock.testing import RedisServer, available_engines, keys_left

pytestmark = pytest.mark.skipif(not available_engines(), reason="needs a server binary")


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    try:
        for _ in range(3):
            started.append(RedisServer().start())
        yield started
    finally:
        for server in started:
            server.resume()
            server.stop()


async def _clients(servers: list[RedisServer]) -> list[Redis]:
    return [Redis.from_url(server.url, socket_timeout=5.0) for server in servers]


@pytest.fixture
async def first(servers: list[RedisServer]) -> AsyncIterator[list[Redis]]:
    clients = await _clients(servers)
    yield clients
    for client in clients:
        await client.aclose()


@pytest.fixture
async def second(servers: list[RedisServer]) -> AsyncIterator[list[Redis]]:
    clients = await _clients(servers)
    yield clients
    for client in clients:
        await client.aclose()


async def _keys(clients: list[Redis], prefix: str) -> list[str]:
    return [key for client in clients for key in await keys_left(client, prefix)]


@pytest.mark.parametrize(
    ("servers_given", "options", "error"),
    [
        (2, {}, ValueError),
        (3, {"limit": 2}, ValueError),
        (3, {"shared": True}, ValueError),
        (3, {"fair": True}, ValueError),
        (3, {"min_replicas": 1}, ValueError),
        (3, {"max_hold": 5.0}, ValueError),
        (3, {"ttl": -1}, ValueError),
    ],
)
async def test_bad_redlock_arguments_are_refused_before_any_io(
    servers_given: int, options: dict[str, object], error: type
) -> None:
    clients = [Redis(host="127.0.0.1", port=1) for _ in range(servers_given)]  # (nothing there)
    with pytest.raises(error):
        asynclock.lease(clients, "x", **options)  # type: ignore[arg-type]
    with pytest.raises(error):
        await asynclock.acquire(clients, "x", **options)  # type: ignore[arg-type]
    same = clients[0]
    with pytest.raises(ValueError, match="distinct"):
        asynclock.lease([same, same, same], "x")
    for client in clients:
        await client.aclose()


async def test_held_on_every_server_and_exclusive(
    first: list[Redis], second: list[Redis], prefix: str
) -> None:
    """Taken on all three servers, renewed past its TTL, exclusive against another set
    of clients, given back everywhere; a blocking rival gets it after the release."""
    events: list[asynclock.LeaseEvent] = []
    async with asynclock.lease(
        first, "job", ttl=1.2, prefix=prefix, on_event=events.append
    ) as lock:
        assert lock.held_on == 3
        assert lock.servers == 3
        assert lock.state is asynclock.LeaseState.HELD
        assert lock.fencing_token > 0
        with pytest.raises(LockBusy):
            async with asynclock.lease(second, "job", blocking=False, prefix=prefix):
                pass
        await asyncio.sleep(1.5)  # (past the TTL: renewed on every server)
        assert lock.held_on == 3
        assert lock.time_left > 0.4
    assert lock.state is asynclock.LeaseState.RELEASED
    assert [e.kind for e in events] == [LeaseEventKind.ACQUIRED, LeaseEventKind.RELEASED]
    assert events[0].waited is not None
    assert events[1].held is not None
    assert events[1].held > 1.5
    assert await _keys(first, prefix) == []
    held = await asynclock.acquire(second, "job", ttl=2.0, blocking_timeout=2.0, prefix=prefix)
    with pytest.raises(AcquireTimeout):
        await asynclock.acquire(first, "job", ttl=2.0, blocking_timeout=0.3, prefix=prefix)
    async with held.guard():
        assert await held.is_held()
    await held.release()
    assert await _keys(first, prefix) == []


async def test_one_server_stopped_still_acquires_and_holds(
    servers: list[RedisServer], first: list[Redis], prefix: str
) -> None:
    """One of three servers stopped (SIGSTOP): acquired on the other two within a third
    of the TTL, held past the TTL, given back."""
    servers[2].pause()
    started = time.monotonic()
    async with asynclock.lease(first, "job", ttl=1.5, prefix=prefix) as lock:
        assert time.monotonic() - started < 1.5
        assert lock.held_on == 2
        await asyncio.sleep(2.0)
        assert lock.state is asynclock.LeaseState.HELD
    servers[2].resume()
    assert await _keys(first[:2], prefix) == []


async def test_two_servers_stopped_cancel_the_holder_and_nobody_gets_in(
    servers: list[RedisServer], first: list[Redis], second: list[Redis], prefix: str
) -> None:
    """Two of three servers stop while the lock is held: the holder's block is
    cancelled (LockLost(deadline)) before its validity ends, and a rival trying
    meanwhile never gets a majority; once the servers are back (and the keys expired),
    the rival gets in."""
    ttl = 1.2
    rival_in: float | None = None
    holder_out = 0.0

    async def rival() -> None:
        nonlocal rival_in
        async with asynclock.lease(second, "job", ttl=ttl, prefix=prefix, blocking_timeout=20):
            rival_in = time.monotonic()

    with pytest.raises(LockLost) as lost:
        async with asynclock.lease(first, "job", ttl=ttl, prefix=prefix) as lock:
            valid_until = lock.safe_until
            servers[1].pause()
            servers[2].pause()
            rival_task = asyncio.create_task(rival())
            try:
                await anyio.sleep_forever()
            finally:
                holder_out = time.monotonic()
                cancelled_at = asyncio.get_running_loop().time()
    assert lost.value.reason is LossReason.DEADLINE
    assert cancelled_at <= valid_until + 0.5
    await asyncio.sleep(0.5)
    assert rival_in is None  # (no majority: two servers are stopped)
    servers[1].resume()
    servers[2].resume()
    async with asyncio.timeout(20):
        await rival_task
    assert rival_in is not None
    assert rival_in >= holder_out


async def test_cancelled_while_acquiring_leaves_nothing(
    servers: list[RedisServer], first: list[Redis], prefix: str
) -> None:
    """Cancelled while one server does not answer: once the cancellation has
    propagated, nothing is left on the others (given back before it propagates, not in
    the background: a program that ends right after leaves no key behind)."""
    servers[2].pause()
    task = asyncio.create_task(asynclock.acquire(first, "job", ttl=3.0, prefix=prefix))
    async with asyncio.timeout(5):  # the two answering servers granted; the third hangs
        while len(await _keys(first[:2], prefix)) < 2:  # noqa: ASYNC110 (the servers' state)
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _keys(first[:2], prefix) == []
    servers[2].resume()


async def test_counted_once_by_the_process_hooks_and_not_reentrant(
    first: list[Redis], prefix: str
) -> None:
    """The process's metrics hooks count a Redlock as one lock (its servers' leases
    report to it alone): one acquisition, one hold time. A task in a block or guard of
    it that takes it again is refused at once (it would wait for itself); a guard of a
    lock given back is refused."""
    from prometheus_client import CollectorRegistry, generate_latest

    from asynclock import instrumentation

    registry = CollectorRegistry()
    instrumentation.set_hooks([instrumentation.PrometheusHook(registry=registry)])
    try:
        async with asynclock.lease(first, "once", ttl=1.2, prefix=prefix):
            with pytest.raises(RuntimeError, match="already held by this task"):
                async with asynclock.lease(first, "once", prefix=prefix):
                    pass
        text = generate_latest(registry).decode()
        assert 'asynclock_lease_acquisitions_total{outcome="acquired"} 1.0' in text
        assert "asynclock_lease_hold_seconds_count 1.0" in text
    finally:
        instrumentation.set_hooks([])
    lock = await asynclock.acquire(first, "guarded", ttl=1.2, prefix=prefix)
    async with lock.guard():
        with pytest.raises(RuntimeError, match="already held by this task"):
            await asynclock.acquire(first, "guarded", prefix=prefix)
        with pytest.raises(RuntimeError, match="guard"):
            await lock.release()
    await lock.release()
    with pytest.raises(RuntimeError, match="released"):
        async with lock.guard():
            pass
    assert await _keys(first, prefix) == []


async def test_a_blocking_redlock_keeps_its_timeout_and_does_not_wait_for_nothing(
    servers: list[RedisServer], first: list[Redis], prefix: str
) -> None:
    """Two servers stopped and a 30 s TTL: a blocking attempt with blocking_timeout=0.5
    times out near 0.5 s (a round of attempts would take ttl/3 = 10 s), reported as an
    acquire_failed event (timeout). With every server unreachable it raises the
    connection error at once (as a single server's lease does) instead of waiting out
    its timeout."""
    events: list[asynclock.LeaseEvent] = []
    servers[1].pause()
    servers[2].pause()
    try:
        started = time.monotonic()
        with pytest.raises(AcquireTimeout):
            await asynclock.acquire(
                first, "slow", ttl=30.0, blocking_timeout=0.5, prefix=prefix, on_event=events.append
            )
        assert time.monotonic() - started < 3.0
        assert [(e.kind, e.detail) for e in events] == [(LeaseEventKind.ACQUIRE_FAILED, "timeout")]
    finally:
        servers[1].resume()
        servers[2].resume()
    # (nothing listens; no retries of redis-py's, which would outlast a round)
    nowhere = [Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0)) for _ in range(3)]
    try:
        started = time.monotonic()
        with pytest.raises(RedisConnectionError):
            await asynclock.acquire(nowhere, "x", blocking_timeout=20.0, prefix=prefix)
        assert time.monotonic() - started < 5.0
    finally:
        for client in nowhere:
            await client.aclose()
    assert await _keys(first, prefix) == []


async def test_a_redlock_answers_what_any_lease_answers(first: list[Redis], prefix: str) -> None:
    """key (the same on every server), each server's token, extend() on every server,
    and is_held(verify=True): one key taken away leaves the majority; a second loses
    the lock, and verify says so (cancelling its guard)."""
    lock = await asynclock.acquire(first, "job", ttl=3.0, prefix=prefix)
    assert lock.key == f"{prefix}{{job}}"
    assert len(lock.tokens) == 3
    for client, token in zip(first, lock.tokens, strict=True):
        value = await client.get(lock.key)
        assert value is not None
        assert value.decode().startswith(token + ":")
    before = lock.time_left
    await asyncio.sleep(0.3)
    await lock.extend()
    assert lock.time_left > before - 0.2  # (renewed on every server: counted from now)
    assert await lock.is_held(verify=True)
    await first[0].delete(lock.key)
    assert await lock.is_held(verify=True)  # (two of three still hold it)
    assert lock.held_on == 2
    await first[1].delete(lock.key)
    cancelled = asyncio.Event()

    async def guarded() -> None:
        async with lock.guard():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

    task = asyncio.create_task(guarded())
    await asyncio.sleep(0)
    assert not await lock.is_held(verify=True)
    with pytest.raises(LockLost):
        await task
    assert cancelled.is_set()
    assert lock.state is asynclock.LeaseState.LOST
    with pytest.raises(LockLost):
        await lock.extend()
    with pytest.raises(LockLost):
        await lock.release()
    assert await _keys(first, prefix) == []
