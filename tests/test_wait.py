"""Blocking waits: woken by the release, with a PTTL fallback (issue 2, point 11)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest
from helpers import Monitor, commandstat, wait_until
from redis.asyncio import Redis

import asynclock
from asynclock._redis._scripts import ACQUIRE, HANDOFF, RELEASE
from asynclock._session._connections import companion_for
from asynclock.testing import RedisServer


async def _hold_until(
    redis: Redis, name: str, prefix: str, held: asyncio.Event, release: asyncio.Event
) -> None:
    async with asynclock.lease(redis, name, ttl=30, prefix=prefix):
        held.set()
        await release.wait()


async def _held_by(
    redis: Redis, name: str, prefix: str
) -> tuple[asyncio.Task[None], asyncio.Event]:
    """``name`` held by ``redis`` (a 30 s lease) in a task, until the event is set."""
    held, release = asyncio.Event(), asyncio.Event()
    holding = asyncio.create_task(_hold_until(redis, name, prefix, held, release))
    await held.wait()
    return holding, release


async def _waiting_for(redis: Redis, name: str, prefix: str) -> asyncio.Task[float]:
    """A blocking acquire of ``name`` (10 s at most) in a task, once it is subscribed to
    the lock's releases; the task answers when it got in."""
    waiting = asyncio.create_task(_acquire_and_time(redis, name, prefix, blocking_timeout=10))
    await wait_until(lambda: _subscribed(redis, name, prefix), what=f"a waiter for {name}")
    return waiting


async def _woken_after(
    holding: asyncio.Task[None], release: asyncio.Event, waiting: asyncio.Task[float]
) -> float:
    """Seconds from the holder's release to the waiter in."""
    released_at = time.monotonic()
    release.set()
    await holding
    return await waiting - released_at


async def test_release_wakes_a_waiter_in_another_client(
    client: Redis, make_client: Any, redis_server: Any, prefix: str
):
    """11: a waiter is woken by the release notification, not by the holder's 30 s TTL."""
    holding, release = await _held_by(make_client(redis_server.url), "job", prefix)
    waiting = await _waiting_for(client, "job", prefix)
    assert await _woken_after(holding, release, waiting) < 1.0  # the TTL: 30 s


async def test_release_wakes_a_waiter_of_a_client_with_another_encoding(
    make_client: Any, redis_server: Any, prefix: str
):
    """Clients that encode text as Latin-1: a lock named with a non-ASCII letter has its
    release channel in Latin-1 bytes, and the waiter's subscription, confirmed and woken
    by those bytes, still gets it on the release, not at the 30 s TTL."""
    holder, waiter = (make_client(redis_server.url, encoding="latin-1") for _ in range(2))
    holding, release = await _held_by(holder, "café", prefix)
    waiting = await _waiting_for(waiter, "café", prefix)
    assert await _woken_after(holding, release, waiting) < 1.0


async def _acquire_and_time(redis: Redis, name: str, prefix: str, **kwargs: Any) -> float:
    async with asynclock.lease(redis, name, ttl=30, prefix=prefix, **kwargs):
        return time.monotonic()


async def _subscribed(redis: Redis, name: str, prefix: str) -> bool:
    return f"{prefix}{{{name}}}:released" in companion_for(redis).room._confirmed


async def test_waiter_takes_an_expired_lock_at_its_pttl(client: Redis, prefix: str):
    """11: no release notification comes for an expiring key; the PTTL fallback wakes."""
    await client.set(prefix + "{orphan}", "crashed-holder", px=600)
    started = time.monotonic()
    async with asynclock.lease(client, "orphan", ttl=5, prefix=prefix, blocking_timeout=10):
        waited = time.monotonic() - started
    assert 0.5 <= waited < 0.6 + 1.0, waited


async def test_waiting_does_not_poll(private_server: RedisServer, prefix: str):
    """11: while the holder renews a 30 s lease, a waiter makes only a couple of attempts."""
    holder_client = Redis.from_url(private_server.url)
    client = Redis.from_url(private_server.url)
    observer = Redis.from_url(private_server.url)
    held, release = asyncio.Event(), asyncio.Event()
    try:
        holder = asyncio.create_task(_hold_until(holder_client, "slow", prefix, held, release))
        await held.wait()
        before = await commandstat(observer, "evalsha") + await commandstat(observer, "eval")
        with pytest.raises(asynclock.AcquireTimeout):
            async with asynclock.lease(client, "slow", ttl=5, prefix=prefix, blocking_timeout=1.5):
                pass
        after = await commandstat(observer, "evalsha") + await commandstat(observer, "eval")
        # at most 3 attempts, and the withdrawal of the waiter's offer when it gives up
        # (ABANDON: EVALSHA, then EVAL after NOSCRIPT on this fresh server)
        assert after - before <= 3 + 2, after - before
        release.set()
        await holder
    finally:
        await holder_client.aclose()
        await client.aclose()
        await observer.aclose()


async def test_blocking_timeout_raises_acquire_timeout(client: Redis, prefix: str):
    """11: blocking_timeout gives AcquireTimeout, which is also a TimeoutError."""

    async def contend() -> None:  # (in a task of its own: this one holds the lock)
        async with asynclock.lease(client, "busy", ttl=30, prefix=prefix, blocking_timeout=0.3):
            pass

    async with asynclock.lease(client, "busy", ttl=30, prefix=prefix) as holder:
        started = time.monotonic()
        with pytest.raises(TimeoutError) as caught:
            await asyncio.create_task(contend())
        assert isinstance(caught.value, asynclock.AcquireTimeout)
        assert 0.3 <= time.monotonic() - started < 2.0
        assert await holder.is_held(verify=True)
    assert not companion_for(client).room._lines


@pytest.mark.parametrize("how", ["asyncio.timeout", "anyio.fail_after"])
async def test_callers_own_timeout_works(client: Redis, prefix: str, how: str):
    """11: the caller's asyncio.timeout / anyio.fail_after end a wait, leaving nothing."""

    async def contend() -> None:  # (in a task of its own: this one holds the lock)
        if how == "asyncio.timeout":
            async with asyncio.timeout(0.3):
                async with asynclock.lease(client, "waited", ttl=30, prefix=prefix):
                    pass
        else:
            with anyio.fail_after(0.3):
                async with asynclock.lease(client, "waited", ttl=30, prefix=prefix):
                    pass

    async with asynclock.lease(client, "waited", ttl=30, prefix=prefix) as holder:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.create_task(contend())
        assert time.monotonic() - started < 2.0
        assert await holder.is_held(verify=True)
    assert not companion_for(client).room._lines


async def test_one_subscription_connection_serves_every_name(
    client: Redis, make_client: Any, redis_server: Any, prefix: str
):
    """11: waiters on three names share one pub/sub connection; all are woken."""
    holder_client = make_client(redis_server.url)
    names = ["a", "b", "c"]
    helds = {n: asyncio.Event() for n in names}
    release = asyncio.Event()
    holders = [
        asyncio.create_task(_hold_until(holder_client, n, prefix, helds[n], release)) for n in names
    ]
    for event in helds.values():
        await event.wait()
    waiters = [
        asyncio.create_task(_acquire_and_time(client, n, prefix, blocking_timeout=20))
        for n in names
    ]

    async def all_subscribed() -> bool:
        return all([await _subscribed(client, n, prefix) for n in names])

    await wait_until(all_subscribed, what="three subscriptions")
    observer = make_client(redis_server.url, decode_responses=True)
    clients = await observer.client_list()
    # (per name: its release channel, and the client's own channel for grants of it)
    mine = [c for c in clients if int(c.get("sub", 0)) > 0 and prefix in str(c)] or [
        c for c in clients if int(c.get("sub", 0)) == 6
    ]
    assert len(mine) == 1, clients
    released_at = time.monotonic()
    release.set()
    await asyncio.gather(*holders)
    acquired = await asyncio.gather(*waiters)
    assert max(acquired) - released_at < 1.0
    assert not companion_for(client).room.open  # closed once nobody waits or holds


async def test_waiting_works_on_a_client_with_health_checks(
    make_client: Any, redis_server: Any, prefix: str
):
    """A client built with ``health_check_interval`` (common where pub/sub is used): its
    connections PING before a command once the interval has passed since their last
    reply. The subscription connection is read by the listener at all times, so such a
    PING's read would collide with the listener's. Waits on three names, one after the
    other with pauses longer than the interval, are each woken by the release (the
    holder's key lives 30 s), and no error reaches the waiter."""
    holder = make_client(redis_server.url)
    waiter = make_client(redis_server.url, health_check_interval=0.05)
    for name in ("hc-1", "hc-2", "hc-3"):
        holding, release = await _held_by(holder, name, prefix)
        waiting = await _waiting_for(waiter, name, prefix)
        await asyncio.sleep(0.15)  # (the interval passes: the next command would PING)
        assert await _woken_after(holding, release, waiting) < 2.0, name  # not the TTL


async def test_a_waiter_arriving_while_the_last_lease_closes_the_subscription_is_woken(
    make_client: Any, redis_server: Any, prefix: str
):
    """The task that ends a client's last lease closes the client's side connections, its
    subscription among them, while another task of the client may start waiting. Such a
    waiter, arriving once the closing has begun, is neither cancelled nor left without
    its wake-up: the release of the lock it waits for wakes it (the holder's key lives
    30 s; its blocking_timeout is 10 s)."""
    holder = make_client(redis_server.url)
    client = make_client(redis_server.url)
    holding, release = await _held_by(holder, "first", prefix)
    only = await _waiting_for(client, "first", prefix)
    holding_2, release_2 = await _held_by(holder, "second", prefix)

    room = companion_for(client).room
    closing = room._cancel_background  # (the first step of the room's aclose)
    newcomer: list[asyncio.Task[float]] = []

    async def a_waiter_arrives(tasks: Any = None) -> None:
        if not newcomer:
            newcomer.append(
                asyncio.create_task(
                    _acquire_and_time(client, "second", prefix, blocking_timeout=10)
                )
            )
            await wait_until(
                lambda: _subscribed(client, "second", prefix), what="the newcomer subscribed"
            )
        await (closing() if tasks is None else closing(tasks))

    room._cancel_background = a_waiter_arrives  # type: ignore[method-assign]
    await _woken_after(holding, release, only)  # (its exit, the client's last lease, closes)
    assert newcomer, "the room was not closed"
    assert await _woken_after(holding_2, release_2, newcomer[0]) < 2.0  # not the 30 s TTL
    assert not room.open  # and closed once its lease, now the last, ended


async def test_broken_subscription_degrades_to_the_pttl_fallback(
    client: Redis, make_client: Any, redis_server: Any, prefix: str
):
    """11: killing the pub/sub connection neither errors nor hangs a waiter."""
    await client.set(prefix + "{flaky}", "someone", px=1500)
    waiter = asyncio.create_task(_acquire_and_time(client, "flaky", prefix, blocking_timeout=10))
    await wait_until(lambda: _subscribed(client, "flaky", prefix), what="the subscription")
    observer = make_client(redis_server.url)
    killed = await observer.client_kill_filter(_type="pubsub")
    assert killed >= 1
    started = time.monotonic()
    acquired_at = await waiter
    assert acquired_at - started < 1.5 + 1.0


async def test_a_channel_dropped_before_its_confirmation_can_be_subscribed_again(
    make_client: Any, redis_server: Any, prefix: str
):
    """A lock's subscription, left unconfirmed by a slow path when its waiter went away,
    is dropped with other unused ones (UNSUBSCRIBE) before its confirmation arrives; the
    replies come in later, in order. A new waiter on that lock must subscribe again, and
    count as listening only once Redis's last word on it is a SUBSCRIBE, not stay deaf
    (sending nothing, waiting on the old confirmation) until the connection breaks."""
    from asynclock._session._wakeup import _STALE_CHANNELS
    from asynclock.testing import FaultProxy, ProxyMode

    b = make_client(redis_server.url)
    observer = make_client(redis_server.url)
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    room = companion_for(b).room
    late, other = f"{prefix}{{late}}:released", f"{prefix}{{other}}:released"
    async with FaultProxy("127.0.0.1", port) as proxy:
        room._settings.update(host=proxy.host, port=proxy.port)  # (only its subscription)
        try:
            for i in range(_STALE_CHANNELS - 1):  # unused ones, dropped in one batch
                assert await room.subscribe(f"{prefix}{{unused-{i}}}:released")
            proxy.set_mode(ProxyMode.HOLD, direction="downstream")
            assert not await room.subscribe(late)  # not confirmed in time; nobody waits
            dropping = asyncio.create_task(room.subscribe(other))  # drops `late` too
            await wait_until(lambda: _dropped(room, late), what="the batch UNSUBSCRIBE")
            proxy.set_mode(ProxyMode.PASS)  # the held replies arrive, in order
            assert await dropping
            assert not room.listening(late)
            assert await asyncio.wait_for(room.subscribe(late), 5)
            assert room.listening(late)
            grants = f"{late}:{room.origin}"
            assert dict(await observer.pubsub_numsub(late, grants)) == {
                late.encode(): 1,
                grants.encode(): 1,
            }
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await room.aclose()


async def _dropped(room: Any, channel: str) -> bool:
    return channel not in room._subscribed


async def test_local_waiters_are_served_in_arrival_order(client: Redis, prefix: str):
    """Waiters of one process queue locally: a release wakes the head, in FIFO order."""
    order: list[int] = []
    async with asynclock.lease(client, "fifo", ttl=30, prefix=prefix):

        async def waiter(i: int) -> None:
            async with asynclock.lease(client, "fifo", ttl=30, prefix=prefix):
                order.append(i)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(waiter(i)))
            await wait_until(
                lambda n=i + 1: _line_length(client, "fifo", prefix, n), what="queueing"
            )
    async with asyncio.timeout(10):
        await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]


async def _line_length(redis: Redis, name: str, prefix: str, n: int) -> bool:
    line = companion_for(redis).room._lines.get(f"{prefix}{{{name}}}:released")
    return line is not None and len(line) == n


async def test_release_hands_the_lock_to_the_next_local_waiter_in_one_round_trip(
    client: Redis, redis_server: Any, prefix: str
):
    """A release with a waiter in the same client's line gives it the key directly: one
    HANDOFF script call, no DEL, no PUBLISH, and no attempt of the waiter's own."""
    key = f"{prefix}{{relay}}"
    got: list[asynclock.Lease] = []
    entered = asyncio.Event()
    for script in (HANDOFF, RELEASE):  # so each shows up once (no NOSCRIPT fallback)
        await client.script_load(script.source)

    async def waiter() -> None:
        async with asynclock.lease(client, "relay", ttl=30, prefix=prefix) as lock:
            got.append(lock)
            entered.set()

    async with Monitor(redis_server.url) as monitor:
        async with asynclock.lease(client, "relay", ttl=30, prefix=prefix) as first:
            task = asyncio.create_task(waiter())
            await wait_until(lambda: _line_length(client, "relay", prefix, 1), what="queueing")
            await wait_until(
                lambda: _subscribed(client, "relay", prefix), what="the waiter's subscription"
            )
            await monitor.mark()
            start = len(monitor.lines)
        await asyncio.wait_for(entered.wait(), 5)
        await task
        await monitor.mark()
        during = [line for line in monitor.lines[start:] if key in line and " lua]" not in line]
    # the handoff, then the new holder's release; nothing in between
    assert len(during) == 2, "\n".join(during)
    assert HANDOFF.sha in during[0], during
    assert RELEASE.sha in during[1], during
    assert got[0].fencing_token > first.fencing_token
    assert await client.exists(key) == 0


async def test_a_waiter_in_another_client_is_not_starved_by_local_handoffs(
    client: Redis, make_client: Any, redis_server: Any, prefix: str
):
    """Two tasks of one client pass the lock back and forth by handoff; a waiter of
    another client registers as waiting, so the next release is a plain one and the
    outsider gets the lock, long before either ttl could run out."""
    stop = asyncio.Event()
    rounds = 0

    async def local() -> None:
        nonlocal rounds
        while not stop.is_set():
            async with asynclock.lease(client, "shared", ttl=30, prefix=prefix):
                rounds += 1
                await asyncio.sleep(0.002)

    locals_ = [asyncio.create_task(local()) for _ in range(2)]
    try:
        await wait_until(lambda: _at_least(lambda: rounds, 20), what="local handoffs")
        outsider = make_client(redis_server.url)
        started = time.monotonic()
        async with asynclock.lease(outsider, "shared", ttl=30, prefix=prefix, blocking_timeout=10):
            waited = time.monotonic() - started
    finally:
        stop.set()
        await asyncio.gather(*locals_)
    assert waited < 2.0, waited


async def _at_least(value: Any, n: int) -> bool:
    return bool(value() >= n)


async def test_handoff_to_a_token_that_already_holds_the_key_renews_it(client: Redis, prefix: str):
    """HANDOFF finding the key already held by the next holder's token (it took the key
    by an attempt of its own, or a retry after our handoff landed) answers status 3 and
    renews the key's expiry, so the releaser's send time is a valid start for it."""
    key = f"{prefix}{{ready}}"
    await client.set(key, "next0123:42", px=500)
    reply = await HANDOFF(
        client,
        [key, key + ":fence", key + ":void:next0123", key + ":waiting", key + ":void:"],
        [
            "mine:41",
            "next0123",
            30_000,
            86_400_000,
            key + ":released",
            "origin",
            "drop",
            61_000,
            5,
            "1.0",
            "",
            0,
            1000,
        ],
    )
    assert [int(x) for x in reply] == [3, 42]  # type: ignore[attr-defined]
    assert await client.pttl(key) > 29_000


async def test_registration_lifetime_is_only_ever_extended(client: Redis, prefix: str):
    """A failed attempt of a short-ttl client must not cut the waiting hash's expiry
    below a long-ttl client's registration."""
    key = f"{prefix}{{mixed}}"
    await client.set(key, "holder:1", px=60_000)

    async def failed_attempt(origin: str, register_ms: int) -> None:
        keys = [key, key + ":fence", key + ":void:t" + origin, key + ":waiting"]
        reply = await ACQUIRE(
            client, keys, ["t" + origin, 1000, 86_400_000, origin, register_ms, "", ""]
        )
        assert int(reply[0]) == 0  # type: ignore[index]

    await failed_attempt("long", 21_000)
    await failed_attempt("short", 1_200)
    assert await client.pttl(key + ":waiting") > 20_000
    raw = await client.hkeys(key + ":waiting")
    names = {n.decode() if isinstance(n, bytes) else n for n in raw}
    assert names == {"long", "short"}
