"""``current_lease()``: the lease a job of once()/idempotent(), an exclusive() body and
an every() run are under, for fencing their writes."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

import asynclock


async def _seen() -> asynclock.Lease:
    """The current lease, as code deep inside a job (or a task it started) finds it."""
    found = await asyncio.create_task(_lookup())  # (a task copies the context)
    assert found is asynclock.current_lease()
    return found


async def _lookup() -> asynclock.Lease:
    lease = asynclock.current_lease()
    assert lease is not None, "no current lease inside the job"
    return lease


async def test_once_gives_its_job_the_lease_and_its_fencing_token(
    client: Redis, prefix: str
) -> None:
    seen: list[asynclock.Lease] = []

    async def job() -> int:
        lease = await _seen()
        assert lease.state is asynclock.LeaseState.HELD
        seen.append(lease)
        return lease.fencing_token

    token = await asynclock.once(client, "charge:1", job, prefix=prefix)
    assert [lease.name for lease in seen] == ["charge:1"]
    assert token == seen[0].fencing_token > 0
    assert int(await client.get(f"{prefix}{{charge:1}}:fence")) == token  # the one minted
    assert seen[0].state is asynclock.LeaseState.RELEASED
    assert asynclock.current_lease() is None


async def test_idempotent_and_exclusive_bodies_see_their_leases(client: Redis, prefix: str) -> None:
    @asynclock.idempotent(client, key="order:{order}", prefix=prefix)
    async def charge(order: int) -> str:
        return (await _seen()).name

    @asynclock.exclusive(client, "sync:{user}", ttl=5, prefix=prefix)
    async def sync(user: int) -> tuple[str, int]:
        lease = await _seen()
        return lease.name, lease.fencing_token

    assert await charge(7) == "order:7"
    name, token = await sync(3)
    assert name == "sync:3"
    assert token > 0
    assert asynclock.current_lease() is None


async def test_every_run_sees_its_lease_and_nothing_leaks_out(client: Redis, prefix: str) -> None:
    names: asyncio.Queue[str] = asyncio.Queue()

    async def run() -> None:
        await names.put((await _seen()).name)

    task = asyncio.create_task(asynclock.every(client, "report", 0.2, run, prefix=prefix))
    try:
        async with asyncio.timeout(10):
            assert await names.get() == "report"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert asynclock.current_lease() is None


async def test_a_failing_or_cancelled_job_resets_it(client: Redis, prefix: str) -> None:
    async def fails() -> None:
        await _seen()
        raise ValueError("the job failed")

    with pytest.raises(ValueError, match="the job failed"):
        await asynclock.once(client, "fails", fails, prefix=prefix)
    assert asynclock.current_lease() is None

    started = asyncio.Event()

    async def hangs() -> None:
        await _seen()
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(asynclock.once(client, "hangs", hangs, prefix=prefix))
    async with asyncio.timeout(10):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asynclock.current_lease() is None


async def test_outside_a_job_there_is_none(client: Redis, prefix: str) -> None:
    assert asynclock.current_lease() is None
    async with asynclock.lease(client, "plain", prefix=prefix):
        assert asynclock.current_lease() is None  # (a block has its lease in hand)
