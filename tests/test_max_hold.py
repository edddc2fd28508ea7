"""``max_hold``: a holder that is alive and renewing is still cancelled, and the lease
given back, once it has held the lock that long (issue 20, B)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from redis.asyncio import Redis

import asynclock
from asynclock import LeaseEventKind, LockLost, LossReason


async def test_a_healthy_holder_is_cancelled_at_max_hold(
    client: Redis, make_client: Callable[..., Redis], prefix: str
) -> None:
    """ttl 0.3 s, renewed every 0.1 s, held for at most 0.8 s: the block is cancelled at
    0.8 s (not at a deadline: renewals succeed), LockLost says max_hold, the key is
    deleted on the way out, and another client takes the lock at once."""
    events: list[asynclock.LeaseEvent] = []
    cancelled = asyncio.Event()
    started = time.monotonic()
    with pytest.raises(LockLost) as lost:
        async with asynclock.lease(
            client, "bounded", ttl=0.3, max_hold=0.8, prefix=prefix, on_event=events.append
        ) as held:
            try:
                await asyncio.Event().wait()  # (a holder that would hold forever)
            except asyncio.CancelledError:
                cancelled.set()
                raise
    elapsed = time.monotonic() - started
    assert lost.value.reason is LossReason.MAX_HOLD
    assert cancelled.is_set()
    assert 0.75 <= elapsed < 2.5, elapsed
    kinds = [e.kind for e in events]
    assert kinds.count(LeaseEventKind.RENEWED) >= 3  # (alive and renewing meanwhile)
    assert LeaseEventKind.RENEW_FAILED not in kinds
    assert LeaseEventKind.RELEASED in kinds  # given back, not left to expire
    assert held.state is asynclock.LeaseState.LOST
    assert not await client.exists(held.key)
    other = make_client()
    async with asynclock.lease(other, "bounded", ttl=5, prefix=prefix, blocking=False):
        pass


async def test_a_lease_of_acquire_has_its_guards_cancelled(client: Redis, prefix: str) -> None:
    """acquire() with max_hold: the guard open at max_hold is cancelled with LockLost,
    renewals stop, and release() gives the key back, raising LockLost."""
    held = await asynclock.acquire(client, "leader", ttl=0.3, max_hold=0.5, prefix=prefix)
    with pytest.raises(LockLost) as lost:
        async with held.guard():
            await asyncio.Event().wait()
    assert lost.value.reason is LossReason.MAX_HOLD
    assert not await held.is_held()
    with pytest.raises(LockLost):
        await held.release()
    assert not await client.exists(held.key)


async def test_a_block_that_ends_in_time_is_not_touched(client: Redis, prefix: str) -> None:
    """Ended before max_hold: released as usual, and nothing fires later."""
    events: list[asynclock.LeaseEvent] = []
    async with asynclock.lease(
        client,
        "quick",
        ttl=5,
        max_hold=timedelta(seconds=0.4),
        prefix=prefix,
        on_event=events.append,
    ) as held:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.6)  # past max_hold: a timer left behind would fire now
    assert held.state is asynclock.LeaseState.RELEASED
    assert LeaseEventKind.LOST not in [e.kind for e in events]


async def test_a_holder_cancelled_before_max_hold_releases(client: Redis, prefix: str) -> None:
    """Cancelled mid-block (before max_hold): the lease is released, no loss reported,
    and the max_hold timer does not fire afterwards."""
    events: list[asynclock.LeaseEvent] = []
    inside = asyncio.Event()

    async def holder() -> None:
        async with asynclock.lease(
            client, "cancelled", ttl=5, max_hold=0.5, prefix=prefix, on_event=events.append
        ):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(holder())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.7)
    kinds = [e.kind for e in events]
    assert LeaseEventKind.RELEASED in kinds
    assert LeaseEventKind.LOST not in kinds
    assert not await client.exists(prefix + "{cancelled}")


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"max_hold": 0}, ValueError, "max_hold must be positive"),
        ({"max_hold": -1.0}, ValueError, "max_hold must be positive"),
        ({"max_hold": "10"}, TypeError, "max_hold must be a number"),
        ({"max_hold": float("inf")}, ValueError, "max_hold must be finite"),
        ({"max_hold": 1e12}, ValueError, "max_hold must be at most"),
        ({"max_hold": 1.0, "hold_at_least": 2.0}, ValueError, "not be shorter than"),
    ],
)
async def test_bad_max_hold_is_refused_before_any_io(
    kwargs: dict[str, object], error: type[Exception], text: str
) -> None:
    """Checked when lease() is called, and by acquire() before it connects (port 1:
    nothing listens there)."""
    nowhere = Redis(host="127.0.0.1", port=1)
    with pytest.raises(error, match=text):
        asynclock.lease(nowhere, "x", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match=text):
        await asynclock.acquire(nowhere, "x", **kwargs)  # type: ignore[arg-type]
    await nowhere.aclose()
