"""Options that combine: each accepted combination does what both options promise, and the
refused ones are refused before any I/O (issue 28, A)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import Pair
from redis.asyncio import Redis

import asynclock
from asynclock import LeaseState, LockLost, LossReason

# The kinds, by the keywords that make them (a semaphore of 2).
KINDS: dict[str, dict[str, Any]] = {
    "mutex": {},
    "semaphore": {"limit": 2},
    "shared": {"shared": True},
    "fair": {"fair": True},
}


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "fair"])
async def test_hold_at_least_keeps_the_key_of_every_kind(
    client: Redis, make_client: Callable[..., Redis], prefix: str, kind: str
) -> None:
    """Released after 0.1 s of a 1 s hold: a non-blocking rival finds it busy (a semaphore
    has its other permit free), and a waiting rival gets in once the hold ends."""
    other = make_client()
    extra = KINDS[kind]
    started = time.monotonic()
    async with asynclock.lease(client, "held", ttl=10, hold_at_least=1.0, prefix=prefix, **extra):
        await asyncio.sleep(0.1)
    if kind == "semaphore":  # (one permit still kept: the other is free, then none)
        taken = await asynclock.acquire(other, "held", ttl=10, prefix=prefix, **extra)
    with pytest.raises(asynclock.LockBusy):
        await asynclock.acquire(other, "held", ttl=10, prefix=prefix, blocking=False, **extra)
    async with asynclock.lease(other, "held", ttl=10, prefix=prefix, blocking_timeout=5, **extra):
        waited = time.monotonic() - started
    assert 1.0 <= waited < 3.0, waited
    if kind == "semaphore":
        await taken.release()


@pytest.mark.parametrize("kind", list(KINDS))
async def test_max_hold_takes_the_lease_of_every_kind(
    client: Redis, make_client: Callable[..., Redis], prefix: str, kind: str
) -> None:
    """A holder of any kind that would hold forever is cancelled at max_hold (0.6 s),
    LockLost says max_hold, and the lock is free at once for another client."""
    extra = KINDS[kind]
    started = time.monotonic()
    with pytest.raises(LockLost) as lost:
        async with asynclock.lease(
            client, "bounded", ttl=0.3, max_hold=0.6, prefix=prefix, **extra
        ) as held:
            await asyncio.Event().wait()
    assert lost.value.reason is LossReason.MAX_HOLD
    assert 0.55 <= time.monotonic() - started < 3.0
    assert held.state is LeaseState.LOST
    exclusive = {"limit": 2} if kind == "semaphore" else {}
    async with asynclock.lease(
        make_client(), "bounded", ttl=5, prefix=prefix, blocking=False, **exclusive
    ):
        pass


@pytest.mark.parametrize("kind", list(KINDS))
async def test_min_replicas_confirms_every_kind(pair: Pair, prefix: str, kind: str) -> None:
    """Every kind's acquisition and renewals are confirmed by the replica: the lease is
    held past several renewals and released cleanly."""
    events: list[asynclock.LeaseEvent] = []
    async with asynclock.lease(
        pair.on_primary,
        "replicated",
        ttl=1.5,  # (each renewal waits for the replica: room for a busy machine)
        min_replicas=1,
        prefix=prefix,
        on_event=events.append,
        **KINDS[kind],
    ) as held:
        await asyncio.sleep(1.3)  # (past two renewals at ttl/3)
        assert await held.is_held(verify=True)
    kinds = [event.kind for event in events]
    assert kinds.count(asynclock.LeaseEventKind.RENEWED) >= 2
    assert asynclock.LeaseEventKind.RENEW_FAILED not in kinds
    assert held.state is LeaseState.RELEASED


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"shared": True, "limit": 2}, "shared=True cannot"),
        ({"shared": True, "fair": True}, "shared=True cannot"),
        ({"shared": True, "hold_at_least": 1.0}, "shared=True cannot"),
        ({"fair": True, "limit": 2}, "fair=True is for a plain lock"),
        ({"wait_aof": True}, "wait_aof=True needs min_replicas"),
        ({"max_hold": 1.0, "hold_at_least": 2.0}, "must not be shorter than hold_at_least"),
    ],
)
async def test_refused_combinations_before_any_io(extra: dict[str, Any], words: str) -> None:
    client = Redis(host="127.0.0.1", port=1)  # (nothing listens: any I/O would fail)
    with pytest.raises(ValueError, match=words):
        asynclock.lease(client, "x", **extra)
    with pytest.raises(ValueError, match=words):
        await asynclock.acquire(client, "x", **extra)
    await client.aclose()
