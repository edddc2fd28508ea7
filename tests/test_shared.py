"""Shared (read) leases: ``lease(redis, name, shared=True)`` (issue 20, B).

Shared holders overlap, an exclusive (plain) lease overlaps nobody, a waiting exclusive
lease gets in while shared ones keep coming, and a shared lease is renewed, lost and
released as any lease: across clients and processes, under SIGKILL and cancellation.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from helpers import run_out_of_memory, wait_until
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

import asynclock
from asynclock import LeaseEventKind, LockBusy, LockLost, LossReason
from asynclock._redis._scripts import (
    SHARED_ABANDON,
    SHARED_ACQUIRE,
    SHARED_IS_OURS,
    SHARED_RELEASE,
    SHARED_RENEW,
    Script,
)
from asynclock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent


async def test_shared_holders_overlap_and_an_exclusive_one_overlaps_nobody(
    redis_server: object, make_client: Callable[..., Redis], prefix: str
) -> None:
    """Readers and writers over three clients (one with str replies) for 2 s: readers
    were inside together, and no writer was ever inside with anyone."""
    clients = [make_client(), make_client(decode_responses=True), make_client()]
    readers = writers = 0
    most_readers = 0
    overlaps: list[str] = []
    rounds = {"reader": 0, "writer": 0}
    stop = time.monotonic() + 2.0
    rng = random.Random(7)

    async def reader(index: int) -> None:
        nonlocal readers, most_readers
        while time.monotonic() < stop:
            async with asynclock.lease(
                clients[index % 3], "doc", shared=True, ttl=2, prefix=prefix
            ):
                readers += 1
                most_readers = max(most_readers, readers)
                if writers:
                    overlaps.append("reader beside a writer")
                await asyncio.sleep(rng.uniform(0.005, 0.03))
                readers -= 1
                rounds["reader"] += 1

    async def writer(index: int) -> None:
        nonlocal writers
        while time.monotonic() < stop:
            async with asynclock.lease(clients[index % 3], "doc", ttl=2, prefix=prefix):
                writers += 1
                if writers > 1 or readers:
                    overlaps.append("writer beside another holder")
                await asyncio.sleep(rng.uniform(0.002, 0.01))
                writers -= 1
                rounds["writer"] += 1
            await asyncio.sleep(rng.uniform(0.01, 0.05))

    tasks = [reader(i) for i in range(6)] + [writer(i) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert not overlaps, overlaps[:3]
    assert most_readers >= 2
    assert rounds["reader"], rounds
    assert rounds["writer"], rounds
    assert not await clients[0].exists(prefix + "{doc}", prefix + "{doc}:readers")


async def test_a_waiting_writer_gets_in_while_readers_keep_coming(
    client: Redis, prefix: str
) -> None:
    """Readers arrive every 20 ms, each holding 150 ms, so the lock is never free of
    them; a writer that asks gets in within a bound, not never."""
    stop = asyncio.Event()

    async def read_once() -> None:
        async with asynclock.lease(client, "busy-doc", shared=True, ttl=2, prefix=prefix):
            await asyncio.sleep(0.15)

    async def readers() -> None:
        running: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            task = asyncio.create_task(read_once())
            running.add(task)
            task.add_done_callback(running.discard)
            await asyncio.sleep(0.02)
        await asyncio.gather(*running)

    arrivals = asyncio.create_task(readers())
    await asyncio.sleep(0.3)  # (readers overlap by now)
    asked = time.monotonic()
    async with asynclock.lease(client, "busy-doc", ttl=2, prefix=prefix):
        waited = time.monotonic() - asked
    stop.set()
    await asyncio.wait_for(arrivals, 10)
    assert waited < 1.5, waited  # (the readers inside drain in 0.15 s)


async def test_a_shared_lease_is_renewed_and_lost_as_any_lease(client: Redis, prefix: str) -> None:
    """ttl 0.3 s, held 1 s: renewed, still ours. Its hold (a member of the readers'
    set, beside another reader) removed from outside: its holder is cancelled with
    LockLost(not_owner), the other reader goes on."""
    async with asynclock.lease(client, "renewed", shared=True, ttl=0.3, prefix=prefix) as held:
        await asyncio.sleep(1.0)
        assert await held.is_held(verify=True)
    other_done = asyncio.Event()

    async def other() -> None:
        async with asynclock.lease(client, "lost", shared=True, ttl=0.6, prefix=prefix):
            await asyncio.sleep(1.2)
        other_done.set()

    task = asyncio.create_task(other())
    await asyncio.sleep(0.05)
    with pytest.raises(LockLost) as lost:
        async with asynclock.lease(client, "lost", shared=True, ttl=0.6, prefix=prefix) as held:
            await client.zrem(held.key, f"{held.token}:{held.fencing_token}")
            await asyncio.Event().wait()
    assert lost.value.reason is LossReason.NOT_OWNER
    await asyncio.wait_for(task, 10)
    assert other_done.is_set()


_READER = """
import asyncio, sys
from redis.asyncio import Redis
import asynclock

async def main(url, prefix):
    redis = Redis.from_url(url)
    async with asynclock.lease(redis, "killed", shared=True, ttl=1.0, prefix=prefix):
        print("held", flush=True)
        await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_sigkilled_readers_hold_ends_with_its_ttl(
    client: Redis, redis_server: object, prefix: str
) -> None:
    """A reader process is SIGKILLed: a writer waiting for the lock gets it once the
    reader's TTL (1 s) has run out."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    url = redis_server.url  # type: ignore[attr-defined]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _READER, url, prefix, stdout=asyncio.subprocess.PIPE, env=env
    )
    try:
        assert child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 30)).strip() == b"held"
        with pytest.raises(LockBusy):
            await asynclock.acquire(client, "killed", ttl=5, prefix=prefix, blocking=False)
        killed_at = time.monotonic()
        child.send_signal(signal.SIGKILL)
        async with asynclock.lease(client, "killed", ttl=5, prefix=prefix, blocking_timeout=10):
            waited = time.monotonic() - killed_at
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    assert 0.3 < waited < 4.0, waited


async def test_cancelled_shared_acquires_leave_nothing_behind(client: Redis, prefix: str) -> None:
    """Shared acquires cancelled at random moments, while a writer holds and after it
    left: afterwards no reader is left, and an exclusive lease is taken at once."""
    rng = random.Random(21)

    async def read() -> None:
        async with asynclock.lease(client, "cancel", shared=True, ttl=5, prefix=prefix):
            await asyncio.sleep(0.01)

    writer = await asynclock.acquire(client, "cancel", ttl=5, prefix=prefix)
    waiting = [asyncio.create_task(read()) for _ in range(4)]
    await asyncio.sleep(0.05)
    for task in waiting[:2]:
        task.cancel()
    await writer.release()
    for task in waiting[2:]:
        await asyncio.sleep(rng.uniform(0, 0.003))
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for _ in range(20):
        task = asyncio.create_task(read())
        await asyncio.sleep(rng.uniform(0, 0.002))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: _free(client, prefix), what="the readers gone")
    held = await asynclock.acquire(client, "cancel", ttl=5, prefix=prefix, blocking=False)
    await held.release()


async def _free(client: Redis, prefix: str) -> bool:
    return not await client.exists(prefix + "{cancel}", prefix + "{cancel}:readers")


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"shared": "yes"}, TypeError, "shared must be a bool"),
        ({"shared": True, "limit": 2}, ValueError, "cannot be given with limit"),
        ({"shared": True, "fair": True}, ValueError, "cannot be given with limit, fair"),
        ({"shared": True, "hold_at_least": 1.0}, ValueError, "hold_at_least"),
    ],
)
async def test_bad_shared_arguments_are_refused_before_any_io(
    kwargs: dict[str, object], error: type[Exception], text: str
) -> None:
    nowhere = Redis(host="127.0.0.1", port=1)  # (nothing listens there)
    with pytest.raises(error, match=text):
        asynclock.lease(nowhere, "x", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match=text):
        await asynclock.acquire(nowhere, "x", **kwargs)  # type: ignore[arg-type]
    await nowhere.aclose()


async def test_a_task_holding_a_shared_lease_cannot_take_the_lock_again(
    client: Redis, prefix: str
) -> None:
    """Not re-entrant, as any lease: exclusively it would wait for its own shared hold,
    and shared again it would wait behind a writer that waits for it."""
    async with asynclock.lease(client, "again", shared=True, ttl=5, prefix=prefix):
        with pytest.raises(RuntimeError, match="not re-entrant"):
            await asynclock.acquire(client, "again", ttl=5, prefix=prefix)
        with pytest.raises(RuntimeError, match="not re-entrant"):
            await asynclock.acquire(client, "again", shared=True, ttl=5, prefix=prefix)


# -- the scripts, one by one ---------------------------------------------------------------

_TTL, _FENCE_TTL = 5000, 60_000


def _text(value: object) -> object:
    return value.decode() if isinstance(value, bytes) else value


def _attempt_keys(prefix: str, token: str) -> list[str]:
    base = prefix + "{scripts}"
    return [base, base + ":fence", f"{base}:void:{token}", base + ":waiting", base + ":readers"]


async def test_the_shared_scripts_keep_the_contract(client: Redis, prefix: str) -> None:
    """A reader alone holds the lock's key; a second one moves it into the readers' set
    beside itself; a retry answers with the same fencing token (alone: always; as a
    member: when it says it may have landed); renew and release check the full value;
    the longest reader leaving shortens the marker and the set to the one left; the last
    one out deletes them; every key has an expiry."""
    a, b = "a" * 32, "b" * 32
    base, readers = prefix + "{scripts}", prefix + "{scripts}:readers"
    hold = [readers, base]
    ok, fa = await SHARED_ACQUIRE(client, _attempt_keys(prefix, a), [a, _TTL, _FENCE_TTL])
    assert ok == 1
    assert _text(await client.get(base)) == f"shared:{a}:{fa}"
    assert not await client.exists(readers)
    again = await SHARED_ACQUIRE(client, _attempt_keys(prefix, a), [a, _TTL, _FENCE_TTL])
    assert again == [1, fa]
    va = f"{a}:{fa}"
    assert await SHARED_RENEW(client, hold, [va, _TTL]) == 1
    assert await SHARED_IS_OURS(client, hold, [va]) == 1
    assert await SHARED_IS_OURS(client, hold, [f"{a}:{fa + 1}"]) == 0
    ok, fb = await SHARED_ACQUIRE(client, _attempt_keys(prefix, b), [b, 8000, _FENCE_TTL])
    assert ok == 1
    assert fb > fa
    vb = f"{b}:{fb}"
    assert _text(await client.get(base)) == "shared"
    assert {_text(m) for m in await client.zrange(readers, 0, -1)} == {va, vb}
    for key in (base, readers):
        assert 7000 < await client.pttl(key) <= 8000
    again = await SHARED_ACQUIRE(client, _attempt_keys(prefix, a), [a, _TTL, _FENCE_TTL, "1"])
    assert again == [1, fa]
    assert await client.zcard(readers) == 2
    assert await SHARED_RENEW(client, hold, [va, _TTL]) == 1
    assert await SHARED_RENEW(client, hold, [f"{a}:{fa + 1}", _TTL]) == 0
    assert await SHARED_IS_OURS(client, hold, [vb]) == 1
    assert await SHARED_RELEASE(client, hold, [vb, "channel", "me"]) == 1  # (the longest)
    assert _text(await client.get(base)) == "shared"
    for key in (base, readers):
        assert 0 < await client.pttl(key) <= _TTL
    assert await SHARED_RELEASE(client, hold, [vb, "channel", "me"]) == 0
    assert await SHARED_RENEW(client, hold, [vb, _TTL]) == 0
    assert await SHARED_RELEASE(client, hold, [va, "channel", "me"]) == 1
    assert not await client.exists(base, readers)


async def test_an_abandoned_shared_attempt_is_given_back_and_never_lands(
    client: Redis, prefix: str
) -> None:
    """Alone (the lock's key) and as a member: SHARED_ABANDON gives the hold back and
    leaves a tombstone that refuses the attempt arriving later."""
    base, readers = prefix + "{scripts}", prefix + "{scripts}:readers"
    c, d, e = "c" * 32, "d" * 32, "e" * 32
    keys_c = _attempt_keys(prefix, c)
    assert (await SHARED_ACQUIRE(client, keys_c, [c, _TTL, _FENCE_TTL]))[0] == 1
    undo = [readers, base, keys_c[2]]
    assert await SHARED_ABANDON(client, undo, [c, "channel", "me", 10_000]) == 1
    assert not await client.exists(base)
    assert await SHARED_ACQUIRE(client, keys_c, [c, _TTL, _FENCE_TTL]) == [-1, 0]
    assert await SHARED_ACQUIRE(client, keys_c, [c, _TTL, _FENCE_TTL, "1"]) == [-1, 0]
    _, fe = await SHARED_ACQUIRE(client, _attempt_keys(prefix, e), [e, _TTL, _FENCE_TTL])
    keys_d = _attempt_keys(prefix, d)
    assert (await SHARED_ACQUIRE(client, keys_d, [d, _TTL, _FENCE_TTL]))[0] == 1
    undo = [readers, base, keys_d[2]]
    assert await SHARED_ABANDON(client, undo, [d, "channel", "me", 10_000]) == 1
    assert await SHARED_ABANDON(client, undo, [d, "channel", "me", 10_000]) == 0
    assert [_text(m) for m in await client.zrange(readers, 0, -1)] == [f"{e}:{fe}"]
    assert _text(await client.get(base)) == "shared"
    assert await SHARED_RELEASE(client, [readers, base], [f"{e}:{fe}", "channel", "me"]) == 1
    assert not await client.exists(base, readers)


async def test_an_expired_readers_late_release_leaves_the_writer_alone(
    client: Redis, prefix: str
) -> None:
    """A reader alone, and one of two, whose holds expired: their release answers 0 and
    never deletes an exclusive holder's key that got in since."""
    base, readers = prefix + "{scripts}", prefix + "{scripts}:readers"
    hold = [readers, base]
    f, g = "f" * 32, "0" * 32
    _, ff = await SHARED_ACQUIRE(client, _attempt_keys(prefix, f), [f, 50, _FENCE_TTL])
    _, fg = await SHARED_ACQUIRE(client, _attempt_keys(prefix, g), [g, 60, _FENCE_TTL])
    await asyncio.sleep(0.12)
    assert not await client.exists(base, readers)
    await client.set(base, "1" * 32 + ":7", px=5000)  # (an exclusive holder got in)
    assert await SHARED_RELEASE(client, hold, [f"{f}:{ff}", "channel", "me"]) == 0
    assert await SHARED_RENEW(client, hold, [f"{g}:{fg}", _TTL]) == 0
    assert await SHARED_RELEASE(client, hold, [f"{g}:{fg}", "channel", "me"]) == 0
    assert _text(await client.get(base)) == "1" * 32 + ":7"


async def test_a_shared_acquire_whose_reply_was_lost_is_sent_again_and_finds_its_hold(
    client: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside two readers (the readers' set), an acquire whose script ran but whose reply
    was lost: the engine sends it again saying so, and the script answers with the
    fencing token the first run minted; one member per reader, none left after."""
    others = [
        await asynclock.acquire(client, "lost-reply", shared=True, ttl=5, prefix=prefix)
        for _ in range(2)
    ]
    real = Script.__call__
    lost: list[object] = []

    async def lose_the_first_reply(self: Script, *args: object, **kwargs: object) -> object:
        reply = await real(self, *args, **kwargs)  # type: ignore[arg-type]
        if self is SHARED_ACQUIRE and not lost:
            lost.append(reply)
            raise RedisConnectionError("the reply was lost")
        return reply

    monkeypatch.setattr(Script, "__call__", lose_the_first_reply)
    readers = prefix + "{lost-reply}:readers"
    async with asynclock.lease(client, "lost-reply", shared=True, ttl=5, prefix=prefix) as held:
        assert lost
        assert cast(list[int], lost[0])[1] == held.fencing_token
        assert await client.zcard(readers) == 3
        assert await held.is_held(verify=True)
    monkeypatch.undo()
    for other in others:
        await other.release()
    assert not await client.exists(prefix + "{lost-reply}", readers)


async def test_out_of_memory_shared_holders_in_the_set_renew_and_attempts_are_undone(
    private_server: RedisServer, prefix: str
) -> None:
    """Out of memory under noeviction: two shared leases (members of the readers' set)
    keep renewing, as any held lease does, and release cleanly; an acquire sent again
    after a lost reply finds its member, and an abandoned attempt is given back. (Each
    script writes first with a command that maxmemory never refuses: a ZADD or SET first
    is refused.)"""
    client = Redis.from_url(private_server.url)
    events: list[asynclock.LeaseEvent] = []
    base, readers = prefix + "{scripts}", prefix + "{scripts}:readers"
    c, d, e = "c" * 32, "d" * 32, "e" * 32
    try:
        first = await asynclock.acquire(
            client, "held", shared=True, ttl=0.6, prefix=prefix, on_event=events.append
        )
        second = await asynclock.acquire(client, "held", shared=True, ttl=0.6, prefix=prefix)
        fences = {}
        for token in (c, d, e):
            _, fences[token] = await SHARED_ACQUIRE(
                client, _attempt_keys(prefix, token), [token, _TTL, _FENCE_TTL]
            )
        await run_out_of_memory(client, prefix)
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            assert await first.is_held()
            assert await second.is_held()
            await asyncio.sleep(0.05)
        assert await first.is_held(verify=True)
        await first.release()
        await second.release()
        kinds = [event.kind for event in events]
        assert kinds.count(LeaseEventKind.RENEWED) >= 4
        assert LeaseEventKind.LOST not in kinds
        assert await client.exists(prefix + "{held}", prefix + "{held}:readers") == 0
        again = await SHARED_ACQUIRE(client, _attempt_keys(prefix, d), [d, _TTL, _FENCE_TTL, "1"])
        assert again == [1, fences[d]]
        undo = [readers, base, _attempt_keys(prefix, e)[2]]
        assert await SHARED_ABANDON(client, undo, [e, "channel", "me", 10_000]) == 1
        assert await SHARED_ACQUIRE(client, _attempt_keys(prefix, e), [e, _TTL, _FENCE_TTL]) == [
            -1,
            0,
        ]
        assert {_text(m) for m in await client.zrange(readers, 0, -1)} == {
            f"{c}:{fences[c]}",
            f"{d}:{fences[d]}",
        }
    finally:
        await client.config_set("maxmemory", "0")
        await client.aclose()


async def test_a_reader_joining_a_marker_whose_set_is_gone_gives_the_set_an_expiry(
    client: Redis, prefix: str
) -> None:
    """The readers' set gone while the marker stays (evicted, deleted from outside, or
    expired a millisecond before it): a reader that joins makes the set anew, and it
    expires with its member, as the marker does, rather than never."""
    base, readers = prefix + "{scripts}", prefix + "{scripts}:readers"
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    for token in (a, b):
        await SHARED_ACQUIRE(client, _attempt_keys(prefix, token), [token, _TTL, _FENCE_TTL])
    assert _text(await client.get(base)) == "shared"
    await client.delete(readers)
    ok, fc = await SHARED_ACQUIRE(client, _attempt_keys(prefix, c), [c, 2000, _FENCE_TTL])
    assert ok == 1
    assert [_text(m) for m in await client.zrange(readers, 0, -1)] == [f"{c}:{fc}"]
    assert 1000 < await client.pttl(readers) <= 2000
    assert 0 < await client.pttl(base) <= _TTL


async def test_an_acquire_sent_again_after_its_member_expired_leaves_one_member_per_token(
    client: Redis, prefix: str
) -> None:
    """An acquire sent again (its outcome unknown) whose first run's member has expired
    beside live readers takes a new hold; the expired member must not stay beside it:
    in a large set (not a listpack: ZSCAN's order is the hash table's), an acquire sent
    a third time, or the undo, could find the expired one, take a second hold or leave
    the live one behind."""
    base, readers = prefix + "{scripts}", prefix + "{scripts}:readers"
    for i in range(140):  # (live readers, more than zset-max-listpack-entries)
        token = f"{i:032x}"
        await SHARED_ACQUIRE(client, _attempt_keys(prefix, token), [token, 60_000, _FENCE_TTL])
    tokens = [f"{'e' * 24}{i:08x}" for i in range(10)]
    for token in tokens:  # (each landed, its reply lost, and it expired)
        await SHARED_ACQUIRE(client, _attempt_keys(prefix, token), [token, 30, _FENCE_TTL])
    await asyncio.sleep(0.08)

    async def members(token: str) -> list[str]:
        found = [_text(m) for m in await client.zrange(readers, 0, -1)]
        return [str(m) for m in found if str(m).startswith(token + ":")]

    again: dict[str, int] = {}
    for token in tokens:
        ok, again[token] = await SHARED_ACQUIRE(
            client, _attempt_keys(prefix, token), [token, _TTL, _FENCE_TTL, "1"]
        )
        assert ok == 1
        assert await members(token) == [f"{token}:{again[token]}"]
    for token in tokens:  # (sent a third time: the same hold)
        reply = await SHARED_ACQUIRE(
            client, _attempt_keys(prefix, token), [token, _TTL, _FENCE_TTL, "1"]
        )
        assert reply == [1, again[token]]
    for token in tokens:
        undo = [readers, base, _attempt_keys(prefix, token)[2]]
        assert await SHARED_ABANDON(client, undo, [token, "channel", "me", 10_000]) == 1
        assert await members(token) == []
    assert await client.zcard(readers) == 140


async def test_readers_whose_marker_was_lost_are_not_revived_by_readers_after_it(
    client: Redis, prefix: str
) -> None:
    """The marker lost (evicted, deleted from outside) while its set of live readers
    stays: a writer may get in, and the readers are to notice at their next renewal. Two
    readers that come after the writer left (one alone, then one beside it) must not
    bring the old members back to life in the set they make."""
    base, readers = prefix + "{scripts}", prefix + "{scripts}:readers"
    hold = [readers, base]
    a, b, x, y = "a" * 32, "b" * 32, "c" * 32, "d" * 32
    _, fa = await SHARED_ACQUIRE(client, _attempt_keys(prefix, a), [a, _TTL, _FENCE_TTL])
    _, fb = await SHARED_ACQUIRE(client, _attempt_keys(prefix, b), [b, _TTL, _FENCE_TTL])
    await client.delete(base)  # (the marker evicted)
    await client.set(base, "1" * 32 + ":7", px=5000)  # (a writer got in, and left)
    await client.delete(base)
    _, fx = await SHARED_ACQUIRE(client, _attempt_keys(prefix, x), [x, _TTL, _FENCE_TTL])
    _, fy = await SHARED_ACQUIRE(client, _attempt_keys(prefix, y), [y, _TTL, _FENCE_TTL])
    assert _text(await client.get(base)) == "shared"
    assert await SHARED_IS_OURS(client, hold, [f"{a}:{fa}"]) == 0
    assert await SHARED_RENEW(client, hold, [f"{b}:{fb}", _TTL]) == 0
    assert {_text(m) for m in await client.zrange(readers, 0, -1)} == {f"{x}:{fx}", f"{y}:{fy}"}
