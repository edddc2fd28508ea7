"""The lane: connections borrowed from the caller's pool for acquires and releases."""

from __future__ import annotations

import asyncio
import copy
import functools
import gc
import math
import socket
import weakref
from typing import Any

import pytest
from helpers import server_checked, wait_until
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

import asynclock
from asynclock._redis._lane import _LINGER, Lane, not_sent
from asynclock._redis._scripts import pack
from asynclock._session._connections import companion_for
from asynclock.testing import RedisServer


def _in_use(client: Redis) -> list[Any]:
    # (the pool's own sets: _get_in_use_connections() and _get_free_connections() came
    # with redis-py 8)
    return list(client.connection_pool._in_use_connections)


def _free(client: Redis) -> list[Any]:
    return list(client.connection_pool._available_connections)


async def _warm(client: Redis, prefix: str) -> None:
    """One lease first, held until its one-time server check (the eviction policy,
    whether it renews by command) has finished: while that check runs, the end of a
    lease closes asynclock's side connections (the lane's included), and a check cut
    short that way is made again by the next lease."""
    async with asynclock.lease(client, "warm-up", ttl=5, prefix=prefix):
        await server_checked(client)


def _lane_held(client: Redis) -> list[Any]:
    """The connections the lane has borrowed (their socket timeout is set aside)."""
    return [c for c in _in_use(client) if c.socket_timeout is None]


async def test_lane_connections_go_back_to_the_pool_with_their_timeout(
    make_client: Any, redis_server: Any, prefix: str
):
    """After a lease the lane keeps a connection for the next one, with its socket timeout
    set aside; once unused for a while it gives it back, timeout restored."""
    client = make_client(socket_timeout=7.0)
    await _warm(client, prefix)
    async with asynclock.lease(client, "lane", ttl=5, prefix=prefix):
        pass
    assert len(_lane_held(client)) == 1
    started = asyncio.get_running_loop().time()
    await wait_until(lambda: _none_in_use(client), limit=_LINGER * 5, what="the give-back")
    assert asyncio.get_running_loop().time() - started >= _LINGER * 0.5
    free = _free(client)
    assert free
    assert all(c.socket_timeout == 7.0 for c in free)


async def _none_in_use(client: Redis) -> bool:
    return not _in_use(client)


async def test_lane_takes_at_most_a_quarter_of_a_small_pool(
    make_client: Any, redis_server: Any, prefix: str
):
    """With a pool of 16, a burst of leases leaves the lane holding at most 4 connections:
    the application keeps the rest of its pool."""
    client = make_client(max_connections=16)
    entered = 0
    all_in = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal entered
        async with asynclock.lease(client, f"small{i}", ttl=5, prefix=prefix, blocking=False):
            entered += 1
            if entered == 50:
                all_in.set()
            await all_in.wait()

    async with asyncio.timeout(20):
        await asyncio.gather(*(one(i) for i in range(50)))
    assert len(_lane_held(client)) <= 4
    assert await client.ping()  # the application still gets a connection


async def test_idle_lane_connection_killed_by_the_server_is_replaced(
    private_server: RedisServer, prefix: str
):
    """CLIENT KILL of every client connection between two leases: the next acquire and
    release still succeed (a dead lane connection is replaced, at most one retry)."""
    client = Redis.from_url(private_server.url)
    observer = Redis.from_url(private_server.url)
    try:
        await _warm(client, prefix)
        async with asynclock.lease(client, "killed", ttl=5, prefix=prefix):
            pass
        assert _lane_held(client)
        await observer.client_setname("observer")
        for entry in await observer.client_list():
            if entry.get("name") != "observer":
                await observer.client_kill_filter(_id=entry["id"])
        for _ in range(3):
            async with asynclock.lease(
                client, "killed", ttl=5, prefix=prefix, blocking_timeout=5
            ) as lock:
                assert await lock.is_held(verify=True)
            assert lock.state is asynclock.LeaseState.RELEASED
        assert await observer.exists(prefix + "{killed}") == 0
    finally:
        await client.aclose()
        await observer.aclose()


async def test_closing_the_client_closes_the_lane(private_server: RedisServer, prefix: str):
    """The lane's connections belong to the caller's pool: closing the client closes them
    (the suite turns an unclosed-connection ResourceWarning into an error)."""
    client = Redis.from_url(private_server.url)
    observer = Redis.from_url(private_server.url)
    try:
        await _warm(client, prefix)
        async with asynclock.lease(client, "closing", ttl=5, prefix=prefix):
            pass
        held = _lane_held(client)
        assert held
        assert all(c.is_connected for c in held)
        await client.aclose()
        assert not any(c.is_connected for c in held)
        assert companion_for(client).lane is not None
    finally:
        await observer.aclose()


async def test_a_pool_of_fewer_than_four_gets_no_lane(
    make_client: Any, redis_server: Any, prefix: str
):
    """The lane takes a quarter of the pool at most: from a pool of 3, none at all."""
    client = make_client(max_connections=3)
    for _ in range(3):
        async with asynclock.lease(client, "tiny", ttl=5, prefix=prefix):
            assert companion_for(client).lane._held == 0
    assert companion_for(client).lane._held == 0
    await wait_until(lambda: _none_in_use(client), what="every connection back in the pool")


async def test_lane_gives_its_connections_back_when_the_loop_shuts_down(
    make_client: Any, redis_server: Any, prefix: str
):
    """The lane's keeper task is cancelled when the event loop shuts down (asyncio.run
    cancels every task): it gives the borrowed connections back then, timeout restored,
    so a loop that ends right after a lease leaves nothing borrowed from the pool."""
    client = make_client(socket_timeout=7.0)
    await _warm(client, prefix)
    async with asynclock.lease(client, "short-lived", ttl=5, prefix=prefix):
        pass
    lane = companion_for(client).lane
    keeper = lane._keeper
    assert keeper is not None
    assert len(_lane_held(client)) == 1
    keeper.cancel()  # as asyncio.run does at shutdown
    await asyncio.wait([keeper])
    assert not _lane_held(client)
    free = _free(client)
    assert free
    assert all(c.socket_timeout == 7.0 for c in free)


def test_commands_are_packed_byte_for_byte_as_before():
    """Acquires and releases are packed by hiredis's C packer where it applies (UTF-8,
    strict): byte for byte what the Python packer makes, for every kind of argument
    asynclock sends. Another encoding, or another type, goes the Python way."""
    from redis.utils import HIREDIS_AVAILABLE

    from asynclock._redis._scripts import HANDOFF, _pack_command, _packed, pack

    # (redis[hiredis] is a dependency; the matrix's pure-Python leg uninstalls it, and
    # then every command goes the Python way, which must give the same bytes)
    assert (_pack_command is not None) == HIREDIS_AVAILABLE
    command = (
        "EVALSHA",
        HANDOFF.sha,
        2,
        "asynclock:{naïve 漢}",
        "asynclock:{naïve 漢}:fence",
        "0123456789abcdef" * 2 + ":1763961234567890",
        -1,
        10**20,
        repr(1763961234.5678912),
        0.1 + 0.2,
        b"\x00\xff",
        "",
    )
    python = b"".join(_packed([b"*%d\r\n" % len(command)], command, "utf-8", "strict"))
    assert pack(command) == python
    assert pack(list(command)) == python
    assert pack(("é",), "latin-1") == b"*1\r\n$1\r\n\xe9\r\n"
    assert pack(("x", True)) == b"*2\r\n$1\r\nx\r\n$4\r\nTrue\r\n"


async def test_a_client_dropped_after_its_leases_is_garbage_collected(
    redis_server: Any, prefix: str
):
    """asynclock keeps state beside each client (its companion: lane, waiting room and
    subscription, renewal pool); once the application has closed and dropped a client,
    nothing of asynclock's keeps it, or its pool, alive."""
    client = Redis.from_url(redis_server.url)
    async with asynclock.lease(client, "dropped", ttl=5, prefix=prefix):
        # a blocking wait meanwhile: the room subscribes, and the lease is handed over
        waiter = asyncio.create_task(_take(client, "dropped", prefix))
        await wait_until(functools.partial(_in_line, client, prefix + "{dropped}:released"))
    await waiter
    held = await asynclock.acquire(client, "dropped-too", ttl=0.3, prefix=prefix)
    await held.extend()  # (the renewal pool)
    await held.release()
    await client.aclose()
    gone, pool_gone = weakref.ref(client), weakref.ref(client.connection_pool)
    del client, held, waiter

    async def collected() -> bool:
        gc.collect()  # (the client and its companion refer to each other)
        return gone() is None and pool_gone() is None

    # The lane's keeper task holds the client until it has seen the lane unused a while.
    await wait_until(collected, limit=_LINGER * 5, what="the client's collection")


async def _take(client: Redis, name: str, prefix: str) -> None:
    async with asynclock.lease(client, name, ttl=5, prefix=prefix, blocking_timeout=5):
        pass


async def _in_line(client: Redis, channel: str) -> bool:
    return companion_for(client).room.waiting(channel) == 1


async def test_a_copy_of_a_client_has_a_companion_of_its_own(redis_server: Any, prefix: str):
    """copy.copy(client) carries the original's attributes, asynclock's companion among
    them; the copy's leases must go through its own connections, not the original's."""
    client = Redis.from_url(redis_server.url)
    async with asynclock.lease(client, "original", ttl=5, prefix=prefix):
        pass
    duplicate = copy.copy(client)
    duplicate.connection_pool = type(client.connection_pool).from_url(redis_server.url)
    try:
        async with asynclock.lease(duplicate, "copy", ttl=5, prefix=prefix):
            assert companion_for(duplicate).client is duplicate
            assert companion_for(client).client is client
    finally:
        await duplicate.aclose()
        await client.aclose()


async def _blocked(observer: Redis) -> int:
    """How many connections are blocked (in BLPOP) on the server."""
    return int((await observer.info("clients"))["blocked_clients"])


async def test_a_lane_exchange_past_its_deadline_raises_timeout_error(
    make_client: Any, redis_server: Any, prefix: str
):
    """The lane's bounds share one timer: two exchanges that get no answer before their
    deadlines (BLPOP on an empty list, for 3 s: a bound that never fired would fail the
    test, not hang it), with different deadlines, each end with TimeoutError at its own
    deadline, their task not left cancelled; the lane works afterwards."""
    client = make_client()
    lane = companion_for(client).lane
    loop = asyncio.get_running_loop()
    started = loop.time()
    ended: dict[float, float] = {}

    async def blocked(after: float) -> None:
        with pytest.raises(TimeoutError):
            await lane.call(pack(("BLPOP", prefix + "never", 3)), started + after)
        ended[after] = loop.time() - started
        current = asyncio.current_task()
        assert current is not None
        assert current.cancelling() == 0

    async with asyncio.TaskGroup() as group:
        group.create_task(blocked(0.4))
        group.create_task(blocked(0.1))
    assert 0.1 <= ended[0.1] < 0.4 <= ended[0.4] < 2.0
    assert await lane.call(pack(("PING",))) in (b"PONG", "PONG")


async def test_a_cancelled_lane_exchange_raises_cancelled_error(
    make_client: Any, redis_server: Any, prefix: str
):
    """A cancellation from outside during a bounded exchange comes out as itself, not as
    a TimeoutError, also when the bound comes in the same loop iteration."""
    client = make_client()
    observer = make_client()
    lane = companion_for(client).lane
    loop = asyncio.get_running_loop()
    for with_expiry in (False, True):
        # (no connection of an earlier round left blocked: the server counts it until it
        # has seen it close)
        await wait_until(lambda: _none_blocked(observer), what="no BLPOP left")
        exchange = asyncio.create_task(
            lane.call(pack(("BLPOP", prefix + "never", 5)), loop.time() + 30)
        )

        async def in_flight() -> bool:
            return len(lane._bounds) == 1 and await _blocked(observer) == 1

        await wait_until(in_flight, what="BLPOP in flight")
        exchange.cancel()
        if with_expiry:
            # Every bound comes now, as if the shared timer ran in this same iteration:
            # the task is cancelled once more (the timer it dropped is armed still, and
            # finds nothing when it runs).
            lane._expire(math.inf)
        with pytest.raises(asyncio.CancelledError):
            await exchange
        assert exchange.cancelled()


async def _none_blocked(observer: Redis) -> bool:
    return await _blocked(observer) == 0


async def test_a_lane_with_a_home_closes_connections_that_lead_elsewhere(
    redis_server: Any,
) -> None:
    """Once told where its connections must lead (a Sentinel client's primary, after a
    failover), the lane closes a connection that comes back from a call leading
    elsewhere (it reconnects at its next use); one leading there stays open."""
    client = Redis.from_url(redis_server.url)
    try:
        lane = companion_for(client).lane
        assert await lane.call(pack(("PING",))) == b"PONG"
        (connection,) = lane.idle_connections()
        assert connection.is_connected
        lane.home = ("127.0.0.1", 1)  # (somewhere else)
        assert await lane.call(pack(("PING",))) == b"PONG"
        assert lane.idle_connections() == [connection]
        assert not connection.is_connected
        lane.home = (connection.host, int(connection.port))
        assert await lane.call(pack(("PING",))) == b"PONG"  # (reconnected, stays)
        assert connection.is_connected
    finally:
        await client.aclose()


async def test_a_burst_of_releases_waits_in_the_lanes_line_and_frees_every_key(
    make_client: Any, redis_server: Any, prefix: str
):
    """5,000 leases released at once (``gather``, nothing gating them) are all released
    through the lane's connections alone: the calls that find them busy wait in line and
    go out in batches, where a connection each exhausted the caller's pool (and, with
    10,000 and the default ``release_timeout``, left most keys to their TTL; the bound is
    generous here, for a loaded machine)."""
    client = make_client()
    await _warm(client, prefix)
    gate = asyncio.Semaphore(64)

    async def take(i: int) -> asynclock.Lease:
        async with gate:
            return await asynclock.acquire(
                client, f"burst{i}", ttl=60, prefix=prefix, release_timeout=30
            )

    leases = await asyncio.gather(*(take(i) for i in range(5000)))
    pooled = len(_in_use(client)) + len(_free(client))
    async with asyncio.timeout(30):
        await asyncio.gather(*(lease.release() for lease in leases))
    assert all(lease.state is asynclock.LeaseState.RELEASED for lease in leases)
    left = [key async for key in client.scan_iter(match=prefix + "{burst*}")]
    assert left == []  # (the fence counters are "{burst<i>}:fence")
    assert len(_in_use(client)) + len(_free(client)) <= max(pooled, 16) + 1


async def test_calls_in_line_get_their_own_replies_and_a_call_that_left_is_not_sent(
    make_client: Any, redis_server: Any, prefix: str
):
    """With the lane's one connection busy (a pool of 4: a lane of 1), calls wait in line
    and are written together when it comes free, each answered with its own reply; a
    call cancelled while in line is never sent, and one that times out in line raises
    ``TimeoutError``."""
    client = make_client(max_connections=4)
    observer = make_client()
    lane = companion_for(client).lane
    loop = asyncio.get_running_loop()
    await wait_until(lambda: _none_blocked(observer), what="no BLPOP left")
    busy = asyncio.create_task(lane.call(pack(("BLPOP", prefix + "go", 10)), loop.time() + 20))
    await wait_until(lambda: _blocked_is(observer, 1), what="the lane's connection busy")
    echoes = [asyncio.create_task(lane.call(pack(("ECHO", f"e{i}")))) for i in range(100)]
    cancelled = asyncio.create_task(lane.call(pack(("INCR", prefix + "never-sent"))))
    with pytest.raises(TimeoutError):
        await lane.call(pack(("INCR", prefix + "never-sent")), loop.time() + 0.05)
    await asyncio.sleep(0)  # (the cancelled call is in line)
    assert len(lane._line) == 102
    cancelled.cancel()
    await observer.lpush(prefix + "go", "x")
    assert await busy == [(prefix + "go").encode(), b"x"]
    assert await asyncio.gather(*echoes) == [f"e{i}".encode() for i in range(100)]
    assert cancelled.cancelled()
    assert await observer.get(prefix + "never-sent") is None
    assert await lane.call(pack(("ECHO", "after"))) == b"after"
    assert len(_lane_held(client)) == 1


async def test_a_call_that_left_after_it_was_written_and_a_batch_cut_off(
    make_client: Any, redis_server: Any, prefix: str
):
    """A call whose caller leaves after its batch was written has its reply read and
    dropped (the next call gets its own); a batch whose connection is killed
    mid-exchange gives every call in it a connection error (the outcome unknown); the
    lane works after either."""
    client = make_client(max_connections=4)  # (a lane of one connection)
    observer = make_client()
    lane = companion_for(client).lane
    loop = asyncio.get_running_loop()

    async def batch_written(*commands: tuple[Any, ...]) -> list[asyncio.Task[object]]:
        """The commands' calls, written as one batch behind a call that held the lane's
        connection, the first of them blocked in BLPOP."""
        await wait_until(lambda: _none_blocked(observer), what="no BLPOP left")
        first = asyncio.create_task(lane.call(pack(("ECHO", "first"))))
        calls = [asyncio.create_task(lane.call(pack(c), loop.time() + 20)) for c in commands]
        assert await first == b"first"
        await wait_until(lambda: _blocked_is(observer, 1), what="the batch written")
        return calls

    blocked, left = await batch_written(("BLPOP", prefix + "go", 10), ("ECHO", "left"))
    left.cancel()
    await observer.lpush(prefix + "go", "x")
    assert await blocked == [(prefix + "go").encode(), b"x"]
    assert left.cancelled()
    assert await lane.call(pack(("ECHO", "after"))) == b"after"

    calls = await batch_written(("BLPOP", prefix + "never", 10), ("ECHO", "behind"))
    await _kill_blpop(observer)
    for call in calls:
        with pytest.raises((RedisConnectionError, OSError)):
            await call
    assert await lane.call(pack(("ECHO", "after"))) == b"after"


async def test_calls_in_line_are_answered_after_the_busy_exchange_fails(
    make_client: Any, redis_server: Any, prefix: str
):
    """The lane's only connection fails mid-exchange (killed) while calls wait in line
    with no deadline: the connection reconnects for them and they are answered, not
    left waiting for a connection that went back to the pool."""
    _, observer, busy, waiting = await _busy_with_line(make_client, prefix + "never", 5)
    await _kill_blpop(observer)
    with pytest.raises((RedisConnectionError, OSError)):
        await busy
    async with asyncio.timeout(10):
        assert await asyncio.gather(*waiting) == [f"w{i}".encode() for i in range(5)]


async def test_calls_in_line_are_not_left_waiting_when_the_lane_cannot_connect() -> None:
    """The lane's only connection cannot be made (nothing listens at the address) while
    calls with no deadline wait in line for it: they get a connection error marked as
    not sent at once, instead of waiting for a connection that never comes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # (closed again: nothing listens there)
    client = Redis(port=port, max_connections=4)  # (a lane of one connection)
    lane = companion_for(client).lane
    try:
        async with asyncio.timeout(10):
            results = await asyncio.gather(
                *(lane.call(pack(("ECHO", f"w{i}"))) for i in range(5)), return_exceptions=True
            )
        assert all(isinstance(result, (RedisConnectionError, OSError)) for result in results)
        assert all(not_sent(result) for result in results if isinstance(result, BaseException))
        assert not lane._line
    finally:
        await client.aclose()


async def test_at_loop_shutdown_the_calls_in_line_fail_as_not_sent(
    make_client: Any, redis_server: Any, prefix: str
):
    """When the event loop shuts down (the lane's keeper cancelled, as asyncio.run does)
    while calls wait in line, they get a connection error marked as not sent at once
    (no connection will serve them), and the busy connection goes back to the pool when
    its exchange ends."""
    lane, observer, busy, waiting = await _busy_with_line(make_client, prefix + "go", 3)
    keeper = lane._keeper
    assert keeper is not None
    keeper.cancel()
    await asyncio.wait([keeper])
    async with asyncio.timeout(5):
        results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(result, RedisConnectionError) and not_sent(result) for result in results)
    await observer.lpush(prefix + "go", "x")
    assert await busy == [(prefix + "go").encode(), b"x"]
    assert not _lane_held(lane.client)


async def _busy_with_line(
    make_client: Any, key: str, calls: int
) -> tuple[Lane, Redis, asyncio.Task[object], list[asyncio.Task[object]]]:
    """A lane of one connection (a client with a pool of 4), that connection busy in a
    BLPOP of ``key`` (10 s, no deadline), and ``calls`` ECHO calls (``w<i>``, no
    deadline) waiting in its line; with a client of its own to observe the server."""
    client = make_client(max_connections=4)
    observer = make_client()
    lane = companion_for(client).lane
    await wait_until(lambda: _none_blocked(observer), what="no BLPOP left")
    busy = asyncio.create_task(lane.call(pack(("BLPOP", key, 10))))
    await wait_until(lambda: _blocked_is(observer, 1), what="the lane's connection busy")
    waiting = [asyncio.create_task(lane.call(pack(("ECHO", f"w{i}")))) for i in range(calls)]
    await asyncio.sleep(0)
    assert len(lane._line) == calls
    return lane, observer, busy, waiting


async def _kill_blpop(observer: Redis) -> None:
    """Kill the connection blocked in BLPOP (``CLIENT KILL ID``)."""
    for entry in await observer.client_list():
        if entry.get("cmd") == "blpop":
            await observer.client_kill_filter(_id=entry["id"])


async def _blocked_is(observer: Redis, count: int) -> bool:
    return await _blocked(observer) == count
