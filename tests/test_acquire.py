"""``await acquire(...)``: a lease held without a task of the caller's until ``release()``,
with ``guard()`` for the stretches of work that must stop when it is lost."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest
from helpers import StoppedServerProbe, commandstat, wait_until
from redis.asyncio import Redis

import asynclock
from asynclock import LeaseEventKind, LeaseState, LockBusy, LockLost, LossReason
from asynclock._session._connections import companion_for
from asynclock.testing import FaultProxy, ProxyMode, RedisServer


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def test_acquired_lease_is_renewed_until_released(client: Redis, prefix: str):
    """The key holds token and fence; renewals keep a 1 s lease for 2.5 s with no task
    of the caller's; a rival is refused; release() deletes the key, and again is a no-op."""
    ttl = 1.0
    lock = await asynclock.acquire(client, "held", ttl=ttl, prefix=prefix)
    assert lock.state is LeaseState.HELD
    assert text(await client.get(lock.key)) == f"{lock.token}:{lock.fencing_token}"
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        with pytest.raises(LockBusy):
            async with asynclock.lease(client, "held", ttl=5, prefix=prefix, blocking=False):
                pass
        assert 0 < await client.pttl(lock.key) <= ttl * 1000
        await asyncio.sleep(0.1)
    assert lock.state is LeaseState.HELD
    assert await lock.is_held(verify=True)
    await lock.release()
    assert lock.state is LeaseState.RELEASED
    assert await client.exists(lock.key) == 0
    await lock.release()  # calling again does nothing more
    assert not await lock.is_held()


async def test_release_wakes_a_waiter_at_once(client: Redis, make_client: Any, prefix: str):
    """A waiter of another client takes the lock right after release(), not at the TTL."""
    other = make_client()
    lock = await asynclock.acquire(client, "handed", ttl=30, prefix=prefix)
    taken = asyncio.Event()

    async def waiter() -> None:
        async with asynclock.lease(other, "handed", ttl=30, prefix=prefix):
            taken.set()

    async def subscribed() -> bool:
        return f"{prefix}{{handed}}:released" in companion_for(other).room._confirmed

    task = asyncio.create_task(waiter())
    await wait_until(subscribed, what="the waiter's subscription")
    assert not taken.is_set()
    started = time.monotonic()
    await lock.release()
    with anyio.fail_after(1.0):
        await taken.wait()
    assert time.monotonic() - started < 1.0
    await task


@pytest.mark.parametrize("how", ["delete", "overwrite"])
async def test_loss_cancels_every_open_guard_and_its_tasks(client: Redis, prefix: str, how: str):
    """A loss cancels the open guards of two tasks and their task groups' tasks; each
    guard raises one LockLost; release() reports the loss and never deletes a foreign key."""
    lock = await asynclock.acquire(client, "guarded", ttl=0.9, prefix=prefix)
    cancelled: list[str] = []
    raised: list[BaseException] = []
    opened = 0
    both_open = asyncio.Event()

    async def sleeper(tag: str) -> None:
        try:
            await anyio.sleep_forever()
        except BaseException:
            cancelled.append(tag)
            raise

    async def worker(tag: str) -> None:
        nonlocal opened
        try:
            async with lock.guard(), anyio.create_task_group() as tg:
                tg.start_soon(sleeper, tag + "-child")
                opened += 1
                if opened == 2:
                    both_open.set()
                await sleeper(tag)
        except BaseException as exc:
            raised.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker, "a")
        tg.start_soon(worker, "b")
        await both_open.wait()
        removed_at = time.monotonic()
        if how == "delete":
            await client.delete(lock.key)
        else:
            await client.set(lock.key, "someone-else", px=60_000)
    detected = time.monotonic() - removed_at
    assert sorted(cancelled) == ["a", "a-child", "b", "b-child"]
    assert [type(exc) for exc in raised] == [LockLost, LockLost]
    assert all(exc.reason is LossReason.NOT_OWNER for exc in raised)  # type: ignore[attr-defined]
    assert detected < 0.9 / 3 + 0.5, detected
    assert lock.state is LeaseState.LOST
    with pytest.raises(LockLost):
        await lock.release()
    with pytest.raises(LockLost):
        await lock.release()  # again: the same answer
    if how == "overwrite":
        assert text(await client.get(lock.key)) == "someone-else"
    else:
        assert await client.exists(lock.key) == 0


async def test_guard_outside_the_lease_s_life_is_refused(client: Redis, prefix: str):
    """guard() on a lost lease raises LockLost at entry; on a released one, RuntimeError;
    on a block's lease, RuntimeError; release() with a guard open or of a block's lease,
    RuntimeError, before any I/O."""
    lock = await asynclock.acquire(client, "refused", ttl=30, prefix=prefix)
    async with lock.guard():
        with pytest.raises(RuntimeError, match="guard"):
            await lock.release()
        assert await client.exists(lock.key) == 1
    guard = lock.guard()
    async with guard:
        pass
    with pytest.raises(RuntimeError, match="once"):
        await guard.__aenter__()
    await lock.release()
    with pytest.raises(RuntimeError, match="released"):
        async with lock.guard():
            pass

    gone = asyncio.Event()
    lost = await asynclock.acquire(
        client,
        "lost",
        ttl=0.6,
        prefix=prefix,
        on_event=lambda e: gone.set() if e.kind is LeaseEventKind.LOST else None,
    )
    await client.delete(lost.key)
    with anyio.fail_after(2.0):
        await gone.wait()
    ran = False
    with pytest.raises(LockLost):
        async with lost.guard():
            ran = True
    assert not ran
    with pytest.raises(LockLost):
        await lost.release()

    async with asynclock.lease(client, "block", ttl=30, prefix=prefix) as block:
        with pytest.raises(RuntimeError, match="async with"):
            await block.release()
        with pytest.raises(RuntimeError, match="guarded already"):
            async with block.guard():
                pass
        assert await client.exists(block.key) == 1


async def test_guarded_code_keeps_its_own_error(client: Redis, prefix: str):
    """Guarded code that fails while the lease is being lost raises its own error, with a
    note (also through release() in a finally); code that fails while the lease is held
    raises it plain and keeps the lease."""
    lock = await asynclock.acquire(client, "errors", ttl=0.6, prefix=prefix)
    with pytest.raises(ValueError, match="plain") as plain:
        async with lock.guard():
            raise ValueError("plain")
    assert not getattr(plain.value, "__notes__", [])
    assert lock.state is LeaseState.HELD
    with pytest.raises(KeyError) as caught:  # the README's pattern: release() in finally
        try:
            async with lock.guard():
                await client.delete(lock.key)
                try:
                    await anyio.sleep_forever()
                finally:
                    raise KeyError("cleanup failed")
        finally:
            await lock.release()  # LockLost would mask the KeyError: a note instead
    notes = getattr(caught.value, "__notes__", [])
    assert len([note for note in notes if "lost" in note]) == 1, notes  # said once
    assert lock.state is LeaseState.LOST
    with pytest.raises(LockLost):
        await lock.release()  # with no exception in flight, the loss is raised


async def test_stopped_server_stops_the_guard_before_the_key_can_expire(
    private_server: RedisServer, prefix: str
):
    """SIGSTOP: the open guard is cancelled by the deadline before the key's expiry (read
    with the server's clock), while the server is still stopped; release() then reports
    LockLost(deadline) within its bound."""
    ttl = 3.0
    client = Redis.from_url(private_server.url)
    observer = Redis.from_url(private_server.url)
    probe = StoppedServerProbe(private_server, observer)
    try:
        lock = await asynclock.acquire(
            client, "paused", ttl=ttl, prefix=prefix, on_event=probe.on_event, release_timeout=0.3
        )
        with pytest.raises(LockLost) as caught:
            async with lock.guard():
                await probe.stop_and_wait(lock.key)
        elapsed = time.monotonic() - probe.paused_at
        assert caught.value.reason is LossReason.DEADLINE
        started = time.monotonic()
        with pytest.raises(LockLost):
            await lock.release()
        assert time.monotonic() - started < 0.3 + 1.0
    finally:
        private_server.resume()
        await client.aclose()
        await observer.aclose()
    assert probe.cancelled_at_ms is not None, "the guard was not cancelled"
    assert probe.expires_at_ms - probe.cancelled_at_ms > 0, "cancelled after the key could expire"
    assert elapsed < ttl + 1.0, elapsed


async def test_release_survives_cancellation_in_flight(private_server: RedisServer, prefix: str):
    """A cancellation that lands while release() waits on Redis does not stop it."""
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        try:
            lock = await asynclock.acquire(client, "slow-release", ttl=30, prefix=prefix)
            proxy.set_mode(ProxyMode.DELAY, delay=0.2)
            task = asyncio.create_task(lock.release())
            await asyncio.sleep(0.05)  # the release is waiting on the delayed reply
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - started >= 0.1  # the release was waited for
            assert await observer.exists(lock.key) == 0
            assert lock.state is LeaseState.RELEASED
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await client.aclose()
            await observer.aclose()


async def test_cancelled_acquire_leaves_no_key(client: Redis, make_client: Any, prefix: str):
    """acquire() cancelled after 0 to 150 loop steps, on a free lock and on one held by
    another client: no key of the cancelled attempt is left, a completed one is released,
    and no waiter is left in line. On the free lock, cancellations land both in flight and
    (too late to cancel) after the grant."""
    holder_client = make_client()
    holder = await asynclock.acquire(holder_client, "taken", ttl=60, prefix=prefix)
    holder_value = f"{holder.token}:{holder.fencing_token}"
    outcomes = {"cancelled": 0, "acquired": 0, "free lock in flight": 0}
    for steps in [*range(40), *range(40, 150, 5)]:
        for name in ("free", "taken"):
            task = asyncio.create_task(asynclock.acquire(client, name, ttl=30, prefix=prefix))
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            try:
                lock = await task
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
                if name == "free":
                    outcomes["free lock in flight"] += 1
            else:
                outcomes["acquired"] += 1
                await lock.release()
            assert await client.get(prefix + "{free}") is None
            assert text(await client.get(prefix + "{taken}")) == holder_value
            assert not companion_for(client).room._lines
    await asyncio.sleep(0.3)  # an abandoned attempt still on its way must not land
    assert await client.get(prefix + "{free}") is None
    assert outcomes["cancelled"] >= 20, outcomes
    assert outcomes["acquired"] >= 10, outcomes
    assert outcomes["free lock in flight"] >= 3, outcomes
    await holder.release()


async def test_bad_input_raises_before_io() -> None:
    """acquire() validates its arguments as lease() does, before any I/O."""
    unreachable = Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    try:
        with pytest.raises(ValueError, match="ttl"):
            await asynclock.acquire(unreachable, "job", ttl=0)
        with pytest.raises(TypeError, match="name"):
            await asynclock.acquire(unreachable, 42)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="on_event"):
            await asynclock.acquire(unreachable, "job", on_event="print")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="redis"):
            await asynclock.acquire(object(), "job")  # type: ignore[arg-type]
    finally:
        await unreachable.aclose()


async def test_many_acquired_leases_held_and_released(client: Redis, prefix: str):
    """200 leases of one client are all kept alive by coalesced renewals and released."""
    renewals: dict[str, int] = {}
    renewed_twice = asyncio.Event()

    def count(event: asynclock.LeaseEvent) -> None:
        if event.kind is LeaseEventKind.RENEWED:
            renewals[event.name] = renewals.get(event.name, 0) + 1
            if len(renewals) == 200 and min(renewals.values()) >= 2:
                renewed_twice.set()

    # (ttl 1.5 s: renewals every 0.5 s leave room for a machine busy with other tests)
    leases = await asyncio.gather(
        *(
            asynclock.acquire(client, f"many-{i}", ttl=1.5, prefix=prefix, on_event=count)
            for i in range(200)
        )
    )
    try:
        with anyio.fail_after(10.0):
            await renewed_twice.wait()
        assert all(lease.state is LeaseState.HELD for lease in leases)
        assert await client.exists(*(lease.key for lease in leases)) == 200
    finally:  # (released even when it fails: no watchdog left to the next test)
        await asyncio.gather(*(lease.release() for lease in leases), return_exceptions=True)
    assert await client.exists(*(lease.key for lease in leases)) == 0


async def test_release_never_deletes_a_foreign_key(client: Redis, prefix: str):
    """A key taken over before any renewal noticed: release() raises LockLost(not_owner)
    and leaves the other holder's value alone."""
    lock = await asynclock.acquire(client, "foreign", ttl=30, prefix=prefix)
    await client.set(lock.key, "someone-else", px=60_000)
    with pytest.raises(LockLost) as caught:
        await lock.release()
    assert caught.value.reason is LossReason.NOT_OWNER
    assert text(await client.get(lock.key)) == "someone-else"


@pytest.mark.parametrize("overwrite", [False, True])
async def test_concurrent_releases_wait_for_the_first(client: Redis, prefix: str, overwrite: bool):
    """A second release() while the first is in flight returns only once the key is given
    back, and answers as the first did (LockLost for both when the key was not ours)."""
    lock = await asynclock.acquire(client, "twice", ttl=30, prefix=prefix)
    if overwrite:
        await client.set(lock.key, "someone-else", px=60_000)

    async def second() -> int:
        await lock.release()
        return int(await client.exists(lock.key))

    first, then = await asyncio.gather(lock.release(), second(), return_exceptions=True)
    if overwrite:
        assert type(first) is LockLost
        assert type(then) is LockLost
        assert text(await client.get(lock.key)) == "someone-else"
    else:
        assert (first, then) == (None, 0)
    assert lock.state is (LeaseState.LOST if overwrite else LeaseState.RELEASED)


async def test_a_guard_cancelled_by_its_caller_is_no_loss(client: Redis, prefix: str):
    """The caller's own timeout or cancel scope around a guard stops it as usual: no
    LockLost, and the lease stays held."""
    lock = await asynclock.acquire(client, "timeouts", ttl=30, prefix=prefix)
    with anyio.move_on_after(0.05) as scope:
        async with lock.guard():
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05), lock.guard():
            await anyio.sleep_forever()
    assert lock.state is LeaseState.HELD
    assert await lock.is_held(verify=True)
    await lock.release()
    assert await client.exists(lock.key) == 0


async def test_a_guard_that_overruns_the_deadline_without_awaiting(client: Redis, prefix: str):
    """Work that blocks the loop past the deadline cannot be cancelled; the guard's exit
    raises LockLost(deadline), another open guard is cancelled, release() reports it."""
    ttl = 0.5
    lock = await asynclock.acquire(client, "blocked", ttl=ttl, prefix=prefix)
    other_open = asyncio.Event()
    other_outcome: list[BaseException] = []

    async def other() -> None:
        try:
            async with lock.guard():
                other_open.set()
                await anyio.sleep_forever()
        except BaseException as exc:
            other_outcome.append(exc)

    task = asyncio.create_task(other())
    await other_open.wait()
    with pytest.raises(LockLost) as caught:
        async with lock.guard():
            time.sleep(ttl + 0.15)  # noqa: ASYNC251 - the overrun under test
    await task
    assert caught.value.reason is LossReason.DEADLINE
    assert [type(exc) for exc in other_outcome] == [LockLost]
    with pytest.raises(LockLost):
        await lock.release()


async def test_release_in_a_cancelled_scope_still_gives_the_key_back(client: Redis, prefix: str):
    """release() called inside an anyio scope that is already cancelled still deletes the
    key (it is shielded)."""
    lock = await asynclock.acquire(client, "shielded", ttl=30, prefix=prefix)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await lock.release()
    assert lock.state is LeaseState.RELEASED
    assert await client.exists(lock.key) == 0


async def test_release_hands_the_key_to_a_waiter_of_the_same_client(client: Redis, prefix: str):
    """With a waiter of the same client in line, release() hands it the key in its own
    round trip: the waiter's value is in the key, with a greater fencing token."""
    lock = await asynclock.acquire(client, "handoff", ttl=30, prefix=prefix)
    channel = prefix + "{handoff}:released"
    values: list[str] = []
    fences: list[int] = []

    async def waiter() -> None:
        async with asynclock.lease(client, "handoff", ttl=30, prefix=prefix) as next_:
            values.append(text(await client.get(next_.key)))
            fences.append(next_.fencing_token)
            assert values[0] == f"{next_.token}:{next_.fencing_token}"

    task = asyncio.create_task(waiter())

    async def in_line() -> bool:
        # In line, and its last attempt (made once subscribed, offering its token) has
        # run: no script of the waiter's runs after this but for the release's handoff.
        room = companion_for(client).room
        head = room.head(channel)
        if head is None or room.waiting(channel) != 1:
            return False
        entry = await client.hget(prefix + "{handoff}:waiting", room.origin)
        return entry is not None and f":{head.token}:" in text(entry)

    await wait_until(in_line, what="the waiter in line, its token offered")
    scripts_before = await commandstat(client, "evalsha")
    await lock.release()
    await task
    assert fences[0] > lock.fencing_token
    # one script between the release and the next holder in: the handoff itself (the
    # waiter's release on exit is the second)
    assert await commandstat(client, "evalsha") - scripts_before == 2


async def test_busy_and_timed_out_acquires_leave_nothing(client: Redis, prefix: str):
    """On a held lock, acquire(blocking=False) raises LockBusy and acquire with a
    blocking_timeout raises AcquireTimeout; neither leaves a key, a waiter or a lease to
    release behind."""
    holder = await asynclock.acquire(client, "busy", ttl=30, prefix=prefix)
    with pytest.raises(LockBusy):
        await asynclock.acquire(client, "busy", ttl=30, prefix=prefix, blocking=False)
    started = time.monotonic()
    with pytest.raises(asynclock.AcquireTimeout):
        await asynclock.acquire(client, "busy", ttl=30, prefix=prefix, blocking_timeout=0.2)
    assert 0.2 <= time.monotonic() - started < 2.0
    assert not companion_for(client).room._lines
    assert text(await client.get(holder.key)) == f"{holder.token}:{holder.fencing_token}"
    await holder.release()
    assert await client.exists(holder.key) == 0


# The kinds, each with what makes it busy: (lease() keywords of the holder, of the rival).
_KINDS = {
    "mutex": ({}, {}),
    "semaphore": ({"limit": 2}, {"limit": 2}),
    "shared": ({}, {"shared": True}),
    "fair": ({"fair": True}, {"fair": True}),
}


@pytest.mark.parametrize("kind", list(_KINDS))
@pytest.mark.parametrize("wait", [0.01, 0.3])
async def test_a_timeout_on_a_held_lock_says_it_is_held(
    client: Redis, prefix: str, kind: str, wait: float
):
    """AcquireTimeout on a busy lock says the lock is held and for how long its holder's
    lease runs, whatever the blocking_timeout; it never blames Redis."""
    mine, theirs = _KINDS[kind]
    holders = [
        await asynclock.acquire(client, "held", ttl=30, prefix=prefix, **mine)
        for _ in range(mine.get("limit", 1))
    ]
    with pytest.raises(asynclock.AcquireTimeout) as caught:
        await asynclock.acquire(
            client, "held", ttl=30, prefix=prefix, blocking_timeout=wait, **theirs
        )
    message = str(caught.value)
    assert "held" in message, message
    assert "did not answer" not in message, message
    if kind != "fair":
        assert "s unless renewed" in message, message
    for holder in holders:
        await holder.release()


@pytest.mark.parametrize("kind", list(_KINDS))
async def test_blocking_timeout_zero_is_one_attempt(client: Redis, prefix: str, kind: str):
    """blocking_timeout=0 takes a free lock every time; on a held one it raises
    AcquireTimeout at once, leaving no key, tombstone, registration or waiter behind."""
    mine, theirs = _KINDS[kind]
    for _ in range(20):
        async with asynclock.lease(
            client, "zero", ttl=5, prefix=prefix, blocking_timeout=0, **mine
        ):
            pass
    holders = [
        await asynclock.acquire(client, "zero", ttl=30, prefix=prefix, **mine)
        for _ in range(mine.get("limit", 1))
    ]
    before = sorted(await client.keys(f"{prefix}*"))
    started = time.monotonic()
    with pytest.raises(asynclock.AcquireTimeout) as caught:
        await asynclock.acquire(client, "zero", ttl=30, prefix=prefix, blocking_timeout=0, **theirs)
    assert time.monotonic() - started < 1.0
    assert "held" in str(caught.value)
    assert caught.value.timeout == 0
    assert sorted(await client.keys(f"{prefix}*")) == before
    assert not companion_for(client).room._lines
    for holder in holders:
        await holder.release()


async def test_blocking_timeout_zero_cancelled_mid_flight_leaves_nothing(
    private_server: RedisServer, prefix: str
):
    """A one-attempt acquire cancelled while its script is in flight (the server paused)
    leaves no key once the server answers again."""
    client = Redis.from_url(private_server.url)
    try:
        async with asynclock.lease(client, "warm", ttl=5, prefix=prefix):
            pass
        private_server.pause()
        try:
            task = asyncio.create_task(
                asynclock.acquire(client, "cut", ttl=5, prefix=prefix, blocking_timeout=0)
            )
            await asyncio.sleep(0.05)  # (the attempt is on its way to the paused server)
            task.cancel()
        finally:
            # (the server answers again within the undo's bound, release_timeout: it runs
            # the attempt, then the undo behind it)
            private_server.resume()
        with pytest.raises((asyncio.CancelledError, asynclock.AcquireTimeout)):
            await task

        async def gone() -> bool:
            return await client.exists(f"{prefix}{{cut}}") == 0

        await wait_until(gone, what="the attempt undone")
        assert not companion_for(client).room._lines
    finally:
        await client.aclose()


async def test_extend_racing_the_release_is_no_loss(client: Redis, prefix: str):
    """extend() in flight while release() gives the lease back either renews in time or
    says the lease was released; it never reports a loss that did not happen."""
    outcomes: list[str] = []
    for round_ in range(20):
        lock = await asynclock.acquire(client, f"race-{round_}", ttl=30, prefix=prefix)
        extending = asyncio.create_task(lock.extend())
        await asyncio.sleep(0)  # the renewal is sent
        await lock.release()
        try:
            await extending
        except RuntimeError:
            outcomes.append("released")
        else:
            outcomes.append("renewed")
        assert lock.state is LeaseState.RELEASED
        assert lock.lost_reason is None
        assert await client.exists(lock.key) == 0
    assert "released" in outcomes, outcomes


async def test_release_while_an_exception_is_handled_or_propagates(client: Redis, prefix: str):
    """release() of a lost lease in an except clause notes the loss on the handled error;
    after a guard's LockLost it adds nothing to that LockLost."""
    lock = await asynclock.acquire(client, "handled", ttl=30, prefix=prefix)
    await client.delete(lock.key)
    try:
        raise ValueError("handled")
    except ValueError as handled:
        await lock.release()  # the key is gone: lost, but noted, not raised
        notes = getattr(handled, "__notes__", [])
    assert any("lost (not_owner)" in note for note in notes), notes
    assert lock.lost_reason is LossReason.NOT_OWNER

    lost = await asynclock.acquire(client, "propagates", ttl=0.6, prefix=prefix)
    with pytest.raises(LockLost) as caught:
        try:
            async with lost.guard():
                await client.delete(lost.key)
                await anyio.sleep_forever()
        finally:
            await lost.release()
    assert not getattr(caught.value, "__notes__", [])
