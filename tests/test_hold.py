"""``hold_at_least``: a release keeps the key until that long after the acquisition, so a
scheduler firing late on another server finds the tick taken (issue 18, B)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from redis.asyncio import Redis

import asynclock


async def test_release_keeps_the_key_until_hold_at_least(
    client: Redis, make_client: Callable[..., Redis], prefix: str
) -> None:
    """Released after 0.1 s of a 1 s hold: another client finds the lock busy (for the
    rest of the hold, not the TTL), and a waiter gets it once the hold ends."""
    other = make_client()
    started = time.monotonic()
    async with asynclock.lease(client, "tick", ttl=10, hold_at_least=1.0, prefix=prefix) as h:
        await asyncio.sleep(0.1)
    with pytest.raises(asynclock.LockBusy) as busy:
        await asynclock.acquire(other, "tick", ttl=10, prefix=prefix, blocking=False)
    assert busy.value.retry_after is not None
    assert 0.5 < busy.value.retry_after <= 0.95
    assert h.state is asynclock.LeaseState.RELEASED
    async with asynclock.lease(other, "tick", ttl=10, prefix=prefix, blocking_timeout=5):
        waited = time.monotonic() - started
    assert 1.0 <= waited < 1.8, waited


async def test_a_waiter_of_the_same_client_is_not_handed_the_key(
    client: Redis, prefix: str
) -> None:
    """No handoff before the hold ends: the local waiter enters once it is over."""
    entered: list[float] = []

    async def waiter() -> None:
        async with asynclock.lease(client, "local", ttl=10, prefix=prefix):
            entered.append(time.monotonic())

    started = time.monotonic()
    async with asynclock.lease(
        client, "local", ttl=10, hold_at_least=timedelta(seconds=0.8), prefix=prefix
    ):
        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.1)
    await asyncio.wait_for(task, 5)
    assert 0.8 <= entered[0] - started < 1.6


async def test_a_release_after_the_hold_deletes_at_once(client: Redis, prefix: str) -> None:
    """Held past hold_at_least: released as usual."""
    async with asynclock.lease(client, "past", ttl=5, hold_at_least=0.1, prefix=prefix) as h:
        await asyncio.sleep(0.2)
    assert not await client.exists(h.key)


async def test_a_lost_lease_keeps_nothing(client: Redis, prefix: str) -> None:
    """The keep is owner-checked: another holder's key is left as it is."""
    held = await asynclock.acquire(client, "lost", ttl=5, hold_at_least=3, prefix=prefix)
    await client.set(held.key, "someone else", px=500)
    with pytest.raises(asynclock.LockLost):
        await held.release()
    assert 0 < await client.pttl(held.key) <= 500


@pytest.mark.parametrize("hold", [None, 1.5], ids=["plain", "hold_at_least"])
async def test_one_run_per_tick_under_skew(
    redis_server: object, make_client: Callable[..., Redis], prefix: str, hold: float | None
) -> None:
    """Five servers whose schedulers fire up to 0.8 s apart, a 50 ms job, a fixed lock
    name: the README's old recipe (blocking=False) runs the tick several times; with
    hold_at_least above the skew, exactly once."""
    runs: list[int] = []

    async def server(index: int) -> None:
        client = make_client()
        await asyncio.sleep(index * 0.2)  # (this server's clock is late by index x 0.2 s)
        try:
            async with asynclock.lease(
                client, "nightly", ttl=10, blocking=False, hold_at_least=hold, prefix=prefix
            ):
                runs.append(index)
                await asyncio.sleep(0.05)
        except asynclock.LockBusy:
            pass

    await asyncio.gather(*(server(i) for i in range(5)))
    if hold is None:
        assert len(runs) > 1  # (the problem the option solves)
    else:
        assert runs == [0]


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1, ValueError), (1e15, ValueError), ("1", TypeError)],
)
def test_bad_hold_at_least_is_refused_before_io(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="hold_at_least"):
        asynclock.lease(Redis(), "x", hold_at_least=value)  # type: ignore[arg-type]
