"""What a new user meets in the first hour (issue 17): re-entry in one task, one client on
several event loops, fast and true connection errors, ``blocking_timeout`` against a
silent server, foreign values in a lock's key, and arguments Redis cannot take."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

import asynclock
from asynclock.testing import RedisServer, ServerInfo

# -- re-entry in one task ----------------------------------------------------------------


@pytest.mark.parametrize("blocking", [True, False])
async def test_reentry_in_the_same_task_raises_at_once(
    client: Redis, prefix: str, blocking: bool
) -> None:
    """A task entering a lock it holds gets RuntimeError naming it, before any I/O,
    instead of waiting for itself forever (or a LockBusy that blames another owner)."""
    async with asynclock.lease(client, "job", ttl=5, prefix=prefix) as held:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"'job' is already held by this task"):
            async with asynclock.lease(client, "job", ttl=5, prefix=prefix, blocking=blocking):
                pass
        with pytest.raises(RuntimeError, match="already held by this task"):
            await asynclock.acquire(client, "job", ttl=5, prefix=prefix, blocking=blocking)
        assert time.monotonic() - started < 1.0
        assert await held.is_held(verify=True)
    async with asynclock.lease(client, "job", ttl=5, prefix=prefix):  # (left: free again)
        pass


async def test_other_tasks_still_wait(client: Redis, prefix: str) -> None:
    """Only the holding task is refused: another task of the process waits its turn, and
    gets the lock when the holder leaves."""
    entered = asyncio.Event()

    async def other() -> int:
        async with asynclock.lease(client, "shared", ttl=5, prefix=prefix) as lease:
            entered.set()
            return lease.fencing_token

    async with asynclock.lease(client, "shared", ttl=5, prefix=prefix) as held:
        task = asyncio.create_task(other())
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(entered.wait()), 0.3)
        assert not task.done()
    assert await asyncio.wait_for(task, 5) > held.fencing_token


async def test_reentry_through_a_guard(client: Redis, prefix: str) -> None:
    """A task inside a guard() of a lease of acquire() holds that lock: entering it
    again raises; outside the guard, the lease (held by no task) is simply busy."""
    held = await asynclock.acquire(client, "leader", ttl=5, prefix=prefix)
    try:
        async with held.guard(), held.guard():  # (nested guards count once each)
            with pytest.raises(RuntimeError, match="'leader' is already held by this task"):
                await asynclock.acquire(client, "leader", ttl=5, prefix=prefix)
        async with held.guard():
            with pytest.raises(RuntimeError, match="already held by this task"):
                async with asynclock.lease(client, "leader", ttl=5, prefix=prefix):
                    pass
        with pytest.raises(asynclock.LockBusy):
            await asynclock.acquire(client, "leader", ttl=5, prefix=prefix, blocking=False)
    finally:
        await held.release()


async def test_reentry_check_survives_a_cancelled_block(client: Redis, prefix: str) -> None:
    """A block cancelled from outside mid-way forgets that its task held the lock."""
    inside = asyncio.Event()

    async def hold() -> None:
        async with asynclock.lease(client, "cancelled", ttl=5, prefix=prefix):
            inside.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(hold())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asynclock.lease(client, "cancelled", ttl=5, prefix=prefix, blocking=False):
        pass


# -- one client, several event loops -------------------------------------------------------


def test_one_client_on_one_event_loop_after_another(
    redis_server: ServerInfo, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client made outside any loop (the usual pytest-asyncio set-up) works on every
    loop it is used on, a lease left held when its loop closed included, and no internal
    task ends with an exception nobody retrieved."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    client = Redis.from_url(redis_server.url)
    tokens: list[int] = []

    async def use(round_: int) -> None:
        async with asynclock.lease(client, "per-loop", ttl=5, prefix=prefix) as held:
            assert await held.is_held(verify=True)
            tokens.append(held.fencing_token)
        kept = await asynclock.acquire(client, f"kept-{round_}", ttl=5, prefix=prefix)
        waiter_in = asyncio.Event()

        async def waiter() -> None:
            async with asynclock.lease(client, "per-loop", ttl=5, prefix=prefix):
                waiter_in.set()

        async with asynclock.lease(client, "per-loop", ttl=5, prefix=prefix):
            task = asyncio.create_task(waiter())
            await asyncio.sleep(0.05)
        await asyncio.wait_for(task, 5)
        assert waiter_in.is_set()
        if round_ % 2:
            await kept.release()
        # (else the loop closes with the lease held: its leftovers must not reach the next)

    for round_ in range(4):
        asyncio.run(use(round_))
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 4
    unretrieved = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert unretrieved == []

    async def close() -> None:
        async with asynclock.lease(client, "per-loop", ttl=5, prefix=prefix):
            pass  # (first: redis-py's own commands fail once on a new loop, ours do not)
        for round_ in (0, 2):  # (left held by their closed loops: expire by their TTL)
            assert await client.exists(f"{prefix}{{kept-{round_}}}")
        await client.aclose()

    asyncio.run(close())


# -- failures as fast and as clear as the client's own -------------------------------------


def _retrying(url: str, **kwargs: Any) -> Redis:
    """A client whose own commands retry connection errors 3 times, 0.2 s apart."""
    return Redis.from_url(url, retry=Retry(ConstantBackoff(0.2), 3), **kwargs)


async def _elapsed(call: Callable[[], Any], error: type[BaseException]) -> float:
    started = time.monotonic()
    with pytest.raises(error):
        await call()
    return time.monotonic() - started


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_server_down_fails_like_the_client(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens: ConnectionError, in no more time than the client's own command
    takes to fail, and no warning about undoing an acquire that never reached Redis."""
    caplog.set_level(logging.WARNING, logger="asynclock")
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    client = _retrying(url)
    try:
        own = await _elapsed(client.ping, RedisConnectionError)

        async def enter() -> None:
            async with asynclock.lease(client, "down", ttl=5, prefix=prefix):
                pass

        ours = await _elapsed(enter, RedisConnectionError)
        ours_nb = await _elapsed(
            lambda: asynclock.acquire(client, "down", ttl=5, prefix=prefix, blocking=False),
            RedisConnectionError,
        )
    finally:
        await client.aclose()
    assert ours < own + 0.5, (own, ours)
    assert ours_nb < own + 0.5, (own, ours_nb)
    assert not [r for r in caplog.records if "undo" in r.getMessage()]


@pytest.mark.parametrize("password", ["wrong", None], ids=["wrong-password", "no-password"])
@pytest.mark.parametrize("protocol", [2, 3])
async def test_authentication_errors_come_out_as_the_clients(
    private_server: RedisServer,
    prefix: str,
    password: str | None,
    protocol: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wrong or missing password: AuthenticationError, as redis-py raises it, as fast
    as the client's own command, with no warning about an abandoned acquire."""
    caplog.set_level(logging.WARNING, logger="asynclock")
    private_server.command("CONFIG", "SET", "requirepass", "sekret")
    client = _retrying(private_server.url, password=password, protocol=protocol)
    try:
        own = await _elapsed(client.ping, AuthenticationError)

        async def enter() -> None:
            async with asynclock.lease(client, "auth", ttl=5, prefix=prefix):
                pass

        ours = await _elapsed(enter, AuthenticationError)
    finally:
        await client.aclose()
    assert ours < own + 0.5, (own, ours)
    assert not [r for r in caplog.records if "undo" in r.getMessage()]


# -- blocking_timeout against a server that stops answering --------------------------------


@pytest.mark.parametrize("socket_timeout", [5.0, None], ids=["socket-timeout", "no-timeout"])
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_blocking_timeout_bounds_a_silent_server(
    private_server: RedisServer, prefix: str, socket_timeout: float | None, warm: bool
) -> None:
    """A paused server: AcquireTimeout within blocking_timeout plus the documented grace
    (0.5 s) for undoing the attempt in flight, whatever the client's socket timeout."""
    client = Redis.from_url(
        private_server.url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
    )
    try:
        if warm:  # (connections already open: the attempt is sent, its reply never comes)
            async with asynclock.lease(client, "warm", ttl=5, prefix=prefix):
                pass
        private_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(asynclock.AcquireTimeout):
                await asynclock.acquire(
                    client, "silent", ttl=5, prefix=prefix, blocking_timeout=0.2
                )
            elapsed = time.monotonic() - started
        finally:
            private_server.resume()
        assert 0.2 <= elapsed < 0.2 + 0.5 + 0.5, elapsed
    finally:
        await client.aclose()


# -- a foreign value in a lock's key -------------------------------------------------------

_NOT_TEXT = b"\xff\xfe not utf-8 \x80"


@pytest.mark.parametrize("check", ["is_held", "extend", "release", "renewal"])
async def test_a_foreign_value_is_a_loss_in_every_decode_mode(
    client: Redis, make_client: Callable[..., Redis], prefix: str, check: str
) -> None:
    """The key overwritten with bytes that are not text: every check reports the loss
    (not_owner), through a client of either decode mode, never a UnicodeDecodeError."""
    raw = make_client(decode_responses=False)
    held = await asynclock.acquire(
        client, "foreign", ttl=5 if check != "renewal" else 0.3, prefix=prefix
    )
    await raw.set(held.key, _NOT_TEXT, px=60_000)
    if check == "is_held":
        assert not await held.is_held(verify=True)
    elif check == "extend":
        with pytest.raises(asynclock.LockLost):
            await held.extend()
    elif check == "renewal":
        for _ in range(100):
            if held.state is asynclock.LeaseState.LOST:
                break
            await asyncio.sleep(0.05)
    if check != "release":
        assert held.lost_reason is asynclock.LossReason.NOT_OWNER
    with pytest.raises(asynclock.LockLost) as lost:
        await held.release()
    assert lost.value.reason is asynclock.LossReason.NOT_OWNER
    assert await raw.get(held.key) == _NOT_TEXT  # (never deleted: not ours)


# -- arguments Redis cannot take -----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ttl": 1e15}, ValueError, "ttl must be at most"),
        ({"ttl": timedelta(days=10**8)}, ValueError, "ttl must be at most"),
        ({"fence_ttl": 1e15}, ValueError, "fence_ttl must be at most"),
        ({"ttl": 30, "fence_ttl": 10}, ValueError, "fence_ttl must be at least ttl"),
        ({"fence_ttl": "1h"}, TypeError, "fence_ttl must be a number of seconds or a timedelta"),
        ({"name": "}"}, ValueError, "name must not start with '}'"),
        ({"name": "}orders"}, ValueError, "hash tag"),
        ({"ttl": timedelta(milliseconds=5)}, ValueError, "ttl must be at least"),
        ({"blocking_timeout": timedelta(seconds=-1)}, ValueError, "blocking_timeout"),
    ],
)
async def test_arguments_redis_cannot_take_are_refused_before_io(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Refused at the call, naming the argument, before any I/O (nothing listens)."""
    client = Redis.from_url(f"redis://127.0.0.1:{_closed_port()}/0")
    arguments: dict[str, Any] = {"name": "x", **kwargs}
    name = arguments.pop("name")
    with pytest.raises(error, match=match):
        asynclock.lease(client, name, **arguments)
    with pytest.raises(error, match=match):
        await asynclock.acquire(client, name, **arguments)
    await client.aclose()


async def test_timedelta_is_taken_wherever_seconds_are(client: Redis, prefix: str) -> None:
    """ttl, blocking_timeout, release_timeout and fence_ttl take a timedelta."""
    async with asynclock.lease(
        client,
        "td",
        ttl=timedelta(seconds=7),
        blocking_timeout=timedelta(seconds=1),
        release_timeout=timedelta(milliseconds=1500),
        fence_ttl=timedelta(minutes=2),
        prefix=prefix,
    ) as held:
        assert held.ttl == 7.0
        assert 6_000 < await client.pttl(held.key) <= 7_000
        assert 110_000 < await client.pttl(held.key + ":fence") <= 120_000


def test_milliseconds_given_as_seconds_are_warned_about() -> None:
    """ttl=30000 is 8.3 hours: almost certainly 30 s in milliseconds; a warning says so,
    at the caller's line. A timedelta says it is meant, and is not warned about."""
    client = Redis()
    with pytest.warns(UserWarning, match=r"ttl=30000 is 8\.3 hours.*did you mean ttl=30") as w:
        asynclock.lease(client, "ms", ttl=30000)
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asynclock.lease(client, "ms", ttl=timedelta(seconds=30000))
        asynclock.lease(client, "ms", ttl=3600)


# -- the fencing counter's retention --------------------------------------------------------


@pytest.mark.parametrize(
    ("ttl", "fence_ttl", "expected"),
    [(10.0, None, 100.0), (1.0, None, 60.0), (5.0, 300.0, 300.0), (5.0, 5.0, 5.0)],
)
async def test_fence_counter_retention(
    client: Redis, prefix: str, ttl: float, fence_ttl: float | None, expected: float
) -> None:
    """The counter outlives the lease by fence_ttl seconds (default max(10 x ttl, 60))."""
    async with asynclock.lease(client, "kept", ttl=ttl, fence_ttl=fence_ttl, prefix=prefix) as h:
        left = await client.pttl(h.key + ":fence") / 1000
    assert expected - 1 < left <= expected


async def test_fence_counter_retention_on_a_handoff(client: Redis, prefix: str) -> None:
    """A lease handed to a waiter of the same client keeps the waiter's retention."""
    got: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def waiter() -> None:
        async with asynclock.lease(client, "handed", ttl=5, fence_ttl=400, prefix=prefix) as h:
            got.set_result(await client.pttl(h.key + ":fence") / 1000)

    async with asynclock.lease(client, "handed", ttl=5, prefix=prefix):
        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.1)
    await asyncio.wait_for(task, 5)
    assert 399 < got.result() <= 400
