"""The lease core against a real server: acquire, fencing, watchdog, loss, exit.

Numbers in test docstrings refer to the "must hold" list of issue 2.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest
from helpers import Monitor, commandstat, server_checked
from redis.asyncio import Redis

import asynclock
from asynclock import LeaseEventKind, LeaseState, LockLost, LossReason
from asynclock._redis._scripts import _mint_fence
from asynclock.testing import FaultProxy, RedisServer


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- 1. acquire -------------------------------------------------------------------------


async def test_acquire_is_one_script_round_trip(redis_server: Any, client: Redis, prefix: str):
    """1: acquiring sends exactly one command (the script), which sets token and fence."""
    async with asynclock.lease(client, "warm-up", ttl=5, prefix=prefix):
        await server_checked(client)  # (loads the script; no HELLO in the lease below)
    async with Monitor(redis_server.url) as monitor:
        start = await monitor.mark()
        async with asynclock.lease(client, "job", ttl=5, prefix=prefix) as lock:
            end = await monitor.mark()
            assert monitor.client_commands(start, end) == ["EVALSHA"]
            value = text(await client.get(lock.key))
            assert value == f"{lock.token}:{lock.fencing_token}"
            assert int(await client.get(lock.key + ":fence")) == lock.fencing_token
            assert len(lock.token) == 32
            assert 0 < await client.pttl(lock.key) <= 5000
    async with asynclock.lease(client, "job", ttl=5, prefix=prefix) as again:
        assert again.token != lock.token


async def test_lost_acquire_reply_is_retried_as_success(private_server: RedisServer, prefix: str):
    """1: a retry whose first reply was lost finds its own token and succeeds."""
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)  # redis-py retries connection errors by default
        observer = Redis.from_url(private_server.url)
        try:
            await client.ping()  # connection set up: the next reply is the script's
            evalsha_before = await commandstat(observer, "evalsha")
            eval_before = await commandstat(observer, "eval")
            proxy.reset_on_next_reply()
            async with asynclock.lease(client, "job", ttl=5, prefix=prefix) as lock:
                sent = (await commandstat(observer, "evalsha") - evalsha_before) + (
                    await commandstat(observer, "eval") - eval_before
                )
                assert sent >= 2, "the first reply was not lost"
                assert int(await observer.get(lock.key + ":fence")) == lock.fencing_token
                assert text(await observer.get(lock.key)).startswith(lock.token)
            assert await observer.exists(lock.key) == 0
        finally:
            await client.aclose()
            await observer.aclose()


@pytest.mark.parametrize(
    "kind", [{}, {"limit": 3}, {"shared": True}, {"fair": True}], ids=lambda k: str(k) or "mutex"
)
async def test_a_lost_attempt_arriving_after_the_lease_takes_nothing(
    private_server: RedisServer, prefix: str, kind: dict[str, Any]
):
    """An acquire whose first attempt got no answer was granted by its resend: the first
    may still reach Redis, held up on its way, after the lease has ended (here it is
    replayed there). It takes nothing: the acquisition wrote the tombstone of its token
    before handing the lease out, so the lock is free for the next caller rather than
    taken by nobody until its TTL."""
    from asynclock._base._options import LeaseOptions
    from asynclock._lifecycle._context import _kind
    from asynclock._session._connections import companion_for

    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        options = LeaseOptions.cached(client, "late", {"ttl": 5, "prefix": prefix, **kind})
        try:
            await client.ping()  # connection set up: the next reply is the script's
            proxy.reset_on_next_reply()
            async with asynclock.lease(client, "late", ttl=5, prefix=prefix, **kind) as lock:
                token = lock.token  # (sealed: the first reply was lost, the resend granted)
                assert await observer.get(options.void_key(token)) == b"1"
            script, keys, args = _kind(options, companion_for(client), None).attempt(token, None)
            late = await script(observer, keys, args)  # (the first attempt, arriving late)
            assert list(late) == [-1, 0]  # type: ignore[call-overload]
            async with asynclock.lease(
                client, "late", ttl=5, prefix=prefix, blocking=False, **kind
            ):
                pass  # (free: not taken by the late attempt)
        finally:
            await client.aclose()
            await observer.aclose()


async def test_a_lost_attempt_then_a_busy_lock_leaves_a_tombstone(
    private_server: RedisServer, prefix: str
):
    """An attempt whose reply was lost, its resend answered that the lock is held
    (``LockBusy``): the first attempt may still reach Redis after the holder releases;
    the acquisition's undo tombstoned its token, so it then takes nothing."""
    from asynclock._base._options import LeaseOptions
    from asynclock._lifecycle._context import _kind
    from asynclock._session._connections import companion_for

    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        options = LeaseOptions.cached(client, "busy", {"ttl": 5, "prefix": prefix})
        holder = await asynclock.acquire(observer, "busy", ttl=5, prefix=prefix)
        try:
            await client.ping()  # connection set up: the next reply is the script's
            proxy.reset_on_next_reply()
            with pytest.raises(asynclock.LockBusy):
                await asynclock.acquire(client, "busy", ttl=5, prefix=prefix, blocking=False)
            assert not proxy.reset_armed, "no reply was lost"
            (void,) = await observer.keys(options.void_key("*"))
            token = text(void).rsplit(":", 1)[1]
            await holder.release()
            script, keys, args = _kind(options, companion_for(client), None).attempt(token, None)
            assert list(await script(observer, keys, args)) == [-1, 0]  # type: ignore[call-overload]
            assert await observer.exists(options.key) == 0
        finally:
            await holder.release()
            await client.aclose()
            await observer.aclose()


async def test_a_permit_granted_then_cancelled_while_sealed_is_given_back(
    private_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
):
    """A permit granted after a lost reply, its acquisition cancelled while the token's
    tombstone is written (which hides the slot the attempt took): the undo is told the
    slot, and the permit is given back, not left to its TTL."""
    import asynclock._kinds._engine as engine

    sealed = asyncio.Event()
    real = engine.run_idempotent

    async def slow_seal(script: Any, *args: Any, **kwargs: Any) -> object:
        reply = await real(script, *args, **kwargs)
        if script is engine.SEAL:
            sealed.set()
            await asyncio.sleep(30)  # (cut short by the seal's bound)
        return reply

    monkeypatch.setattr(engine, "run_idempotent", slow_seal)
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        try:
            await client.ping()
            proxy.reset_on_next_reply()
            taking = asyncio.create_task(
                asynclock.acquire(client, "sem", limit=3, ttl=30, prefix=prefix)
            )
            async with asyncio.timeout(10):
                await sealed.wait()
            taking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await taking
            assert await observer.keys(f"{prefix}{{sem}}:permit:*") == []
        finally:
            await client.aclose()
            await observer.aclose()


# -- 2. fencing ---------------------------------------------------------------------------


async def test_fencing_tokens_strictly_increase(client: Redis, prefix: str):
    """2: tokens increase across acquisitions, also after the counter key is deleted."""
    tokens = []
    for round_ in range(20):
        async with asynclock.lease(client, "fenced", ttl=5, prefix=prefix) as lock:
            tokens.append(lock.fencing_token)
            if round_ % 5 == 4:
                assert await client.delete(lock.key + ":fence") == 1
    assert tokens == sorted(set(tokens)), tokens
    async with asynclock.lease(client, "fenced", ttl=5, prefix=prefix) as lock:
        await client.set(lock.key + ":fence", 1)  # even a counter rolled back
    async with asynclock.lease(client, "fenced", ttl=5, prefix=prefix) as lock:
        assert lock.fencing_token > tokens[-1]


@pytest.mark.parametrize("micros", ["0", "5", "42", "999", "12345", "999999"])
async def test_fencing_token_text_is_the_server_time_in_microseconds(
    client: Redis, prefix: str, micros: str
):
    """2: the token's text, made from TIME's digits (the microseconds padded to 6), is the
    decimal of the number the scripts compare and return (a TIME reply stands in)."""
    source = (
        "local t = {ARGV[1], ARGV[2]}\nlocal fence\n"
        + _mint_fence("nil")  # (no last token)
        + "return {fence, string.format('%d', fence)}"
    )
    made, number = await client.eval(source, 0, "1764300000", micros)
    assert [text(made), text(number)] == [f"1764300000{int(micros):06d}"] * 2


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        ("1764300000000004", "1764300000000005"),  # as long, the clock not past it: + 1
        ("1764300000000005", "1764300000000006"),  # the clock's own microsecond: + 1
        ("1764299999999999", "1764300000000005"),  # as long and below: the clock's
        ("00001764300000000009", "1764300000000010"),  # longer: read as a number, + 1
        ("999", "1764300000000005"),  # shorter: the clock's
        ("0001764300000000", "1764300000000005"),  # as long, but the number below
        ("not a number at all", "1764300000000005"),  # longer, but no number: ignored
    ],
)
async def test_fencing_token_is_above_the_last_one_compared_as_text_first(
    client: Redis, last: str, expected: str
):
    """2: max(last + 1, server TIME in microseconds), the last token compared as text
    before it is read as a number (a TIME reply of 1764300000.000005 stands in)."""
    source = (
        "local t = {'1764300000', '5'}\nlocal fence\n" + _mint_fence("ARGV[1]") + "return fence"
    )
    assert text(await client.eval(source, 0, last)) == expected


async def test_a_counter_ahead_of_the_clock_gives_the_next_token(client: Redis, prefix: str):
    """2: a counter ahead of the server's clock (set by hand here: a clock stepped back
    does the same) is what the next token follows, for every kind that mints."""
    ahead = time.time_ns() // 1000 + 10**9  # (a quarter of an hour ahead, in microseconds)
    for name, options in (
        ("m", {}),
        ("s", {"limit": 3}),
        ("r", {"shared": True}),
        ("f", {"fair": True}),
    ):
        base = f"{prefix}{{{name}}}"
        await client.set(base + ":fence", ahead)
        async with asynclock.lease(client, name, ttl=5, prefix=prefix, **options) as lock:
            assert lock.fencing_token == ahead + 1, name
            assert int(await client.get(base + ":fence")) == ahead + 1, name


# -- 3. the watchdog --------------------------------------------------------------------


async def test_short_lease_is_kept_by_renewals(client: Redis, make_client: Any, prefix: str):
    """3: ttl=0.3 s held for 3 s is never lost; no rival gets it; PEXPIRE sets, never adds."""
    rival = make_client(decode_responses=True)
    events: list[asynclock.LeaseEvent] = []
    rival_tries = 0
    async with asynclock.lease(
        client, "short", ttl=0.3, prefix=prefix, on_event=events.append
    ) as lock:
        started = time.monotonic()
        while time.monotonic() - started < 3.0:
            assert await lock.is_held()
            with pytest.raises(asynclock.LockBusy):
                async with asynclock.lease(rival, "short", ttl=0.3, prefix=prefix, blocking=False):
                    pass
            rival_tries += 1
            assert 0 < await client.pttl(lock.key) <= 300
            await asyncio.sleep(0.02)
        assert lock.state in (LeaseState.HELD, LeaseState.SUSPECT)
    renewals = [e for e in events if e.kind is LeaseEventKind.RENEWED]
    assert len(renewals) >= 15  # about every 0.1 s
    assert rival_tries >= 20
    assert not [e for e in events if e.kind is LeaseEventKind.LOST]
    assert lock.state is LeaseState.RELEASED


async def test_many_leases_are_renewed_in_bounded_batches(
    client: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
):
    """3: leases due together are renewed together, in batches of at most the batch limit
    (4 here), each lease at most once per batch; every lease keeps being renewed, and one
    leaving early stops only its own renewals. (``test_watchdog`` takes the split of a
    group at the limit step by step.) Waits on renewal counts, not on the clock: a TTL of
    0.9 s lets the loop stall for most of 0.6 s without losing a lease."""
    import asynclock._session._watchdog as watchdog

    monkeypatch.setattr(watchdog, "_BATCH", 4)
    sizes: list[int] = []
    repeated: list[str] = []
    real_exchange = watchdog.exchange

    async def counting(target: Any, packed: bytes, count: int) -> list[object]:
        sizes.append(count)
        repeated.extend(n for n in names if packed.count(f"{{{n}}}".encode()) > 1)
        return await real_exchange(target, packed, count)

    monkeypatch.setattr(watchdog, "exchange", counting)
    names = [f"many-{i}" for i in range(11)]
    renewed = dict.fromkeys(names, 0)
    lost: list[str] = []
    wanted: dict[str, int] = dict.fromkeys(names, 4)  # renewals each, before going on
    enough = asyncio.Event()

    def on_event(event: asynclock.LeaseEvent) -> None:
        if event.kind is LeaseEventKind.RENEWED:
            renewed[event.name] += 1
            if all(renewed[n] >= count for n, count in wanted.items()):
                enough.set()
        elif event.kind is LeaseEventKind.LOST:
            lost.append(event.name)

    leave = {name: asyncio.Event() for name in names}
    left = asyncio.Event()
    entered: list[asynclock.Lease] = []

    async def hold(name: str) -> None:
        async with asynclock.lease(client, name, ttl=0.9, prefix=prefix, on_event=on_event) as lock:
            entered.append(lock)
            await leave[name].wait()
        if name == names[0]:
            left.set()

    async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
        for name in names:
            tg.create_task(hold(name))
        await enough.wait()  # about 1.2 s
        leave[names[0]].set()
        await left.wait()  # released: no renewal of it can be confirmed from here on
        at_leaving = dict(renewed)
        enough.clear()
        wanted = {n: at_leaving[n] + 3 for n in names[1:]}
        await enough.wait()  # about 0.9 s
        for lock in entered:
            if lock.name != names[0]:
                assert lock.state in (LeaseState.HELD, LeaseState.SUSPECT)
                assert 0 < await client.pttl(lock.key) <= 900
        for event in leave.values():
            event.set()
    assert not lost
    assert 1 < max(sizes) <= 4  # together, and split at the limit
    assert not repeated
    assert sum(renewed.values()) <= sum(sizes)  # (a batch in flight at exit goes unconfirmed)
    assert renewed[names[0]] == at_leaving[names[0]]  # nothing renewed after it left


# -- 4. loss from outside ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["delete", "overwrite"])
@pytest.mark.parametrize("group", ["anyio", "asyncio"])
async def test_key_removed_cancels_body_and_its_tasks(
    client: Redis, prefix: str, how: str, group: str
):
    """4: the body and its task group are cancelled within ttl/3 + margin; LockLost."""
    ttl = 0.9
    cancelled: list[str] = []
    removed_at = 0.0

    async def child(tag: str) -> None:
        try:
            await anyio.sleep_forever()
        except BaseException:
            cancelled.append(tag)
            raise

    with pytest.raises(LockLost) as caught:
        async with asynclock.lease(client, "victim", ttl=ttl, prefix=prefix) as lock:
            if group == "anyio":
                async with anyio.create_task_group() as tg:
                    for tag in ("a", "b", "c"):
                        tg.start_soon(child, tag)
                    await anyio.sleep(0.05)
                    removed_at = time.monotonic()
                    if how == "delete":
                        await client.delete(lock.key)
                    else:
                        await client.set(lock.key, "someone-else", px=60_000)
                    await child("body")
            else:
                async with asyncio.TaskGroup() as atg:
                    for tag in ("a", "b", "c"):
                        atg.create_task(child(tag))
                    await asyncio.sleep(0.05)
                    removed_at = time.monotonic()
                    if how == "delete":
                        await client.delete(lock.key)
                    else:
                        await client.set(lock.key, "someone-else", px=60_000)
                    await child("body")
    detected = time.monotonic() - removed_at
    assert caught.value.reason is LossReason.NOT_OWNER
    assert caught.value.name == "victim"
    assert sorted(cancelled) == ["a", "b", "body", "c"]
    assert detected < ttl / 3 + 0.5, detected
    assert lock.state is LeaseState.LOST
    assert lock.lost_reason is LossReason.NOT_OWNER
    assert not await lock.is_held()
    if how == "overwrite":  # release never deletes another holder's key
        assert text(await client.get(lock.key)) == "someone-else"
    else:
        assert await client.exists(lock.key) == 0


async def test_is_held_verify_detects_a_foreign_value(client: Redis, prefix: str):
    """is_held(verify=True) reads the token back and marks the lease lost on a mismatch."""
    with pytest.raises(LockLost):
        async with asynclock.lease(client, "verify", ttl=30, prefix=prefix) as lock:
            assert await lock.is_held(verify=True)
            await client.set(lock.key, "intruder", px=60_000)
            assert await lock.is_held() is True  # the local answer does not know yet
            assert await lock.is_held(verify=True) is False
            await anyio.sleep_forever()  # the block is cancelled here
    assert lock.lost_reason is LossReason.NOT_OWNER
    assert text(await client.get(lock.key)) == "intruder"


async def test_extend_renews_and_reports_loss(client: Redis, prefix: str):
    """extend() renews at once; once the key is gone it raises LockLost."""
    with pytest.raises(LockLost):
        async with asynclock.lease(client, "extend", ttl=10, prefix=prefix) as lock:
            await client.pexpire(lock.key, 2000)
            before = lock.safe_until
            await lock.extend()
            assert lock.safe_until > before
            assert await client.pttl(lock.key) > 5000
            await client.delete(lock.key)
            await lock.extend()
    assert lock.lost_reason is LossReason.NOT_OWNER


# -- 8. exceptions ------------------------------------------------------------------------


async def test_body_exception_propagates_plain(client: Redis, prefix: str):
    """8: the body's own exception comes out as itself, not in an ExceptionGroup."""
    with pytest.raises(ValueError, match="boom") as caught:
        async with asynclock.lease(client, "raiser", ttl=5, prefix=prefix) as lock:
            raise ValueError("boom")
    assert not isinstance(caught.value, BaseExceptionGroup)
    assert lock.state is LeaseState.RELEASED
    assert await client.exists(lock.key) == 0


async def test_loss_does_not_mask_the_body_exception(client: Redis, prefix: str):
    """8: a body that fails while the lease is being lost keeps its own exception."""
    with pytest.raises(KeyError) as caught:
        async with asynclock.lease(client, "masked", ttl=0.6, prefix=prefix) as lock:
            await client.delete(lock.key)
            try:
                await anyio.sleep_forever()
            finally:
                raise KeyError("cleanup failed")
    assert lock.state is LeaseState.LOST
    assert any("lost" in note for note in getattr(caught.value, "__notes__", []))


async def test_loss_is_a_single_lock_lost_not_a_group(client: Redis, prefix: str):
    """8: a loss while several tasks run under the block is one LockLost."""
    with pytest.raises(LockLost) as caught:
        async with asynclock.lease(client, "group", ttl=0.6, prefix=prefix) as lock:  # noqa: SIM117
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(anyio.sleep_forever)
                await client.delete(lock.key)
    assert type(caught.value) is LockLost


# -- 9. release -----------------------------------------------------------------------


async def test_release_survives_cancellation_in_flight(private_server: RedisServer, prefix: str):
    """9: a cancellation that lands while the release is in flight does not stop it."""
    from asynclock.testing import ProxyMode

    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        entered = asyncio.Event()
        key = ""

        async def holder() -> None:
            nonlocal key
            async with asynclock.lease(client, "slow-exit", ttl=30, prefix=prefix) as lock:
                key = lock.key
                proxy.set_mode(ProxyMode.DELAY, delay=0.2)
                entered.set()

        try:
            task = asyncio.create_task(holder())
            await entered.wait()
            started = time.monotonic()
            task.cancel()  # lands inside the release, which is waiting on the delayed reply
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - started >= 0.2  # the release was waited for
            assert await observer.exists(key) == 0
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await client.aclose()
            await observer.aclose()


async def test_release_is_shielded_from_an_outer_anyio_cancel_scope(
    private_server: RedisServer, prefix: str
):
    """9: an enclosing anyio scope cancelled while the release is in flight waits for the
    release (anyio shielding), then its cancellation takes effect as usual."""
    from asynclock.testing import ProxyMode

    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        exited_in_full = False
        started = 0.0
        try:
            with anyio.CancelScope() as outer:
                async with asynclock.lease(client, "outer", ttl=30, prefix=prefix) as lock:
                    proxy.set_mode(ProxyMode.DELAY, delay=0.2)
                    # cancelled from a timer while the release waits on the delayed reply
                    asyncio.get_running_loop().call_later(0.1, outer.cancel)
                exited_in_full = True  # the release was not interrupted by the cancellation
                started = time.monotonic()
                await anyio.sleep(5)  # the outer cancellation lands here, after the release
            assert outer.cancelled_caught
            assert exited_in_full
            assert time.monotonic() - started < 1.0
            assert lock.state is LeaseState.RELEASED
            assert await observer.exists(lock.key) == 0
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await client.aclose()
            await observer.aclose()


async def test_cancelled_body_releases(client: Redis, prefix: str):
    """9: a task cancelled inside the body gives the lock back on the way out."""
    entered = asyncio.Event()

    async def holder() -> None:
        async with asynclock.lease(client, "cancelled", ttl=30, prefix=prefix):
            entered.set()
            await anyio.sleep_forever()

    task = asyncio.create_task(holder())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await client.exists(prefix + "{cancelled}") == 0


async def test_exit_is_bounded_when_server_is_stopped(private_server: RedisServer, prefix: str):
    """9: a stopped server does not hang the exit: after release_timeout the TTL takes over."""
    client = Redis.from_url(private_server.url)
    events: list[asynclock.LeaseEvent] = []
    try:
        async with asynclock.lease(
            client, "stuck", ttl=30, prefix=prefix, release_timeout=0.5, on_event=events.append
        ) as lock:
            private_server.pause()
            started = time.monotonic()
        elapsed = time.monotonic() - started
        assert elapsed < 0.5 + 1.0, elapsed
        assert LeaseEventKind.RELEASE_FAILED in [e.kind for e in events]
    finally:
        private_server.resume()
        await client.aclose()
    observer = Redis.from_url(private_server.url)
    try:
        assert 0 < await observer.pttl(lock.key) <= 30_000  # left to expire by its TTL
    finally:
        await observer.aclose()


# -- 12. two contenders in one process --------------------------------------------------


async def test_tasks_in_one_process_exclude_each_other(client: Redis, prefix: str):
    """12: two tasks contending on one name never hold it at once."""
    inside = 0
    most = 0
    rounds = 0

    async def contender() -> None:
        nonlocal inside, most, rounds
        for _ in range(25):
            async with asynclock.lease(client, "shared", ttl=5, prefix=prefix) as lock:
                inside += 1
                most = max(most, inside)
                assert text(await client.get(lock.key)).startswith(lock.token)
                await asyncio.sleep(0)
                inside -= 1
                rounds += 1

    async with asyncio.timeout(30):
        await asyncio.gather(contender(), contender())
    assert most == 1
    assert rounds == 50


async def test_one_contender_cannot_release_the_other(client: Redis, prefix: str):
    """12: a contender that timed out leaves the holder's key alone."""

    async def contend() -> None:
        async with asynclock.lease(client, "mine", ttl=5, prefix=prefix, blocking_timeout=0.2):
            pass

    async with asynclock.lease(client, "mine", ttl=5, prefix=prefix) as holder:
        with pytest.raises(asynclock.AcquireTimeout):
            await asyncio.create_task(contend())  # (another task: this one holds it)
        assert text(await client.get(holder.key)) == f"{holder.token}:{holder.fencing_token}"
        assert await holder.is_held(verify=True)


async def test_context_manager_is_single_use(client: Redis, prefix: str):
    """A lease() context can be entered once."""
    context = asynclock.lease(client, "once", ttl=5, prefix=prefix)
    async with context:
        pass
    with pytest.raises(RuntimeError, match="once"):
        await context.__aenter__()
    with pytest.raises(RuntimeError, match="already exited"):
        await context.__aexit__(None, None, None)


async def test_repr_shows_state(client: Redis, prefix: str):
    """The repr names the lock, its state, its fence and the time left."""
    async with asynclock.lease(client, "orders:42", ttl=10, prefix=prefix) as lock:
        shown = repr(lock)
        assert shown.startswith("<Lease 'orders:42' HELD fence=")
        assert "s left>" in shown
        assert 9 < lock.time_left <= 10
    assert "RELEASED" in repr(lock)
    assert lock.time_left == 0.0


async def test_state_reads_lost_once_the_deadline_passed_before_its_timer_ran(
    client: Redis, prefix: str
):
    """A stall past the safe deadline: ``state`` and ``lost_reason`` say LOST at once,
    before the loop has run the deadline's timer; the block then ends in LockLost."""
    with pytest.raises(LockLost) as caught:
        async with asynclock.lease(client, "stalled", ttl=0.6, prefix=prefix) as lock:
            assert lock.state is LeaseState.HELD
            time.sleep(0.7)  # noqa: ASYNC251 - the stall under test
            seen = (lock.state, lock.lost_reason)
            await asyncio.sleep(0)
    assert seen == (LeaseState.LOST, LossReason.DEADLINE)
    assert caught.value.reason is LossReason.DEADLINE
    assert lock.state is LeaseState.LOST
