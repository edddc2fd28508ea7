"""Grants across clients: a releaser that serves a waiter of another client gives the key
to that waiter's offered token in its own round trip (HANDOFF status 5), and the waiter
picks the grant up from its client's own grant channel for the lock, without an attempt
of its own."""

from __future__ import annotations

import asyncio
import random
import re
import time
from typing import Any

from helpers import Monitor, wait_until
from redis.asyncio import Redis

import asynclock
from asynclock._kinds._mutex import GRANT_FRESH_MS, HANDOFF_PATIENCE_MS
from asynclock._redis._scripts import ABANDON, ACQUIRE, HANDOFF, RELEASE
from asynclock._session._connections import companion_for


def _channel(name: str, prefix: str) -> str:
    return f"{prefix}{{{name}}}:released"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _offer(redis: Redis, name: str, prefix: str) -> list[str] | None:
    """The parts of ``redis``'s registration for the lock: [since, until, token,
    loop time, ttl, offered at] when it offers a token, [since, until] when not, None if
    absent."""
    origin = companion_for(redis).room.origin
    raw = await redis.hget(f"{prefix}{{{name}}}:waiting", origin)
    return None if raw is None else _text(raw).split(":")


async def _offered_and_due(redis: Redis, name: str, prefix: str) -> bool:
    """Whether ``redis``'s client offers a token for the lock, registered long enough
    (the patience, with a margin) for another client's releaser to serve it."""
    parts = await _offer(redis, name, prefix)
    if parts is None or len(parts) != 6:
        return False
    return await _now_ms(redis) - int(parts[0]) >= 2 * HANDOFF_PATIENCE_MS


async def _now_ms(redis: Redis) -> int:
    """The server's clock, in ms."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _in_line(redis: Redis, name: str, prefix: str, n: int) -> bool:
    line = companion_for(redis).room._lines.get(_channel(name, prefix))
    return line is not None and len(line) == n


def _head_token(redis: Redis, name: str, prefix: str) -> str:
    line = companion_for(redis).room._lines[_channel(name, prefix)]
    return line[0].token


class _Holder:
    """A lease held in a task of its own until ``release`` is set."""

    def __init__(self, redis: Redis, name: str, prefix: str, ttl: float = 30) -> None:
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.entered_at = 0.0
        self.lease: asynclock.Lease | None = None
        self.task = asyncio.create_task(self._run(redis, name, prefix, ttl))

    async def _run(self, redis: Redis, name: str, prefix: str, ttl: float) -> None:
        async with asynclock.lease(redis, name, ttl=ttl, prefix=prefix) as lease:
            self.entered_at = time.monotonic()
            self.lease = lease
            self.held.set()
            await self.release.wait()


async def _two_clients_waiting(
    make_client: Any, url: str, name: str, prefix: str
) -> tuple[Redis, Redis, _Holder, _Holder, _Holder]:
    """Client A holds ``name`` with a waiter of its own in line; client B has a waiter
    whose token is offered and due. Returns (A, B, A's holder, A's waiter, B's waiter)."""
    a, b = make_client(url), make_client(url)
    first = _Holder(a, name, prefix)
    await first.held.wait()
    local = _Holder(a, name, prefix)
    await wait_until(lambda: _in_line(a, name, prefix, 1), what="A's waiter in line")
    outsider = _Holder(b, name, prefix)
    await wait_until(lambda: _in_line(b, name, prefix, 1), what="B's waiter in line")
    await wait_until(lambda: _offered_and_due(b, name, prefix), what="B's offer")
    return a, b, first, local, outsider


async def _b_then_a_and_nothing_left(
    a: Redis, key: str, first: _Holder, local: _Holder, outsider: _Holder
) -> None:
    """B's waiter, holding the lock, leaves; A's own waiter gets it next and leaves; no
    key is left behind."""
    outsider.release.set()
    await asyncio.wait_for(local.held.wait(), 5)
    local.release.set()
    await asyncio.gather(first.task, local.task, outsider.task)
    assert await a.exists(key) == 0


async def test_release_grants_the_key_to_another_clients_waiter_in_one_round_trip(
    make_client: Any, redis_server: Any, prefix: str
):
    """A's release finds B's waiter due: the HANDOFF script gives the key to B's offered
    token and publishes the grant; B's waiter enters with no script call of its own, before
    A's own waiter, with a greater fencing token, on the key's value."""
    name = "granted"
    key = f"{prefix}{{{name}}}"
    a, b, first, local, outsider = await _two_clients_waiting(
        make_client, redis_server.url, name, prefix
    )
    for script in (HANDOFF, RELEASE, ACQUIRE):  # so each shows up once (no NOSCRIPT)
        await a.script_load(script.source)
    token = _head_token(b, name, prefix)
    async with Monitor(redis_server.url) as monitor:
        await monitor.mark()
        start = len(monitor.lines)
        first.release.set()
        await asyncio.wait_for(outsider.held.wait(), 5)
        await monitor.mark()
        during = [line for line in monitor.lines[start:] if key in line and " lua]" not in line]
        assert outsider.lease is not None
        assert first.lease is not None
        assert outsider.lease.token == token
        assert outsider.lease.fencing_token > first.lease.fencing_token
        value = _text(await a.get(key))
        assert value == f"{token}:{outsider.lease.fencing_token}"
        assert await a.pttl(key) > 25_000
        assert not local.held.is_set()  # A's own waiter stood back
    # A's release first, and no attempt of B's waiter (A's own head may try once after
    # standing back, if B's waiter took longer than that to enter)
    assert HANDOFF.sha in during[0], during
    assert not [line for line in during if ACQUIRE.sha in line and token in line], during
    await _b_then_a_and_nothing_left(a, key, first, local, outsider)


async def test_a_grant_is_published_only_to_the_granted_client(
    make_client: Any, redis_server: Any, prefix: str
):
    """The grant goes out on B's own grant channel for the lock, not on the release
    channel every waiting client (and the releaser itself) listens to: those would wake
    only to drop it. An observer subscribed to the lock's channels sees it on B's alone."""
    name = "addressed"
    release_channel = _channel(name, prefix)
    marker = f"{prefix}marker"
    observer = make_client(redis_server.url)
    async with observer.pubsub() as pubsub:
        # (before the setup, which must not take longer than an offer stays fresh)
        await pubsub.psubscribe(release_channel + "*", marker)
        for _ in range(2):  # the confirmations
            assert await pubsub.get_message(timeout=5) is not None
        a, b, first, local, outsider = await _two_clients_waiting(
            make_client, redis_server.url, name, prefix
        )
        token = _head_token(b, name, prefix)
        first.release.set()
        await asyncio.wait_for(outsider.held.wait(), 5)
        assert outsider.lease is not None
        await observer.publish(marker, "end")  # (delivered after anything published before)
        seen: list[tuple[str, str]] = []
        while not seen or seen[-1][0] != marker:
            message = await pubsub.get_message(timeout=5)
            assert message is not None, seen
            if message["type"] == "pmessage":
                seen.append((_text(message["channel"]), _text(message["data"])))
    origin_a, origin_b = companion_for(a).room.origin, companion_for(b).room.origin
    assert [channel for channel, _ in seen] == [f"{release_channel}:{origin_b}", marker], seen
    assert seen[0][1].startswith(f"{origin_a}:{origin_b}:{token}:"), seen
    await _b_then_a_and_nothing_left(a, f"{prefix}{{{name}}}", first, local, outsider)


async def test_a_waiter_that_gives_up_withdraws_its_offer(
    make_client: Any, redis_server: Any, prefix: str
):
    """B's offered waiter is cancelled: its registration no longer offers the token, so
    A's release hands the key within A's own line, and no key is left with B's token."""
    name = "withdrawn"
    key = f"{prefix}{{{name}}}"
    a, b, first, local, outsider = await _two_clients_waiting(
        make_client, redis_server.url, name, prefix
    )
    token = _head_token(b, name, prefix)
    outsider.task.cancel()
    await asyncio.gather(outsider.task, return_exceptions=True)
    parts = await _offer(b, name, prefix)
    assert parts is None or len(parts) == 2, parts
    assert await a.exists(f"{key}:void:{token}") == 1
    first.release.set()
    await asyncio.wait_for(local.held.wait(), 5)
    assert local.lease is not None
    assert _text(await a.get(key)).startswith(local.lease.token + ":")
    local.release.set()
    await asyncio.gather(first.task, local.task)
    assert await a.exists(key) == 0


async def test_a_grant_to_a_token_nobody_waits_with_is_given_back(
    make_client: Any, redis_server: Any, prefix: str
):
    """B's registration offers a token that no waiter of B's holds any more (written here
    by hand): the grant lands on it, B's client deletes the key at once and tombstones the
    token, and the lock goes on to a live waiter long before that token's ttl."""
    name = "orphan-grant"
    key = f"{prefix}{{{name}}}"
    a, b, first, local, outsider = await _two_clients_waiting(
        make_client, redis_server.url, name, prefix
    )
    parts = await _offer(b, name, prefix)
    assert parts is not None
    origin = companion_for(b).room.origin
    ghost = "0" * 31 + "9"
    fresh = str(await _now_ms(a))
    await a.hset(key + ":waiting", origin, ":".join([*parts[:2], ghost, "0.0", "30000", fresh]))
    started = time.monotonic()
    first.release.set()
    local.release.set()  # (both leave as soon as they are in)
    outsider.release.set()
    await asyncio.wait_for(asyncio.gather(first.task, local.task, outsider.task), 5)
    assert local.held.is_set()
    assert outsider.held.is_set()
    assert time.monotonic() - started < 5  # not the ghost's 30 s
    assert await a.exists(f"{key}:void:{ghost}") == 1
    assert await a.exists(key) == 0


async def test_a_grant_to_a_dead_waiter_costs_at_most_its_ttl(
    make_client: Any, redis_server: Any, prefix: str
):
    """The liveness price of grants: a client that registered an offer and died is granted
    the key, which then sits unused until its ttl (0.6 s here) runs out. The live waiters
    get the lock after that, by their PTTL fallback, never hang."""
    name = "dead-waiter"
    key = f"{prefix}{{{name}}}"
    a = make_client(redis_server.url)
    first = _Holder(a, name, prefix)
    await first.held.wait()
    local = _Holder(a, name, prefix)
    await wait_until(lambda: _in_line(a, name, prefix, 1), what="A's waiter in line")
    now = await _now_ms(a)
    since = now - 1000
    entry = f"{since}:{since + 60_000}:{'d' * 32}:0.0:600:{now}"  # (fresh: see the next test)
    await a.hset(key + ":waiting", "dead-client", entry)
    first.release.set()
    await first.task
    assert _text(await a.get(key)).startswith("d" * 32 + ":")
    released_at = time.monotonic()
    await asyncio.wait_for(local.held.wait(), 5)
    assert 0.4 < local.entered_at - released_at < 3.0
    local.release.set()
    await local.task
    assert await a.exists(key) == 0


async def test_an_offer_older_than_the_freshness_limit_gets_a_plain_release(
    make_client: Any, redis_server: Any, prefix: str
):
    """B's offer was made more than GRANT_FRESH_MS ago (its waiter may have died since):
    A's release does not grant it the key but releases it plainly and publishes a wake-up;
    B's waiter, alive here, takes the lock by an attempt of its own, offering anew."""
    name = "stale-offer"
    key = f"{prefix}{{{name}}}"
    a, b, first, local, outsider = await _two_clients_waiting(
        make_client, redis_server.url, name, prefix
    )
    parts = await _offer(b, name, prefix)
    assert parts is not None
    assert len(parts) == 6
    stale = str(await _now_ms(a) - GRANT_FRESH_MS - 500)
    origin = companion_for(b).room.origin
    await a.hset(key + ":waiting", origin, ":".join([*parts[:5], stale]))
    for script in (HANDOFF, RELEASE, ACQUIRE):  # so each shows up once (no NOSCRIPT)
        await a.script_load(script.source)
    async with Monitor(redis_server.url) as monitor:
        start = len(monitor.lines)
        first.release.set()
        await asyncio.wait_for(outsider.held.wait(), 5)
        await monitor.mark()
        during = monitor.lines[start:]
    published = [line for line in during if '"PUBLISH"' in line]
    assert published, during
    assert f'"{companion_for(a).room.origin}"' in published[0], published  # plain wake-up
    assert outsider.lease is not None
    token = outsider.lease.token
    assert [line for line in during if ACQUIRE.sha in line and token in line], during
    await _b_then_a_and_nothing_left(a, key, first, local, outsider)


async def test_a_grant_too_late_to_use_is_refreshed_before_use(
    make_client: Any, redis_server: Any, prefix: str
):
    """B's offer names a loop time a whole ttl ago: the grant cannot count from it, so B's
    waiter refreshes the key it was granted (same token, same fencing token) by one
    attempt before entering."""
    name = "late-grant"
    key = f"{prefix}{{{name}}}"
    a, b, first, local, outsider = await _two_clients_waiting(
        make_client, redis_server.url, name, prefix
    )
    parts = await _offer(b, name, prefix)
    assert parts is not None
    assert len(parts) == 6
    old = repr(asyncio.get_running_loop().time() - 30)
    fresh = str(await _now_ms(a))
    await a.hset(
        key + ":waiting",
        companion_for(b).room.origin,
        ":".join([*parts[:3], old, parts[4], fresh]),
    )
    first.release.set()
    await asyncio.wait_for(outsider.held.wait(), 5)
    assert outsider.lease is not None
    assert first.lease is not None
    assert outsider.lease.token == parts[2]
    assert outsider.lease.fencing_token > first.lease.fencing_token
    assert outsider.lease.time_left > 20  # counted from the refresh, not the stale offer
    await _b_then_a_and_nothing_left(a, key, first, local, outsider)


async def test_cancelling_an_offered_waiter_as_it_is_granted_leaves_nothing_locked(
    make_client: Any, redis_server: Any, prefix: str
):
    """B's offered waiter is cancelled at a random moment around A's release, which may
    grant it the key: whatever the order, the key never stays with B's token, and A's own
    waiter gets the lock within seconds (not the 30 s ttl)."""
    rng = random.Random(4)
    for round_ in range(12):
        name = f"race-{round_}"
        key = f"{prefix}{{{name}}}"
        a, b, first, local, outsider = await _two_clients_waiting(
            make_client, redis_server.url, name, prefix
        )
        token = _head_token(b, name, prefix)
        first.release.set()
        await asyncio.sleep(rng.uniform(0, 0.002))  # (the fault's timing, not a wait)
        outsider.task.cancel()
        await asyncio.gather(outsider.task, return_exceptions=True)
        if outsider.held.is_set():  # it entered before the cancellation arrived
            assert outsider.lease is not None
            assert outsider.lease.state is not asynclock.LeaseState.HELD
        await asyncio.wait_for(local.held.wait(), 5)
        value = _text(await a.get(key))
        assert not value.startswith(token + ":"), value
        local.release.set()
        await asyncio.gather(first.task, local.task)
        assert await a.exists(key) == 0
        await a.aclose()
        await b.aclose()


async def test_abandon_withdraws_only_its_own_token(client: Redis, prefix: str):
    """ABANDON strips the offer from the client's registration when it names the
    abandoned token, and leaves another token's offer alone."""
    key = f"{prefix}{{withdraw}}"
    waiting = key + ":waiting"
    await client.hset(waiting, "me", "1:99999999999999:aaaa:1.5:1000")
    await ABANDON(client, [key, key + ":void:bbbb", waiting], ["bbbb", 10_000, "ch", "me"])
    assert _text(await client.hget(waiting, "me")) == "1:99999999999999:aaaa:1.5:1000"
    await ABANDON(client, [key, key + ":void:aaaa", waiting], ["aaaa", 10_000, "ch", "me"])
    assert _text(await client.hget(waiting, "me")) == "1:99999999999999"


async def test_a_repeated_grant_to_a_held_lease_is_not_undone(
    make_client: Any, redis_server: Any, prefix: str
):
    """A waiter's own attempt can find the key already granted to its token and take it
    before the grant's notification is read; the notification then names a token that no
    waiter holds but a live lease does. It must be ignored: undoing it would delete the
    held key. (Replayed here by publishing the grant again while B holds the lease; a grant
    to an unknown token published after it shows when both were read.)"""
    name = "held-grant"
    key = f"{prefix}{{{name}}}"
    a, b, first, local, outsider = await _two_clients_waiting(
        make_client, redis_server.url, name, prefix
    )
    first.release.set()
    await asyncio.wait_for(outsider.held.wait(), 5)
    lease = outsider.lease
    assert lease is not None
    origin = companion_for(b).room.origin
    grants = f"{_channel(name, prefix)}:{origin}"  # (B's own grant channel for the lock)
    ghost = "0" * 31 + "7"
    await a.publish(grants, f"x:{origin}:{lease.token}:{lease.fencing_token}:0.0")
    await a.publish(grants, f"x:{origin}:{ghost}:1:0.0")
    await wait_until(lambda: _exists(a, f"{key}:void:{ghost}"), what="the second grant read")
    assert _text(await a.get(key)) == f"{lease.token}:{lease.fencing_token}"
    assert await lease.is_held(verify=True)
    await _b_then_a_and_nothing_left(a, key, first, local, outsider)


async def _exists(redis: Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def test_only_the_head_of_a_line_offers_its_token(
    make_client: Any, redis_server: Any, prefix: str
):
    """Waiters that start together each make a first attempt before joining the line; one
    of them joins behind the other. A token offered by such an attempt could be granted to
    a waiter that, not being the head, never tries again: should the grant's notification
    be missed (the client was not yet subscribed), the key would sit unused for its TTL.
    So only the head of a line offers its token, once its client listens for grants."""
    name = "heads-only"
    a, b = make_client(redis_server.url), make_client(redis_server.url)
    await b.script_load(ACQUIRE.source)  # (so every attempt shows up as one EVALSHA)
    holder = _Holder(a, name, prefix)
    await holder.held.wait()
    origin = companion_for(b).room.origin
    offered: list[str] = []
    async with Monitor(redis_server.url) as monitor:
        for _ in range(6):
            start = len(monitor.lines)
            waiters = [_Holder(b, name, prefix) for _ in range(3)]
            await wait_until(lambda: _in_line(b, name, prefix, 3), what="B's waiters in line")
            await wait_until(lambda: _offered_and_due(b, name, prefix), what="B's offer")
            head = _head_token(b, name, prefix)
            await monitor.mark()
            for line in monitor.lines[start:]:
                args = re.findall(r'"([^"]*)"', line)
                if ACQUIRE.sha in args and origin in args and args[-1]:  # (ARGV[7]: offer)
                    offered.append(args[-7])  # (ARGV[1]: the token)
                    assert args[-7] == head, (args, head)
            for waiter in waiters:
                waiter.task.cancel()
            await asyncio.gather(*(w.task for w in waiters), return_exceptions=True)
            parts = await _offer(b, name, prefix)
            assert parts is None or len(parts) == 2, parts  # the offer was withdrawn
    assert offered  # (the heads did offer)
    holder.release.set()
    await holder.task


async def test_a_subscription_gone_silent_stops_offering(
    make_client: Any, redis_server: Any, prefix: str
):
    """B's subscription connection is cut without a word (a blackholed TCP path, as a NAT
    or load balancer that drops an idle connection leaves it): B's client must stop
    trusting it within seconds (it pings a silent subscription while waiters wait), and
    its waiters then offer no token, so A's release does not grant B a key whose
    notification B would never read; the lock goes on to A's own waiter instead of
    idling for B's 30 s ttl."""
    from asynclock.testing import FaultProxy, ProxyMode

    name = "deaf"
    key = f"{prefix}{{{name}}}"
    channel = _channel(name, prefix)
    a, b = make_client(redis_server.url), make_client(redis_server.url)
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    async with FaultProxy("127.0.0.1", port) as proxy:
        room = companion_for(b).room
        room._settings.update(host=proxy.host, port=proxy.port)  # (only its subscription)
        first = _Holder(a, name, prefix)
        await first.held.wait()
        local = _Holder(a, name, prefix)
        await wait_until(lambda: _in_line(a, name, prefix, 1), what="A's waiter in line")
        outsider = _Holder(b, name, prefix)  # subscribes B, through the proxy
        await wait_until(lambda: _offered_and_due(b, name, prefix), what="B's offer")
        assert room.listening(channel)
        token = _head_token(b, name, prefix)
        proxy.set_mode(ProxyMode.BLACKHOLE)
        try:
            await wait_until(
                lambda: _is_deaf(room, channel), limit=10.0, what="B to stop trusting it"
            )
            # (the broken subscription woke B's head, whose attempt withdrew the offer)
            await wait_until(lambda: _registered_not_offered(b, name, prefix), what="no offer")
            released_at = time.monotonic()
            first.release.set()
            await asyncio.wait_for(local.held.wait(), 5)
            assert local.entered_at - released_at < 3.0  # not B's 30 s ttl
            assert not _text(await a.get(key)).startswith(token + ":")
            local.release.set()
            await asyncio.gather(first.task, local.task)
            outsider.task.cancel()  # (deaf, it would wait for its PTTL fallback)
            await asyncio.gather(outsider.task, return_exceptions=True)
        finally:
            proxy.set_mode(ProxyMode.PASS)
    assert await a.exists(key) == 0


async def _is_deaf(room: Any, channel: str) -> bool:
    return not room.listening(channel)


async def _registered_not_offered(redis: Redis, name: str, prefix: str) -> bool:
    parts = await _offer(redis, name, prefix)
    return parts is not None and len(parts) == 2
