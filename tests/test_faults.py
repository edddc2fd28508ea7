"""The watchdog under real faults: a stopped server, a reset connection, a full pool.

Numbers in test docstrings refer to the "must hold" list of issue 2.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import anyio
import pytest
from helpers import StoppedServerProbe
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

import asynclock
from asynclock import LeaseEventKind, LeaseState, LockLost, LossReason
from asynclock.testing import FaultProxy, RedisServer


async def test_stopped_server_cancels_body_before_key_can_expire(
    private_server: RedisServer, prefix: str
):
    """5: SIGSTOP: the body is cancelled by the deadline timer before the key's expiry.

    The key's absolute expiry is read with the server's own clock (PEXPIRETIME) right
    after a renewal, then the server is stopped; the next renewal cannot land. The
    body's cancellation instant (wall clock of this host, which is the server's clock
    too) must come before that expiry, while the server is still stopped.
    """
    ttl = 3.0  # drift = 32 ms: the margin between the deadline and the earliest expiry
    client = Redis.from_url(private_server.url)
    observer = Redis.from_url(private_server.url)
    probe = StoppedServerProbe(private_server, observer)
    try:
        with pytest.raises(LockLost) as caught:
            async with asynclock.lease(
                client,
                "paused",
                ttl=ttl,
                prefix=prefix,
                on_event=probe.on_event,
                release_timeout=0.3,
            ) as lock:
                await probe.stop_and_wait(lock.key)
        elapsed = time.monotonic() - probe.paused_at
    finally:
        private_server.resume()
        await client.aclose()
        await observer.aclose()
    assert caught.value.reason is LossReason.DEADLINE
    assert probe.cancelled_at_ms is not None, "the body was not cancelled"
    margin_ms = probe.expires_at_ms - probe.cancelled_at_ms
    assert margin_ms > 0, f"cancelled {-margin_ms:.1f} ms after the key could expire"
    assert elapsed < ttl + 1.0, elapsed  # and no hang
    assert lock.state is LeaseState.LOST


async def test_blackholed_connection_loses_lease_at_deadline(
    private_server: RedisServer, prefix: str
):
    """5: a cut TCP path (blackhole) also ends in LockLost(deadline), before the expiry."""
    from asynclock.testing import ProxyMode

    ttl = 3.0  # drift = 32 ms: the margin between the deadline and the earliest expiry
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        renewed = asyncio.Event()
        try:
            with pytest.raises(LockLost) as caught:
                async with asynclock.lease(
                    client,
                    "cut",
                    ttl=ttl,
                    prefix=prefix,
                    release_timeout=0.3,
                    on_event=lambda e: renewed.set() if e.kind is LeaseEventKind.RENEWED else None,
                ) as lock:
                    await renewed.wait()
                    # The key expires no sooner than PTTL after this request was sent
                    # (measured before the cut; no renewal is due for a third of the ttl).
                    loop = asyncio.get_running_loop()
                    asked_at = loop.time()
                    expires_after = asked_at + await observer.pttl(lock.key) / 1000
                    proxy.set_mode(ProxyMode.BLACKHOLE)
                    try:
                        await anyio.sleep_forever()
                    finally:
                        cancelled_at = loop.time()
            assert caught.value.reason is LossReason.DEADLINE
            # (Measured here, not by asking Redis from the cancelled body: that question's
            # own round trip, on a loaded machine, could outlast the 12 ms the deadline
            # keeps before the expiry, and fail the test for a lease that was not late.)
            assert cancelled_at < expires_after, "the body was cancelled after the expiry"
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await client.aclose()
            await observer.aclose()


async def test_one_connection_reset_does_not_lose_a_healthy_lease(
    private_server: RedisServer, prefix: str
):
    """6: a renewal whose connection is reset is retried before the deadline."""
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        events: list[asynclock.LeaseEvent] = []
        renewed = asyncio.Event()

        def on_event(event: asynclock.LeaseEvent) -> None:
            events.append(event)
            if event.kind is LeaseEventKind.RENEWED:
                renewed.set()

        try:
            async with asynclock.lease(
                client, "reset", ttl=0.6, prefix=prefix, on_event=on_event
            ) as lock:
                for _ in range(3):
                    await renewed.wait()
                    renewed.clear()
                    proxy.reset_on_next_reply()  # the next renewal's reply is lost
                    await renewed.wait()  # ... and a retry confirms it
                    renewed.clear()
                assert await lock.is_held(verify=True)
            kinds = [e.kind for e in events]
            assert kinds.count(LeaseEventKind.RENEW_FAILED) >= 3
            assert LeaseEventKind.LOST not in kinds
            assert lock.state is LeaseState.RELEASED
        finally:
            await client.aclose()


async def test_a_release_cut_off_for_a_moment_frees_the_key_once_redis_answers(
    private_server: RedisServer, prefix: str
):
    """The holder's connections are reset as its block ends and new ones refused for
    0.3 s: the release is sent again until Redis answers (within ``release_timeout``), so
    the key is deleted then, not left to its 30 s TTL."""
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        events: list[asynclock.LeaseEvent] = []

        async def heal() -> None:
            await asyncio.sleep(0.3)
            proxy.refuse_new = False

        try:
            async with asynclock.lease(
                client, "blip", ttl=30, prefix=prefix, on_event=events.append
            ) as lock:
                proxy.refuse_new = True
                await proxy.reset_all()
                healing = asyncio.create_task(heal())
                started = time.monotonic()
            waited = time.monotonic() - started
            await healing
            kinds = [e.kind for e in events]
            assert LeaseEventKind.RELEASED in kinds, kinds
            assert LeaseEventKind.RELEASE_FAILED not in kinds
            assert lock.state is LeaseState.RELEASED
            assert await observer.exists(lock.key) == 0
            assert 0.2 < waited < 2.0 + 1.0, waited  # (it waited for Redis, bounded)
        finally:
            await client.aclose()
            await observer.aclose()


async def test_a_non_blocking_acquire_cut_off_gives_up_its_undo_after_the_grace(
    private_server: RedisServer, prefix: str
):
    """``blocking=False``, its attempt's reply lost and new connections refused: the undo
    of what the attempt may have taken is tried for ``TIMEOUT_GRACE`` (0.5 s), not the
    whole ``release_timeout``, before the connection error reaches the caller."""
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        try:
            async with asynclock.lease(client, "warm", ttl=5, prefix=prefix):
                pass  # (a connection of the lane, open)
            proxy.reset_on_next_reply()
            proxy.refuse_new = True
            started = time.monotonic()
            with pytest.raises(RedisConnectionError):
                await asynclock.acquire(
                    client, "cut", ttl=5, prefix=prefix, blocking=False, release_timeout=5
                )
            assert time.monotonic() - started < 0.5 + 1.0  # (not release_timeout's 5 s)
        finally:
            proxy.refuse_new = False
            await client.aclose()


async def test_exhausted_pool_does_not_starve_renewals(
    redis_server: Any, make_client: Any, prefix: str
):
    """7: every app connection stuck in BLPOP; renewals travel on their own connection."""
    client: Redis = make_client(redis_server.url, max_connections=3)
    blockers = []
    async with asynclock.lease(client, "starved", ttl=0.3, prefix=prefix) as lock:
        for i in range(3):
            blockers.append(asyncio.create_task(client.blpop([f"{prefix}nothing:{i}"], timeout=3)))
        await asyncio.sleep(0)
        with pytest.raises(RedisConnectionError, match="Too many connections"):
            await client.ping()  # the pool is exhausted
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # five ttl periods
            assert await lock.is_held()
            await asyncio.sleep(0.05)
        key = lock.key
    for task in blockers:
        task.cancel()
    await asyncio.gather(*blockers, return_exceptions=True)
    assert lock.state is LeaseState.RELEASED  # released through the side connection
    observer = make_client(redis_server.url)
    assert await observer.exists(key) == 0


async def test_many_leases_renew_in_pipelines(private_server: RedisServer, prefix: str):
    """300 leases of one client renew without loss, their renewals coalesced into a few
    pipelines per tick (the server reads far fewer times than it renews). The ttl (1.5 s,
    renewed every 0.5 s) leaves a second of slack: a VM that freezes the whole process
    for longer than that loses leases rightly, and did so once at a ttl of 0.6 s."""
    client = Redis.from_url(private_server.url, max_connections=400)
    observer = Redis.from_url(private_server.url)
    renewals = 0
    losses = 0

    def on_event(event: asynclock.LeaseEvent) -> None:
        nonlocal renewals, losses
        renewals += event.kind is LeaseEventKind.RENEWED
        losses += event.kind is LeaseEventKind.LOST

    entered = 0
    all_in = asyncio.Event()
    done = asyncio.Event()

    async def hold(i: int) -> None:
        nonlocal entered
        async with asynclock.lease(client, f"n{i}", ttl=1.5, prefix=prefix, on_event=on_event):
            entered += 1
            if entered == 300:
                all_in.set()
            await done.wait()

    try:
        tasks = [asyncio.create_task(hold(i)) for i in range(300)]
        await all_in.wait()
        reads_before = int((await observer.info("stats"))["total_reads_processed"])
        renewals_before = renewals
        await asyncio.sleep(3.0)  # the holding period under test
        reads = int((await observer.info("stats"))["total_reads_processed"]) - reads_before
        renewed = renewals - renewals_before
        done.set()
        await asyncio.gather(*tasks)
    finally:
        await client.aclose()
        await observer.aclose()
    assert losses == 0
    assert renewed >= 300 * 5  # every 0.5 s for 3 s
    assert reads < renewed / 10, (reads, renewed)


async def test_the_deadline_does_not_wait_for_a_renewal_to_unwind(
    private_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
):
    """5: with the server stopped, a renewal in flight is cut off at the deadline; if its
    unwinding then takes a second (a graceful close waiting for the peer, a busy loop),
    the body is still cancelled at the deadline, not a second later."""
    import asynclock._session._watchdog as watchdog

    real_exchange = watchdog.exchange

    async def slow_to_unwind(client: Redis, packed: bytes, count: int) -> list[object]:
        try:
            return await real_exchange(client, packed, count)
        except asyncio.CancelledError:
            await asyncio.sleep(1.0)  # (the cancellation was delivered once)
            raise

    monkeypatch.setattr(watchdog, "exchange", slow_to_unwind)
    client = Redis.from_url(private_server.url)
    renewed = asyncio.Event()

    def on_event(event: asynclock.LeaseEvent) -> None:
        if event.kind is LeaseEventKind.RENEWED:
            renewed.set()

    late: list[float] = []
    try:
        with pytest.raises(LockLost) as caught:
            async with asynclock.lease(
                client, "unwind", ttl=0.6, prefix=prefix, release_timeout=0.2, on_event=on_event
            ) as lock:
                await renewed.wait()
                private_server.pause()
                try:
                    await anyio.sleep_forever()
                finally:
                    late.append(asyncio.get_running_loop().time() - lock.safe_until)
    finally:
        private_server.resume()
        await client.aclose()
    assert caught.value.reason is LossReason.DEADLINE
    assert 0 <= late[0] < 0.3


async def test_a_stray_cancellation_of_a_renewal_leaves_no_lease_unwatched(
    redis: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
):
    """A renewal whose task is cancelled by anything but the watchdog's own closing (a
    cancellation that escaped its time limit, say) is a failed attempt: retried, and
    the lease is lost at its deadline if none gets through, never left unwatched."""
    from asynclock._session._watchdog import Watchdog

    attempts = 0

    async def cancelled(self: Watchdog, batch: Any) -> Any:
        nonlocal attempts
        attempts += 1
        raise asyncio.CancelledError

    monkeypatch.setattr(Watchdog, "_send", cancelled)
    with pytest.raises(LockLost) as caught:
        async with asyncio.timeout(5):
            async with asynclock.lease(redis, "stray", ttl=0.6, prefix=prefix) as lock:
                await anyio.sleep_forever()
    assert caught.value.reason is LossReason.DEADLINE
    assert attempts >= 2  # retried, not given up
    assert lock.state is LeaseState.LOST


async def test_a_watchdog_bug_is_a_loss_not_silence(
    redis: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
):
    """A watchdog that dies of a bug ends the lease (watchdog_failed) instead of leaving
    it unrenewed while the body runs on."""
    from asynclock._session._watchdog import Watchdog

    async def broken(self: Watchdog, batch: Any) -> Any:
        raise RuntimeError("a bug in the watchdog")

    monkeypatch.setattr(Watchdog, "_send", broken)
    with pytest.raises(LockLost) as caught:
        async with asynclock.lease(redis, "buggy", ttl=0.3, prefix=prefix):
            await anyio.sleep_forever()
    assert caught.value.reason is LossReason.WATCHDOG_FAILED
    assert isinstance(caught.value.__cause__, RuntimeError)


async def test_a_burst_larger_than_the_pool_queues_instead_of_failing(
    redis_server: Any, make_client: Any, prefix: str
):
    """1,000 leases acquired at once through a pool capped at 100 connections (which
    raises when full) all succeed: the overflow queues on asynclock's own small pool."""
    from asynclock.testing import keys_left

    client: Redis = make_client(redis_server.url, max_connections=100)
    inside = 0
    all_in = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal inside
        async with asynclock.lease(client, f"burst{i}", ttl=5, prefix=prefix, blocking=False):
            inside += 1
            if inside == 1000:
                all_in.set()
            await all_in.wait()

    async with asyncio.timeout(30):
        await asyncio.gather(*(one(i) for i in range(1000)))
    assert inside == 1000
    assert await keys_left(client, prefix) == []


async def test_a_lost_release_reply_is_not_reported_as_a_loss(
    private_server: RedisServer, prefix: str
):
    """The release ran but its reply was lost: the retry finds the key gone, which proves
    nothing (the first attempt deleted it), so the finished block does not raise LockLost."""
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        try:
            async with asynclock.lease(client, "done", ttl=10, prefix=prefix) as lock:
                proxy.reset_on_next_reply()  # the release's reply
            assert lock.state is LeaseState.RELEASED
            assert await observer.exists(lock.key) == 0
        finally:
            await client.aclose()
            await observer.aclose()


async def test_a_key_gone_before_the_release_raises_lock_lost(client: Redis, prefix: str):
    """A key deleted while the block ran, found gone by the release well before the safe
    deadline: the work may have overlapped another holder, so the exit raises
    ``LockLost(not_owner)`` (the watchdog, renewing every 10 s, had not noticed)."""
    with pytest.raises(LockLost) as caught:
        async with asynclock.lease(client, "vanished", ttl=30, prefix=prefix) as lock:
            await client.delete(lock.key)
    assert caught.value.reason is LossReason.NOT_OWNER
    assert lock.state is LeaseState.LOST


async def test_a_release_answered_after_the_deadline_proves_no_loss(
    private_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
):
    """The block finished before its safe deadline, but the release reached Redis only after
    the key had expired by its TTL (renewals were failing). Finding the key gone then proves
    nothing about the work, which was done in time: no ``LockLost``. The release's reply came
    after the deadline, which is what tells this apart from a key gone early. (Margins: the
    loop may stall up to 0.6 s before the exit, the release lands 0.6 s after the expiry.)"""
    import asynclock._session._watchdog as watchdog
    from asynclock.testing import ProxyMode

    async def failing(target: Any, packed: bytes, count: int) -> list[object]:
        raise RedisConnectionError("renewals cut (test)")

    monkeypatch.setattr(watchdog, "exchange", failing)
    events: list[asynclock.LeaseEvent] = []
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        try:
            async with asynclock.lease(
                client, "late", ttl=2, prefix=prefix, release_timeout=5, on_event=events.append
            ) as lock:
                await anyio.sleep(lock.time_left - 0.6)  # the block ends 0.6 s before it
                assert lock.state is LeaseState.SUSPECT
                proxy.set_mode(ProxyMode.DELAY, direction="upstream", delay=1.2)
                t_exit = asyncio.get_running_loop().time()
            t_done = asyncio.get_running_loop().time()
            assert t_exit < lock.safe_until < t_done  # sent before the deadline, answered after
            assert lock.state is LeaseState.RELEASED
            assert lock.lost_reason is None
            kinds = {e.kind for e in events}
            assert LeaseEventKind.LOST not in kinds
            # the release found the key gone (neither released nor failed: expired)
            assert not kinds & {LeaseEventKind.RELEASED, LeaseEventKind.RELEASE_FAILED}
            assert await observer.exists(lock.key) == 0
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await client.aclose()
            await observer.aclose()


async def test_a_block_that_overruns_its_deadline_without_awaiting_raises_lock_lost(
    client: Redis, prefix: str, caplog: pytest.LogCaptureFixture
):
    """A body whose last stretch blocks past the safe deadline, with no await for the
    deadline's timer to land in, did not finish in time: ``LockLost(deadline)`` on exit, the
    stall logged, and the key still released if it was ours."""
    ttl = 0.3
    with caplog.at_level(logging.WARNING, logger="asynclock"), pytest.raises(LockLost) as caught:
        async with asynclock.lease(client, "overrun", ttl=ttl, prefix=prefix) as lock:
            time.sleep(ttl + 0.15)  # noqa: ASYNC251 - the overrun under test
    assert caught.value.reason is LossReason.DEADLINE
    assert lock.state is LeaseState.LOST
    assert any("stall" in r.getMessage() for r in caplog.records)
    assert await client.exists(lock.key) == 0


@pytest.mark.parametrize("call", ["is_held", "extend"])
async def test_a_check_that_finds_the_key_released_under_it_is_no_loss(
    client: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, call: str
):
    """A task that outlives the block asks ``is_held(verify=True)`` or ``extend()`` while
    the release is in flight, and its command lands after the release's delete: it finds
    the key gone, which is the release's own doing, not a loss. (The wrapped release makes
    that order certain: the check runs after the release script has answered.)"""
    import asynclock._lifecycle._release as release_module

    real_release = release_module._send_release
    answers: list[object] = []

    async def release_then_check(held: asynclock.Lease, **kwargs: Any) -> object:
        outcome = await real_release(held, **kwargs)
        if call == "is_held":
            answers.append(await held.is_held(verify=True))
        else:
            try:
                await held.extend()
            except (LockLost, RuntimeError) as exc:
                answers.append(exc)
        return outcome

    monkeypatch.setattr(release_module, "_send_release", release_then_check)
    events: list[asynclock.LeaseEvent] = []
    async with asynclock.lease(
        client, "checked", ttl=30, prefix=prefix, on_event=events.append
    ) as lock:
        pass
    assert len(answers) == 1
    if call == "is_held":
        assert answers == [False]
    else:  # a lease being given back is not renewed: a misuse, not a loss
        assert type(answers[0]) is RuntimeError
    assert lock.state is LeaseState.RELEASED
    assert lock.lost_reason is None
    assert [e.kind for e in events][-1] is LeaseEventKind.RELEASED
    assert await client.exists(lock.key) == 0


async def test_a_cleanup_tried_again_ends_by_its_bound_and_its_cancellation():
    """``persisting`` (releases and undos sent again while Redis is silent): it stops at
    its deadline with ``TimeoutError``; a try that hangs is given half the time left, and
    the next try is made; a refused password is raised at once; and a
    cancellation that redis-py turned into a connection error (see ``cancel_dropped``) is
    raised as one, not tried again until the bound."""
    from redis.exceptions import AuthenticationError

    from asynclock._redis._scripts import persisting

    loop = asyncio.get_running_loop()
    calls = 0

    async def silent() -> None:
        nonlocal calls
        calls += 1
        raise RedisConnectionError("refused (test)")

    started = loop.time()
    with pytest.raises(TimeoutError):
        await persisting(silent, "silent", started + 0.3)
    assert 0.25 < loop.time() - started < 1.5
    assert 3 <= calls <= 6  # (50, 100, 200 ms pauses: no busy loop)

    hung = 0

    async def hangs_once() -> str:
        nonlocal hung
        hung += 1
        if hung == 1:
            await asyncio.sleep(30)  # (a connect that never completes)
        return "answered"

    started = loop.time()
    assert await persisting(hangs_once, "hangs once", started + 2) == "answered"
    assert 0.9 < loop.time() - started < 1.5  # (the hung try was given half the time)

    async def refused() -> None:
        raise AuthenticationError("invalid password (test)")

    started = loop.time()
    with pytest.raises(AuthenticationError):
        await persisting(refused, "refused", started + 5)
    assert loop.time() - started < 0.1

    async def swallowing() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # (as a timeout landing mid-call would)
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise RedisConnectionError("write interrupted (test)") from None

    async def run() -> None:
        await persisting(swallowing, "swallowing", loop.time() + 5)

    task = asyncio.create_task(run())
    started = loop.time()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert loop.time() - started < 0.5
