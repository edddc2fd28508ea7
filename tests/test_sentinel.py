"""Leases through a Sentinel client (issue 21, B): a real primary, its replica and a
sentinel (``redis-server --sentinel``) over them, failed over by ``SENTINEL FAILOVER``
and by ``SIGKILL`` of the primary. Every test runs with redis-py's ``Sentinel`` and with
valkey-py's (``master_for()`` clients of either; issue 30)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import anyio
import pytest
from deployments import SERVICE, SentinelProcess, sentinel_ready, synced_replica
from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

import asynclock
from asynclock import LeaseEventKind, LockLost, LossReason
from asynclock.testing import RedisServer, available_engines, keys_left

pytestmark = pytest.mark.skipif(not available_engines(), reason="needs a server binary")


@dataclass
class Deployment:
    primary: RedisServer
    replica: RedisServer
    sentinel: SentinelProcess
    manager: Sentinel

    def client(self) -> Redis:
        return self.manager.master_for(SERVICE, socket_timeout=1.0)

    async def primary_port(self) -> int:
        _, port = await self.manager.discover_master(SERVICE)
        return int(port)


@pytest.fixture
def _servers(private_server: RedisServer) -> Iterator[tuple[RedisServer, RedisServer]]:
    # In sync before the sentinel first looks at the replica (it refreshes what it
    # knows of a replica every 10 s, and promotes only one whose link was up).
    replica = synced_replica(private_server)
    try:
        yield private_server, replica
    finally:
        replica.stop()


@pytest.fixture(params=["redis-py", "valkey-py"])
def sentinel_type(request: pytest.FixtureRequest) -> type[Sentinel]:
    """The Sentinel class of each library: redis-py's, valkey-py's (the same API)."""
    if request.param == "redis-py":
        return Sentinel
    valkey_sentinel = pytest.importorskip("valkey.asyncio.sentinel")
    return cast(type[Sentinel], valkey_sentinel.Sentinel)


@pytest.fixture
async def deployment(
    _servers: tuple[RedisServer, RedisServer], tmp_path: Path, sentinel_type: type[Sentinel]
) -> AsyncIterator[Deployment]:
    primary, replica = _servers
    sentinel = SentinelProcess(primary, tmp_path)
    manager = sentinel_type([("127.0.0.1", sentinel.port)], socket_timeout=1.0)
    try:
        await sentinel_ready(manager)
        yield Deployment(primary, replica, sentinel, manager)
    finally:
        sentinel.stop()
        for server in manager.sentinels:
            await server.aclose()


async def _failed_over(deployment: Deployment, old_port: int) -> None:
    """Wait until the sentinel names a new primary, and it accepts writes."""
    async with asyncio.timeout(20):
        while True:
            with contextlib.suppress(Exception):
                if await deployment.primary_port() != old_port:
                    break
            await asyncio.sleep(0.05)


async def test_leases_and_waiters_work_through_sentinel(
    deployment: Deployment, prefix: str
) -> None:
    """Two Sentinel clients: exclusion, renewal, release and a waiter woken by the
    release (well before the holder's key could expire)."""
    first, second = deployment.client(), deployment.client()
    try:
        order: list[str] = []
        entered = asyncio.Event()

        async def holder() -> None:
            async with asynclock.lease(first, "job", ttl=1.2, prefix=prefix) as lock:
                order.append("first in")
                entered.set()
                await asyncio.sleep(0.6)  # (renewed: past ttl/3)
                assert lock.state is asynclock.LeaseState.HELD
                order.append("first out")

        async def waiter() -> float:
            await entered.wait()
            started = time.monotonic()
            async with asynclock.lease(second, "job", ttl=5.0, prefix=prefix):
                order.append("second in")
            return time.monotonic() - started

        _, waited = await asyncio.gather(holder(), waiter())
        assert order == ["first in", "first out", "second in"]
        assert waited < 2.0, waited
        assert await keys_left(first, prefix) == []
    finally:
        await first.aclose()
        await second.aclose()


async def test_a_held_lease_follows_a_sentinel_failover(
    deployment: Deployment, prefix: str
) -> None:
    """SENTINEL FAILOVER while a lease (replicated) is held, and the old primary never
    steps down (its ACL refuses REPLICAOF, as when the sentinel cannot reach it): it
    still accepts writes, so renewals that went on reaching it would be lost with it
    while the new primary's copy of the key runs out. The renewals follow the primary
    the sentinel names, keep the lease there, and the release deletes the key there."""
    client = deployment.client()
    renewals = 0
    two_more = asyncio.Event()
    wanted = 1 << 30

    def on_event(event: asynclock.LeaseEvent) -> None:
        nonlocal renewals
        if event.kind is LeaseEventKind.RENEWED:
            renewals += 1
            if renewals >= wanted:
                two_more.set()

    old_port = await deployment.primary_port()
    old = Redis(host="127.0.0.1", port=old_port)
    try:
        # (before any connection of ours: changing a user closes its other connections)
        await old.execute_command("ACL", "SETUSER", "default", "-replicaof", "-slaveof")
        async with asynclock.lease(
            client, "job", ttl=6.0, prefix=prefix, on_event=on_event
        ) as lock:
            # The client's wake-up subscription is made on the old primary (and stays open
            # while the lease is held): it waits for a lock another client holds there.
            other = await asynclock.acquire(old, "before", ttl=5.0, prefix=prefix)
            waiting = asyncio.create_task(_take_and_release(client, "before", prefix))
            async with asyncio.timeout(10):  # (another process's state)
                while not (await old.pubsub_numsub(f"{prefix}{{before}}:released"))[0][1]:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            await other.release()
            async with asyncio.timeout(10):
                await waiting
            wanted = 1  # (the renewals' connection reaches the old primary first)
            async with asyncio.timeout(10):
                await two_more.wait()
            two_more.clear()
            # The replica has the lease (a write after it, then WAIT on that connection).
            # (Not min_replicas=1: with one replica, the new primary has none to confirm
            # renewals.)
            await old.set(prefix + "probe", "1")
            assert await old.execute_command("WAIT", 1, 5000) == 1
            await deployment.manager.sentinels[0].execute_command("SENTINEL", "FAILOVER", SERVICE)
            await _failed_over(deployment, old_port)
            # (the client's pool learns of it before asynclock does, as when the
            # application opens a connection: asynclock must move its own all the same)
            await client.connection_pool.get_master_address()  # type: ignore[no-untyped-call]
            new_primary = Redis(host="127.0.0.1", port=await deployment.primary_port())
            wanted = renewals + 2
            async with asyncio.timeout(10):
                await two_more.wait()  # (renewals every 2 s)
            assert lock.state is asynclock.LeaseState.HELD
            assert (await old.info("replication"))["role"] == "master"  # (never stepped down)
            # renewed there within the last renewal period (2 s) and a margin
            assert await new_primary.pttl(lock.key) > 3500
            # The subscription followed too: a release on the new primary wakes the
            # client's waiter long before the holder's TTL (30 s) would.
            # (and its acquires reach the new primary: it gets in only once released)
            holder = await asynclock.acquire(new_primary, "after", ttl=30.0, prefix=prefix)
            started = time.monotonic()
            waiting = asyncio.create_task(_take_and_release(client, "after", prefix))
            async with asyncio.timeout(10):  # (another process's state)
                channel = f"{prefix}{{after}}:released"
                while not (await new_primary.pubsub_numsub(channel))[0][1]:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            released = time.monotonic()
            await holder.release()
            async with asyncio.timeout(10):
                entered = await waiting
            assert released <= entered < started + 8.0
        assert lock.state is asynclock.LeaseState.RELEASED
        try:
            assert await keys_left(new_primary, prefix) == []
        finally:
            await new_primary.aclose()
    finally:
        with contextlib.suppress(Exception):
            await old.execute_command("ACL", "SETUSER", "default", "+@all")
        await old.aclose()
        await client.aclose()


async def _take_and_release(client: Redis, name: str, prefix: str) -> float:
    """Take the lock and give it back; returns when it got in (time.monotonic())."""
    async with asynclock.lease(client, name, ttl=5.0, prefix=prefix):
        return time.monotonic()


async def test_a_lease_the_new_primary_does_not_know_is_lost(
    deployment: Deployment, prefix: str
) -> None:
    """The replica misses the acquisition (stopped, its link cut), then the primary is
    SIGKILLed and the sentinel promotes the replica: the holder's next renewal finds no
    key there, and the block is cancelled with LockLost(not_owner) before its deadline;
    a new lease is then taken on the new primary through the same client."""
    client = deployment.client()
    try:
        events: list[asynclock.LeaseEvent] = []
        old_port = await deployment.primary_port()
        primary_client = Redis(host="127.0.0.1", port=old_port)
        deployment.replica.pause()
        await primary_client.client_kill_filter(_type="replica")
        await primary_client.aclose()
        with pytest.raises(LockLost) as lost:
            async with asynclock.lease(
                client, "job", ttl=8.0, prefix=prefix, on_event=events.append
            ):
                deployment.primary.kill()
                deployment.replica.resume()
                await _failed_over(deployment, old_port)
                await anyio.sleep_forever()
        assert lost.value.reason is LossReason.NOT_OWNER
        (loss,) = [e for e in events if e.kind is LeaseEventKind.LOST]
        assert loss.at < loss.safe_until  # (found by a renewal, before the deadline)
        async with asynclock.lease(client, "job", ttl=2.0, blocking=False, prefix=prefix):
            pass
    finally:
        await client.aclose()
