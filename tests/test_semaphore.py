"""Semaphores: ``lease(redis, name, limit=N)`` holds one of N permits (issue 20, B).

Each permit is a lease of its own key: renewed, lost, cancelled and released as any
lease; a free one is found in the semaphore's index (issue 29). Tests across clients and
processes, with a SIGKILLed holder, a deleted permit, a deleted index, cancellations in
flight, retried and undone attempts, and conflicting limits.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import Monitor, wait_until
from redis.asyncio import Redis

import asynclock
from asynclock import LeaseEventKind, LimitConflict, LockBusy, LockLost, LossReason
from asynclock._redis._scripts import SEMAPHORE_ABANDON, SEMAPHORE_ACQUIRE

ROOT = Path(__file__).resolve().parent.parent


async def test_the_limit_is_reached_and_never_exceeded(
    redis_server: object, make_client: Callable[..., Redis], prefix: str
) -> None:
    """12 tasks over 3 clients (bytes and str replies) share 3 permits: at most 3 inside
    at once, 3 reached, every fencing token distinct (one counter per name: a permit's
    token is greater than every token minted before it)."""
    clients = [make_client(), make_client(decode_responses=True), make_client()]
    inside = 0
    most = 0
    tokens: list[int] = []

    async def worker(index: int) -> None:
        nonlocal inside, most
        for _ in range(6):
            async with asynclock.lease(
                clients[index % 3], "api", limit=3, ttl=5, prefix=prefix
            ) as held:
                inside += 1
                most = max(most, inside)
                tokens.append(held.fencing_token)
                await asyncio.sleep(random.uniform(0, 0.01))
                inside -= 1

    await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(12))), 60)
    assert most == 3
    assert len(tokens) == 72
    assert len(set(tokens)) == len(tokens)
    permits = [f"{prefix}{{api}}:permit:{i}" for i in range(3)]
    assert not await clients[0].exists(*permits)  # every permit given back


_WORKER = """
import asyncio, json, sys, random
from redis.asyncio import Redis
import asynclock

async def main(url, prefix, rounds):
    redis = Redis.from_url(url)
    most = 0
    for _ in range(rounds):
        async with asynclock.lease(redis, "shared", limit=2, ttl=2, prefix=prefix):
            now = await redis.incr(prefix + "inside")
            most = max(most, now)
            await asyncio.sleep(random.uniform(0.002, 0.02))
            await redis.decr(prefix + "inside")
    await redis.aclose()
    print(json.dumps({"most": most}))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


async def test_processes_share_the_permits(redis_server: object, prefix: str) -> None:
    """Four processes, 15 rounds each, limit 2: a shared counter of holders never
    passes 2, and reaches it."""
    url = redis_server.url  # type: ignore[attr-defined]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _WORKER,
            url,
            prefix,
            "15",
            stdout=asyncio.subprocess.PIPE,
            env=_env(),
        )
        for _ in range(4)
    ]
    outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 90)
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
    most = max(json.loads(out)["most"] for out, _ in outs)
    assert most == 2


_HOLDER = """
import asyncio, sys
from redis.asyncio import Redis
import asynclock

async def main(url, prefix):
    redis = Redis.from_url(url)
    async with asynclock.lease(redis, "killed", limit=2, ttl=1.0, prefix=prefix):
        print("held", flush=True)
        await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_sigkilled_holders_permit_comes_back_after_its_ttl(
    client: Redis, redis_server: object, prefix: str
) -> None:
    """Two permits: ours and a child process's. The child is SIGKILLed; a waiter gets
    its permit once the key expires (ttl 1 s), not while the child lived."""
    url = redis_server.url  # type: ignore[attr-defined]
    async with asynclock.lease(client, "killed", limit=2, ttl=5, prefix=prefix):
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _HOLDER,
            url,
            prefix,
            stdout=asyncio.subprocess.PIPE,
            env=_env(),
        )
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), 30)
            assert line.strip() == b"held"
            with pytest.raises(LockBusy):  # (both permits held, renewed)
                await asynclock.acquire(
                    client, "killed", limit=2, ttl=5, prefix=prefix, blocking=False
                )
            killed_at = time.monotonic()
            child.send_signal(signal.SIGKILL)
            async with asynclock.lease(
                client, "killed", limit=2, ttl=5, prefix=prefix, blocking_timeout=10
            ):
                waited = time.monotonic() - killed_at
        finally:
            if child.returncode is None:
                child.kill()
            await child.wait()
    assert 0.3 < waited < 4.0, waited  # (its ttl was 1 s, renewed every 1/3 s)


async def test_a_lost_permit_cancels_its_holder_only(client: Redis, prefix: str) -> None:
    """The key of one permit is deleted from outside: its holder is cancelled with
    LockLost(not_owner); the other permit's holder goes on."""
    other_done = asyncio.Event()

    async def other() -> None:
        async with asynclock.lease(client, "sem", limit=2, ttl=0.6, prefix=prefix):
            await asyncio.sleep(1.5)  # (several renewals, through the loss next door)
        other_done.set()

    task = asyncio.create_task(other())
    await wait_until(lambda: client.exists(f"{prefix}{{sem}}:permit:0"), what="first permit")
    events: list[asynclock.LeaseEvent] = []
    with pytest.raises(LockLost) as lost:
        async with asynclock.lease(
            client, "sem", limit=2, ttl=0.6, prefix=prefix, on_event=events.append
        ) as held:
            assert held.key == f"{prefix}{{sem}}:permit:1"
            await client.delete(held.key)
            await asyncio.Event().wait()
    assert lost.value.reason is LossReason.NOT_OWNER
    await asyncio.wait_for(task, 10)
    assert other_done.is_set()


async def test_a_release_wakes_a_waiter_of_another_client_at_once(
    redis_server: object, make_client: Callable[..., Redis], prefix: str
) -> None:
    """Both permits held with ttl 30 s: a waiter in another client is woken by the
    release of one (not by the keys' expiry, 30 s away)."""
    a, b = make_client(), make_client()
    first = await asynclock.acquire(a, "wake", limit=2, ttl=30, prefix=prefix)
    second = await asynclock.acquire(a, "wake", limit=2, ttl=30, prefix=prefix)
    entered = asyncio.Event()

    async def waiter() -> None:
        async with asynclock.lease(b, "wake", limit=2, ttl=30, prefix=prefix):
            entered.set()

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.3)  # (it tried, subscribed, and sleeps)
    assert not entered.is_set()
    released = time.monotonic()
    await first.release()
    await asyncio.wait_for(entered.wait(), 5)
    assert time.monotonic() - released < 2.0
    await task
    await second.release()


async def test_cancelled_waiters_and_attempts_leave_no_permit_behind(
    client: Redis, prefix: str
) -> None:
    """Acquires cancelled at random moments (while waiting, while an attempt is in
    flight, right after it): once everything is over, no permit key is left, and a new
    acquire takes one at once."""
    rng = random.Random(20)
    holders = [
        await asynclock.acquire(client, "cancel", limit=2, ttl=5, prefix=prefix) for _ in range(2)
    ]

    async def contender() -> None:
        async with asynclock.lease(client, "cancel", limit=2, ttl=5, prefix=prefix):
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(contender()) for _ in range(6)]
    await asyncio.sleep(0.05)
    await holders[0].release()  # (the line moves while we cancel)
    for task in tasks:
        await asyncio.sleep(rng.uniform(0, 0.004))
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await holders[1].release()
    for _ in range(20):  # and cancellations of attempts in flight, uncontended
        task = asyncio.create_task(contender())
        await asyncio.sleep(rng.uniform(0, 0.002))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    permits = [f"{prefix}{{cancel}}:permit:{i}" for i in range(2)]
    assert not await client.exists(*permits)
    for _ in range(2):
        await asynclock.acquire(client, "cancel", limit=2, ttl=5, prefix=prefix, blocking=False)


async def test_one_name_one_limit(client: Redis, prefix: str) -> None:
    """A permit asked with another limit than the permits held raises LimitConflict (a
    ValueError), as does one asked of a name held as a plain lock."""
    async with asynclock.lease(client, "limits", limit=3, prefix=prefix):
        with pytest.raises(LimitConflict, match="limit=3, not 4") as caught:
            await asynclock.acquire(client, "limits", limit=4, prefix=prefix)
        assert isinstance(caught.value, ValueError)
    async with asynclock.lease(client, "plain", prefix=prefix):
        with pytest.raises(LimitConflict, match="plain lock"):
            await asynclock.acquire(client, "plain", limit=2, prefix=prefix)


@pytest.mark.parametrize("kind", [{}, {"fair": True}, {"shared": True}])
async def test_a_lease_of_limit_1_beside_held_permits_is_refused(
    client: Redis, prefix: str, kind: dict[str, bool]
) -> None:
    """One name, one limit, in both directions: a plain, fair or shared lease asked of a
    name whose permits are held raises LimitConflict (it held the lock beside them
    before), whether it would wait or not, and leaves nothing behind; once no permit is
    held, it takes the lock."""
    name = "mixed-" + "-".join(kind) if kind else "mixed"
    permit = await asynclock.acquire(client, name, limit=2, ttl=5, prefix=prefix)
    for blocking in (False, True):
        with pytest.raises(LimitConflict, match="limit=2, not 1"):
            await asynclock.acquire(client, name, prefix=prefix, blocking=blocking, **kind)
    assert await client.get(f"{prefix}{{{name}}}") is None
    stats = await asynclock.statistics(client, name, prefix=prefix)
    assert stats.permits_in_use == 1
    await permit.release()
    async with asynclock.lease(client, name, prefix=prefix, blocking=False, **kind) as held:
        assert held.fencing_token > permit.fencing_token
        with pytest.raises(LimitConflict, match="plain lock"):
            await asynclock.acquire(client, name, limit=2, prefix=prefix, blocking=False)


async def test_the_limit_lives_as_long_as_its_permits(client: Redis, prefix: str) -> None:
    """The limit is kept while a permit of it may be held: one renewed past the limit's
    own lifetime (fence_ttl from the last acquire), one kept by hold_at_least past it
    (even after another acquire): another limit is refused all along, and statistics()
    says the limit. (The limit expired under held permits: a permit of another limit
    was taken beside them, over the limit, and statistics() said none.)"""
    options = {"ttl": 0.3, "fence_ttl": 0.3, "prefix": prefix}
    async with asynclock.lease(client, "long", limit=2, **options):
        await asyncio.sleep(1)
        with pytest.raises(LimitConflict, match="limit=2, not 3"):
            await asynclock.acquire(client, "long", limit=3, blocking=False, **options)
        assert (await asynclock.statistics(client, "long", prefix=prefix)).limit == 2
    kept = await asynclock.acquire(client, "kept", limit=2, hold_at_least=1.5, **options)
    await kept.release()  # (kept until 1.5 s after its acquisition)
    other = await asynclock.acquire(client, "kept", limit=2, **options)
    await other.release()
    await asyncio.sleep(0.6)
    with pytest.raises(LimitConflict, match="limit=2, not 3"):
        await asynclock.acquire(client, "kept", limit=3, blocking=False, **options)
    stats = await asynclock.statistics(client, "kept", prefix=prefix)
    assert (stats.permits_in_use, stats.limit) == (1, 2)


async def test_another_limit_once_no_permit_is_held(client: Redis, prefix: str) -> None:
    """Once every permit is given back or has expired, a permit asked with another limit
    is granted, and the semaphore holds that limit from then on, counting its slots
    from 0 (a smaller one takes no slot of the old limit above its own). (The old limit
    was refused for fence_ttl, 60 s here, after its last permit.)"""
    held = [await asynclock.acquire(client, "change", limit=3, prefix=prefix) for _ in range(3)]
    for lease in held:
        await lease.release()
    smaller = [
        await asynclock.acquire(client, "change", limit=2, prefix=prefix, blocking=False)
        for _ in range(2)
    ]
    assert sorted(lease.key.rpartition(":")[2] for lease in smaller) == ["0", "1"]
    with pytest.raises(LockBusy):
        await asynclock.acquire(client, "change", limit=2, prefix=prefix, blocking=False)
    with pytest.raises(LimitConflict, match="limit=2, not 4"):
        await asynclock.acquire(client, "change", limit=4, prefix=prefix, blocking=False)
    for lease in smaller:
        await lease.release()
    base = f"{prefix}{{change}}"
    token = "d" * 32  # (a holder that dies: its permit expires)
    keys = [base + ":limit", base + ":fence", f"{base}:void:{token}", base, base + ":permits"]
    assert (await SEMAPHORE_ACQUIRE(client, keys, [token, 200, 60000, 2]))[0] == 1  # type: ignore[index]
    with pytest.raises(LimitConflict, match="limit=2, not 5"):
        await asynclock.acquire(client, "change", limit=5, prefix=prefix, blocking=False)
    await asyncio.sleep(0.3)
    async with asynclock.lease(client, "change", limit=5, prefix=prefix, blocking=False):
        stats = await asynclock.statistics(client, "change", prefix=prefix)
        assert (stats.limit, stats.permits_in_use) == (5, 1)
        await client.delete(base + ":permits")  # (lost: the permit keys still say)
        with pytest.raises(LimitConflict, match="limit=5, not 2"):
            await asynclock.acquire(client, "change", limit=2, prefix=prefix, blocking=False)


async def test_max_hold_bounds_a_permit(client: Redis, prefix: str) -> None:
    """max_hold applies to a permit like any lease: cancelled, LockLost(max_hold)."""
    events: list[asynclock.LeaseEvent] = []
    with pytest.raises(LockLost) as lost:
        async with asynclock.lease(
            client,
            "bounded",
            limit=2,
            ttl=0.3,
            max_hold=0.5,
            prefix=prefix,
            on_event=events.append,
        ):
            await asyncio.Event().wait()
    assert lost.value.reason is LossReason.MAX_HOLD
    assert LeaseEventKind.RELEASED in [e.kind for e in events]


@pytest.mark.parametrize(
    ("limit", "error", "text"),
    [
        (0, ValueError, "limit must be between 1 and 1000"),
        (-2, ValueError, "limit must be between 1 and 1000"),
        (1001, ValueError, "limit must be between 1 and 1000"),
        (True, TypeError, "limit must be an int"),
        (2.0, TypeError, "limit must be an int"),
        ("3", TypeError, "limit must be an int"),
    ],
)
async def test_bad_limits_are_refused_before_any_io(
    limit: object, error: type[Exception], text: str
) -> None:
    nowhere = Redis(host="127.0.0.1", port=1)  # (nothing listens there)
    with pytest.raises(error, match=text):
        asynclock.lease(nowhere, "x", limit=limit)  # type: ignore[arg-type]
    with pytest.raises(error, match=text):
        await asynclock.acquire(nowhere, "x", limit=limit)  # type: ignore[arg-type]
    await nowhere.aclose()


async def test_a_permit_is_found_without_looking_at_the_others(
    redis_server: object, client: Redis, prefix: str
) -> None:
    """300 permits of 300 held: an attempt, a release and the next acquire each run a
    handful of commands inside their script (no scan of the permits), the busy attempt
    says when the first permit expires, and the released slot is the one taken next."""
    url = redis_server.url  # type: ignore[attr-defined]
    held = [
        await asynclock.acquire(client, "big", limit=300, ttl=30, prefix=prefix) for _ in range(300)
    ]
    assert sorted(int(h.key.rpartition(":")[2]) for h in held) == list(range(300))
    stem = f"{prefix}{{big}}"
    async with Monitor(url) as monitor:
        start = await monitor.mark()
        with pytest.raises(LockBusy) as busy:
            await asynclock.acquire(client, "big", limit=300, ttl=30, prefix=prefix, blocking=False)
        assert busy.value.retry_after is not None
        assert 25 < busy.value.retry_after <= 30
        await held[7].release()
        again = await asynclock.acquire(client, "big", limit=300, ttl=30, prefix=prefix)
        end = await monitor.mark()
        inside = [line for line in monitor.lines[start:end] if " lua]" in line and stem in line]
    assert again.key == f"{stem}:permit:7"
    assert len(inside) < 40, inside  # (three scripts; a scan would read 300 keys)
    for lease in [again, *held[:7], *held[8:]]:
        await lease.release()
    assert not await client.exists(*(f"{stem}:permit:{i}" for i in range(300)))
    stats = await asynclock.statistics(client, "big", prefix=prefix)
    assert (stats.permits_in_use, stats.held) == (0, False)


async def test_a_retried_attempt_finds_its_permit_and_an_undone_one_is_gone(
    client: Redis, prefix: str
) -> None:
    """The acquire script sent twice with one token (a reply lost) holds one permit and
    answers the same fencing token and slot; its undo gives the permit back, and the
    attempt arriving after the undo takes nothing."""
    base = f"{prefix}{{retry}}"
    token = "a" * 32
    void = f"{base}:void:{token}"
    keys = [base + ":limit", base + ":fence", void, base, base + ":permits"]
    args = [token, 5000, 50000, 3]
    first = await SEMAPHORE_ACQUIRE(client, keys, args)
    second = await SEMAPHORE_ACQUIRE(client, keys, args)
    assert first == second
    assert first[0] == 1  # type: ignore[index]
    stats = await asynclock.statistics(client, "retry", prefix=prefix)
    assert stats.permits_in_use == 1
    undo = [void, base + ":permits", base]
    assert await SEMAPHORE_ABANDON(client, undo, [token, 10000, base + ":released", "o"]) == 1
    assert (await asynclock.statistics(client, "retry", prefix=prefix)).permits_in_use == 0
    late = await SEMAPHORE_ACQUIRE(client, keys, args)
    assert late[0] == -1  # type: ignore[index]
    assert (await asynclock.statistics(client, "retry", prefix=prefix)).permits_in_use == 0


async def test_a_lost_index_never_gives_a_held_permit_twice(client: Redis, prefix: str) -> None:
    """The semaphore's index deleted from outside while two of three permits are held: a
    new acquire takes the third permit, not a held one, and the next finds all held."""
    held = [
        await asynclock.acquire(client, "lost", limit=3, ttl=30, prefix=prefix) for _ in range(2)
    ]
    await client.delete(f"{prefix}{{lost}}:permits")
    third = await asynclock.acquire(client, "lost", limit=3, ttl=30, prefix=prefix)
    assert third.key not in {h.key for h in held}
    with pytest.raises(LockBusy):
        await asynclock.acquire(client, "lost", limit=3, ttl=30, prefix=prefix, blocking=False)
    for lease in [*held, third]:
        await lease.release()
        assert lease.state is asynclock.LeaseState.RELEASED


async def test_a_retry_after_the_index_was_lost_leaves_the_others_free(
    client: Redis, prefix: str
) -> None:
    """An attempt re-sent (its reply lost) after the index was deleted from outside finds
    its permit, slot 1, and does not put it back alone: the index expires, and the two
    free permits of three are found (slot 0 was passed over for good, and the index
    kept without expiry, when the retry re-created it holding slot 1 alone)."""
    base = f"{prefix}{{relost}}"
    token = "a" * 32
    keys = [base + ":limit", base + ":fence", f"{base}:void:{token}", base, base + ":permits"]
    args = [token, 5000, 50000, 3]
    first = await asynclock.acquire(client, "relost", limit=3, ttl=5, prefix=prefix)
    taken = await SEMAPHORE_ACQUIRE(client, keys, args)
    assert taken[2] == 1  # type: ignore[index]
    await first.release()
    await client.delete(base + ":permits")
    assert await SEMAPHORE_ACQUIRE(client, keys, args) == taken
    others = [
        await asynclock.acquire(client, "relost", limit=3, ttl=5, prefix=prefix, blocking=False)
        for _ in range(2)
    ]
    assert sorted(o.key for o in others) == [base + ":permit:0", base + ":permit:2"]
    assert await client.pttl(base + ":permits") > 0  # (it expires)
    for lease in others:
        await lease.release()


# Waits, inside the server, until 0.1 ms into the millisecond at which KEYS[1] (a permit
# key) expires and KEYS[2]'s slot 0 scores (the later of the two), so that the command
# sent next runs in that millisecond, when the key still lives (it lives while the time is
# not past its expiry). By the server's TIME where it moves inside a script (Redis 7.0);
# else (Valkey: a script's TIME is its start) by the CPU clock, which a spin keeps in step.
_INTO_ITS_LAST_MS = """local ends = math.max(redis.call('PEXPIRETIME', KEYS[1]),
  tonumber(redis.call('ZSCORE', KEYS[2], '0') or 0))  -- (both gone: it came late)
local function us() local t = redis.call('TIME') return t[1] * 1000000 + t[2] end
local start, target = us(), ends * 1000 + 100
local found, os = pcall(function() return os end)
if found and os then
  local c = os.clock()
  while (os.clock() - c) * 1000000 < target - start do end
else
  while us() < target do end
end
return ends
"""


async def test_a_permit_found_in_its_last_millisecond_is_free_right_after(
    client: Redis, prefix: str
) -> None:
    """An attempt that runs in the last millisecond of a permit (its slot's score reached,
    its key not yet expired: PTTL 0) marks the slot held for that millisecond only: the
    busy reply says so, and the permit is taken a moment later. (It scored the slot a
    full ttl ahead: a free permit refused for a ttl.)

    The script that waits for that millisecond spins on the server's clock, or, where
    a script's clock stands still (Valkey), on CPU time, which a loaded machine's
    scheduler lets fall behind the clock: so the test sleeps until 3 ms before it
    first (client and server share this host's clock), and a round that came late
    is tried again."""
    seen = 0
    for round in range(50):  # (until the attempt has run in that millisecond a few times)
        base = f"{prefix}{{last{round}}}"

        def keys(token: str, base: str = base) -> list[str]:
            void = f"{base}:void:{token}"
            return [base + ":limit", base + ":fence", void, base, base + ":permits"]

        holder, seeker, later = "b" * 32, "c" * 32, "d" * 32
        await SEMAPHORE_ACQUIRE(client, keys(holder), [holder, 50, 60000, 1])
        ends = int(await client.pexpiretime(base + ":permit:0"))
        await asyncio.sleep(max(0.0, ends / 1000 - time.time() - 0.003))
        async with client.pipeline(transaction=False) as pipe:  # (one connection, in order)
            pipe.eval(_INTO_ITS_LAST_MS, 2, base + ":permit:0", base + ":permits")
            pipe.evalsha(SEMAPHORE_ACQUIRE.sha, 5, *keys(seeker), seeker, 5000, 60000, 1)
            _, reply = await pipe.execute()
        status, pttl, *_ = (int(x) for x in reply)
        if status == 1:  # (it ran a millisecond late: the key had expired)
            continue
        seen += 1
        assert (status, pttl) in [(0, 1), (0, 2)]
        await asyncio.sleep(0.01)
        taken = await SEMAPHORE_ACQUIRE(client, keys(later), [later, 5000, 60000, 1])
        assert taken[0] == 1  # type: ignore[index]
        if seen == 3:
            break
    assert seen > 0


async def test_the_index_goes_with_the_last_permit(client: Redis, prefix: str) -> None:
    """Permits taken and given back, then one left to expire (its holder gone): the
    index expires with it, and the semaphore starts again from slot 0."""
    for _ in range(3):
        async with asynclock.lease(client, "gone", limit=4, ttl=0.3, prefix=prefix):
            pass
    index = f"{prefix}{{gone}}:permits"
    assert 0 < await client.pttl(index) <= 300
    await wait_until(lambda: _missing(client, index), what="the index to expire")
    async with asynclock.lease(client, "gone", limit=4, ttl=0.3, prefix=prefix) as held:
        assert held.key.endswith(":permit:0")


async def _missing(client: Redis, key: str) -> bool:
    return not await client.exists(key)


async def test_hold_at_least_keeps_a_released_permit(client: Redis, prefix: str) -> None:
    """Permits released before ``hold_at_least`` stay taken until it has passed, then
    are taken again (their slots' scores say so, not only their keys)."""
    held = [
        await asynclock.acquire(client, "kept", limit=2, ttl=5, hold_at_least=0.5, prefix=prefix)
        for _ in range(2)
    ]
    for lease in held:
        await lease.release()
    with pytest.raises(LockBusy):
        await asynclock.acquire(client, "kept", limit=2, ttl=5, prefix=prefix, blocking=False)
    stats = await asynclock.statistics(client, "kept", prefix=prefix)
    assert stats.permits_in_use == 2
    again = await asynclock.acquire(
        client, "kept", limit=2, ttl=5, prefix=prefix, blocking_timeout=5
    )
    assert again.key in {h.key for h in held}
    await again.release()
