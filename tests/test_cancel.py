"""Cancelling an acquire at any point leaves no key behind (issue 2, point 10)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from helpers import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

import asynclock
from asynclock._base._shield import close_fully
from asynclock._session._connections import companion_for


def test_cancel_after_any_number_of_loop_steps_leaves_no_key(redis_server: Any, prefix: str):
    """10: hundreds of acquires, each cancelled after a random number of loop steps.

    Scenarios: a free lock (blocking and not), and a lock held by another client (the
    contender waits in line). Whatever the step, afterwards the free lock's key is
    absent, the held lock's key still holds the holder's value, and no waiter is left in
    the local line. Cancellations land both during the acquire and inside the body.
    """
    loop = asyncio.new_event_loop()
    outcomes = {"before": 0, "inside": 0}

    client = Redis.from_url(redis_server.url)
    holder_client = Redis.from_url(redis_server.url)
    stop = loop.run_until_complete(_make_event())
    ready: asyncio.Future[asynclock.Lease] = loop.create_future()

    async def hold() -> None:
        async with asynclock.lease(holder_client, "held", ttl=60, prefix=prefix) as lock:
            ready.set_result(lock)
            await stop.wait()

    holder_task = loop.create_task(hold())
    holder = loop.run_until_complete(ready)
    holder_value = f"{holder.token}:{holder.fencing_token}".encode()

    async def one_case(steps: int, scenario: str) -> None:
        name = "held" if scenario == "held" else "free"
        entered = asyncio.Event()

        async def contender() -> None:
            async with asynclock.lease(
                client, name, ttl=30, prefix=prefix, blocking=scenario != "free-nonblocking"
            ):
                entered.set()
                await asyncio.Event().wait()

        task = loop.create_task(contender())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, asynclock.LockBusy):
            await task
        outcomes["inside" if entered.is_set() else "before"] += 1
        assert await client.get(prefix + "{free}") is None
        assert await client.get(prefix + "{held}") == holder_value
        assert not companion_for(client).room._lines

    @settings(
        max_examples=300,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        steps=st.integers(min_value=0, max_value=300),
        scenario=st.sampled_from(["free", "free-nonblocking", "held"]),
    )
    def run(steps: int, scenario: str) -> None:
        loop.run_until_complete(one_case(steps, scenario))

    try:
        run()

        async def settle_and_check() -> None:
            # An abandoned attempt may still be on its way to the server; give it time to
            # land, then check that its tombstone kept it from setting the key.
            await asyncio.sleep(0.3)
            assert await client.get(prefix + "{free}") is None
            assert await client.get(prefix + "{held}") == holder_value

        loop.run_until_complete(settle_and_check())
        assert outcomes["before"] >= 20, outcomes
        assert outcomes["inside"] >= 20, outcomes
    finally:

        async def teardown() -> None:
            stop.set()
            await holder_task
            await client.aclose()
            await holder_client.aclose()

        loop.run_until_complete(teardown())
        _shut_down(loop)


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


def test_cancel_around_a_local_handoff_leaves_no_key(redis_server: Any, prefix: str):
    """A waiter is cancelled after a random number of loop steps while the holder in the
    same client releases (and so hands it the lock) after another random number: the
    handoff may land before, during or after the waiter's cancellation. Afterwards the
    key is absent, no waiter is left in line, and nothing lands later.

    How many loop steps a handoff takes depends on how fast the server answers, so some
    cases cancel the waiter only once it has entered its block (``cancel_inside``): both
    outcomes then occur however loaded the machine is."""
    loop = asyncio.new_event_loop()
    client = Redis.from_url(redis_server.url)
    outcomes = {"before": 0, "inside": 0}
    key = prefix + "{relay}"

    async def one_case(release_after: int, cancel_after: int, cancel_inside: bool) -> None:
        holding = asyncio.Event()
        release = asyncio.Event()
        entered = asyncio.Event()

        async def holder() -> None:
            async with asynclock.lease(client, "relay", ttl=30, prefix=prefix):
                holding.set()
                await release.wait()

        async def waiter() -> None:
            async with asynclock.lease(client, "relay", ttl=30, prefix=prefix):
                entered.set()
                await asyncio.Event().wait()

        held = loop.create_task(holder())
        await holding.wait()
        waiting = loop.create_task(waiter())
        await wait_until(lambda: _queued(client, key), what="the waiter in line")
        for step in range(max(release_after, cancel_after) + 1):
            if step == release_after:
                release.set()
            if step == cancel_after and not cancel_inside:
                waiting.cancel()
            await asyncio.sleep(0)
        if cancel_inside:
            release.set()
            await asyncio.wait_for(entered.wait(), 10)
            waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await held
        outcomes["inside" if entered.is_set() else "before"] += 1
        assert await client.get(key) is None
        assert not companion_for(client).room._lines

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        release_after=st.integers(min_value=0, max_value=40),
        cancel_after=st.integers(min_value=0, max_value=60),
        cancel_inside=st.booleans(),
    )
    def run(release_after: int, cancel_after: int, cancel_inside: bool) -> None:
        loop.run_until_complete(one_case(release_after, cancel_after, cancel_inside))

    try:
        run()

        async def settle_and_check() -> None:
            await asyncio.sleep(0.3)  # anything still on its way has landed by now
            assert await client.get(key) is None

        loop.run_until_complete(settle_and_check())
        assert outcomes["before"] >= 10, outcomes
        assert outcomes["inside"] >= 10, outcomes
    finally:
        loop.run_until_complete(client.aclose())
        _shut_down(loop)


async def test_a_releaser_cancelled_while_it_lets_the_new_holder_run(
    client: Redis, prefix: str
) -> None:
    """After handing the lock to the next waiter of its client, the releaser yields once
    so that the new holder runs first. The new holder cancels the releaser right then
    (from inside its block, which runs during that yield): the releaser's exit raises
    CancelledError with its lease already RELEASED, the new holder holds the key and
    gives it back, and nothing is left."""
    key = prefix + "{yielding}"
    holding, release, done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    first: list[asynclock.Lease] = []

    async def releaser() -> None:
        async with asynclock.lease(client, "yielding", ttl=30, prefix=prefix) as lock:
            first.append(lock)
            holding.set()
            await release.wait()

    releasing = asyncio.create_task(releaser())
    await holding.wait()

    async def next_holder() -> int:
        async with asynclock.lease(client, "yielding", ttl=30, prefix=prefix) as lock:
            releasing.cancel()  # (the releaser is in its exit's yield, or past it)
            assert lock.state is asynclock.LeaseState.HELD
            value = await client.get(key)
            assert value is not None
            assert _text(value) == f"{lock.token}:{lock.fencing_token}"
            done.set()
            return lock.fencing_token

    waiting = asyncio.create_task(next_holder())
    await wait_until(lambda: _queued(client, key), what="the waiter in line")
    release.set()
    fence = await asyncio.wait_for(waiting, 10)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(releasing, 10)
    assert releasing.cancelled()
    assert done.is_set()
    assert fence > first[0].fencing_token
    assert first[0].state is asynclock.LeaseState.RELEASED
    assert first[0].lost_reason is None
    assert await client.exists(key) == 0
    assert not companion_for(client).room._lines


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _queued(redis: Redis, key: str) -> bool:
    return bool(companion_for(redis).room.waiting(key + ":released"))


def _shut_down(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left (asynclock's background tasks) and close, as asyncio.run does."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending))
    loop.close()


async def test_a_side_client_closed_under_a_cancellation_closes_its_connections(
    redis_server: Any,
):
    """asynclock's own clients (renewals, overflow) are closed with ``close_fully``: a
    cancellation of the closing task (``finish``'s bound on closing side connections,
    a shutdown) right after the close began does not leave their sockets open, to be
    warned about as unclosed when the dropped client is collected. (A bare
    ``client.aclose()`` cancelled there leaves them open: redis-py's pool gathers the
    disconnects in tasks of their own, cancelled before they run.)"""
    client = Redis.from_url(redis_server.url)
    await client.ping()
    (connection,) = client.connection_pool._available_connections
    closing = asyncio.create_task(close_fully(client.aclose()))
    await asyncio.sleep(0)  # (the close has begun)
    closing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    assert closing.cancelled()
    await wait_until(lambda: _closed(connection), what="the connection closed")


async def _closed(connection: Any) -> bool:
    return not connection.is_connected
