"""Leases on Redis Cluster (issue 21, A): a real cluster of three primaries
(``redis-server --cluster-enabled yes``, joined with ``CLUSTER ADDSLOTSRANGE`` and
``CLUSTER MEET``), a slot migrated while a lease is held (the lease follows it), and a
new lease after it. Every test runs with redis-py's ``RedisCluster`` clients and with
valkey-py's ``ValkeyCluster`` ones (issue 30)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import cast

import anyio
import pytest
from deployments import cluster_nodes, slot_bounds, wait_until
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AskError, RedisError

import asynclock
from asynclock import LockBusy, LockLost, ReplicationTimeout
from asynclock.testing import RedisServer, available_engines, keys_left

pytestmark = pytest.mark.skipif(not available_engines(), reason="needs a server binary")


@pytest.fixture
def nodes() -> Iterator[list[RedisServer]]:
    """Three primaries owning a third of the slots each, the cluster's state ok."""
    with cluster_nodes(3) as servers:
        yield servers


ClusterType = type[RedisCluster]


@pytest.fixture(params=["redis-py", "valkey-py"])
def cluster_type(request: pytest.FixtureRequest) -> ClusterType:
    """The cluster client class of each library: redis-py's ``RedisCluster``, valkey-py's
    ``ValkeyCluster`` (the same API; issue 30)."""
    if request.param == "redis-py":
        return RedisCluster
    valkey_cluster = pytest.importorskip("valkey.asyncio.cluster")
    return cast(ClusterType, valkey_cluster.ValkeyCluster)


@pytest.fixture
async def cluster(
    nodes: list[RedisServer], cluster_type: ClusterType
) -> AsyncIterator[RedisCluster]:
    client = cluster_type(host="127.0.0.1", port=nodes[0].port)
    await client.initialize()
    try:
        yield client
    finally:
        await client.aclose()


def _owner(nodes: list[RedisServer], key: str) -> RedisServer:
    """The node that owns ``key``'s slot as the fixture assigned them."""
    slot = int(nodes[0].command("CLUSTER", "KEYSLOT", key).strip()[1:])
    bounds = slot_bounds(3)
    for server, low, high in zip(nodes, bounds, bounds[1:], strict=False):
        if low <= slot < high:
            return server
    raise AssertionError(slot)


async def _all_keys_left(nodes: list[RedisServer], prefix: str) -> list[str]:
    found: list[str] = []
    for server in nodes:
        client = Redis(host="127.0.0.1", port=server.port)
        try:
            found += await keys_left(client, prefix)
        finally:
            await client.aclose()
    return found


async def test_leases_of_every_kind_on_a_cluster(
    nodes: list[RedisServer], cluster: RedisCluster, cluster_type: ClusterType, prefix: str
) -> None:
    """Locks whose slots are on each of the three primaries: exclusion between two
    cluster clients, a waiter woken by the release (long before the TTL), a semaphore,
    shared leases, a fair lock, once() and statistics(); nothing left behind."""
    other = cluster_type(host="127.0.0.1", port=nodes[1].port)
    try:
        names = ["a", "b", "c", "d", "e", "f"]
        owners = {_owner(nodes, f"{prefix}{{{n}}}").port for n in names}
        assert len(owners) == 3, "the names do not cover every primary"
        for name in names:
            async with asynclock.lease(cluster, name, ttl=5.0, prefix=prefix) as lock:
                with pytest.raises(LockBusy):
                    async with asynclock.lease(other, name, blocking=False, prefix=prefix):
                        pass
                stats = await asynclock.statistics(other, name, prefix=prefix)
                assert stats.exclusive
                assert lock.fencing_token > 0

        # a waiter of another client is woken by the release, not by the TTL (30 s)
        entered = asyncio.Event()

        async def holder() -> None:
            async with asynclock.lease(cluster, "w", ttl=30.0, prefix=prefix):
                entered.set()
                await asyncio.sleep(0.3)

        async def waiter() -> float:
            await entered.wait()
            started = time.monotonic()
            async with asynclock.lease(other, "w", ttl=30.0, prefix=prefix):
                return time.monotonic() - started

        _, waited = await asyncio.gather(holder(), waiter())
        assert waited < 3.0, waited

        async with (
            asynclock.lease(cluster, "sem", limit=2, prefix=prefix),
            asynclock.lease(other, "sem", limit=2, prefix=prefix),
        ):
            with pytest.raises(LockBusy):
                async with asynclock.lease(cluster, "sem", limit=2, blocking=False, prefix=prefix):
                    pass
        async with (
            asynclock.lease(cluster, "rw", shared=True, prefix=prefix),
            asynclock.lease(other, "rw", shared=True, prefix=prefix),
        ):
            assert (await asynclock.statistics(cluster, "rw", prefix=prefix)).shared_holders == 2
        async with asynclock.lease(cluster, "fair", fair=True, prefix=prefix):
            pass

        async def job() -> int:
            return 42

        assert await asynclock.once(cluster, "job", job, prefix=prefix) == 42
        assert await asynclock.once(other, "job", job, prefix=prefix) == 42
        assert await asynclock.forget(cluster, "job", prefix=prefix)
        assert await _all_keys_left(nodes, prefix) == []
    finally:
        await other.aclose()


async def test_inspect_every_and_the_testing_kit_on_a_cluster(
    nodes: list[RedisServer], cluster: RedisCluster, prefix: str
) -> None:
    """inspect() and the CLI's list and release (on every primary), every() and
    keys_left() through the cluster client."""
    from asynclock._apps._inspect import force_release, list_locks

    names = ["a", "b", "c", "d", "e", "f"]
    leases = [await asynclock.acquire(cluster, n, ttl=30.0, prefix=prefix) for n in names]
    try:
        assert await keys_left(cluster, prefix) == sorted(lease.key for lease in leases)
        info = await asynclock.inspect(cluster, "a", prefix=prefix)
        assert info.held
        assert info.fencing_token == leases[0].fencing_token
        found, complete = await list_locks(cluster, prefix=prefix)
        assert complete
        assert [lock.name for lock in found] == names
        assert await force_release(cluster, "b", prefix=prefix) == 1
        assert not (await asynclock.inspect(cluster, "b", prefix=prefix)).held
    finally:
        for lease in leases:
            with contextlib.suppress(LockLost):
                await lease.release()
    ticked = asyncio.Event()

    async def tick() -> None:
        ticked.set()

    schedule = asyncio.create_task(asynclock.every(cluster, "tick", 0.2, tick, prefix=prefix))
    try:
        async with asyncio.timeout(10):
            await ticked.wait()
    finally:
        schedule.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await schedule
    assert await keys_left(cluster, prefix) == []


async def test_a_release_halfway_through_a_migration_deletes_the_key(
    nodes: list[RedisServer], cluster: RedisCluster, prefix: str
) -> None:
    """Released while its slot is halfway through a migration (the lease already renewed
    on the target, after ASKING): the release goes there with ASKING too and deletes the
    key, rather than leaving it to expire by its TTL."""
    key = f"{prefix}{{parting}}"
    source, target = _owner_and_other(nodes, key)
    renewals = _Renewals()
    async with asynclock.lease(
        cluster, "parting", ttl=1.5, prefix=prefix, on_event=renewals.on_event
    ) as lock:
        await renewals.more(1)
        slot = await anyio.to_thread.run_sync(_start_migration, source, target, key)
        await renewals.more(1)  # (ASK: moved to the target)
    try:
        assert lock.state is asynclock.LeaseState.RELEASED
        assert await _pttl(target, key, asking=True) == -2
    finally:
        await anyio.to_thread.run_sync(_finish_migration, nodes, target, slot)


async def test_extend_and_release_follow_a_migration_no_renewal_saw(
    nodes: list[RedisServer], cluster: RedisCluster, prefix: str
) -> None:
    """The slot migrates between two renewals (ttl 9 s: none due): extend() and the
    release, answered MOVED, follow it to the new owner, where the key is renewed and
    then deleted, rather than failing or leaving the key to its TTL."""
    key = f"{prefix}{{quiet}}"
    source, target = _owner_and_other(nodes, key)
    lock = await asynclock.acquire(cluster, "quiet", ttl=9.0, prefix=prefix)
    try:
        await _migrate(nodes, source, target, key)
        assert await lock.is_held(verify=True)  # (answered MOVED: asks the new owner)
        await lock.extend()
        assert await _pttl(target, key) > 8000
        assert lock.state is asynclock.LeaseState.HELD
    finally:
        await lock.release()
    assert await _pttl(target, key) == -2
    assert lock.state is asynclock.LeaseState.RELEASED
    other = await asynclock.acquire(cluster, "twice", ttl=9.0, prefix=prefix)
    key = f"{prefix}{{twice}}"
    source, target = _owner_and_other(nodes, key)
    await _migrate(nodes, source, target, key)
    await other.release()  # (no renewal, no extend: the release alone follows)
    assert await _pttl(target, key) == -2


async def test_a_waiter_with_an_old_slot_map_is_woken_on_the_new_owner(
    nodes: list[RedisServer], cluster: RedisCluster, cluster_type: ClusterType, prefix: str
) -> None:
    """A client whose slot map predates a migration: its waiter subscribes on the old
    owner first (refused: MOVED), its attempt is MOVED too, and it waits on the new
    owner, woken there by the release (the holder's TTL is 30 s); the old owner's
    subscription connection still serves that client's waiters of its other locks."""
    key = f"{prefix}{{moved}}"
    source, target = _owner_and_other(nodes, key)
    stale = cluster_type(host="127.0.0.1", port=source.port)
    await stale.initialize()
    holder = await asynclock.acquire(cluster, "moved", ttl=30.0, prefix=prefix)
    try:
        await _migrate(nodes, source, target, key)
        await holder.extend()  # (the holder follows the slot now: see the tests above)

        async def wait_for(name: str) -> float:
            async with asynclock.lease(stale, name, ttl=5.0, prefix=prefix):
                return time.monotonic()

        waiting = asyncio.create_task(wait_for("moved"))
        done, _ = await asyncio.wait([waiting], timeout=1.0)
        assert not done
        released = time.monotonic()
        await holder.release()
        async with asyncio.timeout(10):
            entered = await waiting
        assert released <= entered < released + 3.0
        # another lock of the old owner: a waiter there is woken as before
        other = next(
            name
            for name in (f"o{i}" for i in range(100))
            if _owner(nodes, f"{prefix}{{{name}}}") is source
        )
        second = await asynclock.acquire(cluster, other, ttl=30.0, prefix=prefix)
        waiting = asyncio.create_task(wait_for(other))
        done, _ = await asyncio.wait([waiting], timeout=1.0)
        assert not done
        released = time.monotonic()
        await second.release()
        async with asyncio.timeout(10):
            entered = await waiting
        assert released <= entered < released + 3.0
    finally:
        with contextlib.suppress(LockLost, RuntimeError):
            await holder.release()
        await stale.aclose()


async def test_local_waiters_follow_their_lock_to_its_new_owner(
    nodes: list[RedisServer], cluster: RedisCluster, prefix: str
) -> None:
    """A waiter of the holder's own client, queued on the old owner's node when the slot
    migrates: the holder's lease moves (here by extend(), answered MOVED) and wakes it,
    so it moves too and gets the lock at the release, not at the holder's TTL (30 s)."""
    key = f"{prefix}{{local}}"
    source, target = _owner_and_other(nodes, key)
    holder = await asynclock.acquire(cluster, "local", ttl=30.0, prefix=prefix)

    async def waiter() -> float:
        async with asynclock.lease(cluster, "local", ttl=5.0, prefix=prefix):
            return time.monotonic()

    waiting = asyncio.create_task(waiter())
    try:
        done, _ = await asyncio.wait([waiting], timeout=0.5)
        assert not done
        await _migrate(nodes, source, target, key)
        await holder.extend()
        done, _ = await asyncio.wait([waiting], timeout=0.5)
        assert not done
        released = time.monotonic()
        await holder.release()
        async with asyncio.timeout(10):
            entered = await waiting
        assert released <= entered < released + 3.0
    finally:
        waiting.cancel()
        with contextlib.suppress(LockLost, RuntimeError):
            await holder.release()


async def test_waiters_are_woken_by_sharded_pub_sub(
    nodes: list[RedisServer], cluster: RedisCluster, cluster_type: ClusterType, prefix: str
) -> None:
    """A waiter of another cluster client subscribes with SSUBSCRIBE on the node that
    owns the lock's slot (no plain subscription on any node) and is woken by the
    release's SPUBLISH, long before the holder's TTL (30 s) would let it in."""
    other = cluster_type(host="127.0.0.1", port=nodes[2].port)
    channel = f"{prefix}{{s}}:released"
    owner = _owner(nodes, channel)
    clients = {n.port: Redis(host="127.0.0.1", port=n.port) for n in nodes}

    async def subscribers(port: int, kind: str) -> int:
        reply = await clients[port].execute_command("PUBSUB", kind, channel)
        return int(reply[1])

    async def waiter() -> float:
        started = time.monotonic()
        async with asynclock.lease(other, "s", ttl=30.0, prefix=prefix):
            return time.monotonic() - started

    try:
        async with asynclock.lease(cluster, "s", ttl=30.0, prefix=prefix):
            waiting = asyncio.create_task(waiter())
            async with asyncio.timeout(10):  # (another process's state)
                while not await subscribers(owner.port, "SHARDNUMSUB"):  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            for port in clients:
                assert await subscribers(port, "NUMSUB") == 0
        async with asyncio.timeout(10):
            waited = await waiting
        assert waited < 5.0, waited
    finally:
        await other.aclose()
        for client in clients.values():
            await client.aclose()


def _start_migration(source: RedisServer, target: RedisServer, key: str) -> int:
    """Start moving ``key``'s slot from ``source`` to ``target`` and move its keys (as
    ``redis-cli --cluster reshard`` does it); returns the slot, still ``MIGRATING``."""
    slot = int(source.command("CLUSTER", "KEYSLOT", key).strip()[1:])
    target.command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(source))
    source.command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(target))
    while True:
        reply = source.command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        names = [line for line in reply.split(b"\r\n")[1:] if line and not line.startswith(b"$")]
        if not names:
            return slot
        source.command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *names)


async def _migrate(
    nodes: list[RedisServer], source: RedisServer, target: RedisServer, key: str
) -> None:
    """Move ``key``'s slot from ``source`` to ``target``, whole (see _start_migration)."""
    slot = await anyio.to_thread.run_sync(_start_migration, source, target, key)
    await anyio.to_thread.run_sync(_finish_migration, nodes, target, slot)


def _owner_and_other(nodes: list[RedisServer], key: str) -> tuple[RedisServer, RedisServer]:
    """The node that owns ``key``'s slot, and another one (to migrate it to)."""
    source = _owner(nodes, key)
    return source, next(n for n in nodes if n is not source)


def _finish_migration(nodes: list[RedisServer], target: RedisServer, slot: int) -> None:
    """``target`` owns ``slot`` now (every node told, the target first)."""
    for server in sorted(nodes, key=lambda n: n is not target):
        server.command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(target))


class _Renewals:
    """Counts a lease's renewals; ``await renewals.more(n)``: n more than now."""

    def __init__(self) -> None:
        self.count = 0
        self._wanted = 1 << 30
        self._reached = asyncio.Event()

    def on_event(self, event: asynclock.LeaseEvent) -> None:
        if event.kind is asynclock.LeaseEventKind.RENEWED:
            self.count += 1
            if self.count >= self._wanted:
                self._reached.set()

    async def more(self, n: int) -> None:
        self._wanted = self.count + n
        self._reached.clear()
        async with asyncio.timeout(15):
            await self._reached.wait()


async def _pttl(server: RedisServer, key: str, *, asking: bool = False) -> int:
    """PTTL of ``key`` on ``server`` (after ASKING: on the target of a migration)."""
    client = Redis(host="127.0.0.1", port=server.port, single_connection_client=True)
    try:
        if asking:
            await client.execute_command("ASKING")
        return int(await client.pttl(key))
    finally:
        await client.aclose()


async def test_a_held_lease_follows_its_slot_to_another_primary(
    nodes: list[RedisServer], cluster: RedisCluster, cluster_type: ClusterType, prefix: str
) -> None:
    """The slot of a held lock moves to another primary, its key with it: the holder's
    renewals, answered MOVED, go to the new owner and keep the lease (nobody else gets
    the lock); the release deletes the key there; a new lease is then taken on the new
    owner through the same cluster client (its MOVED reloads the slot map)."""
    key = f"{prefix}{{moving}}"
    source, target = _owner_and_other(nodes, key)
    other = cluster_type(host="127.0.0.1", port=target.port)
    renewals = _Renewals()
    try:
        async with asynclock.lease(
            cluster, "moving", ttl=1.5, prefix=prefix, on_event=renewals.on_event
        ) as lock:
            await renewals.more(1)  # (the renewals' connection is the source's)
            await _migrate(nodes, source, target, key)
            await renewals.more(2)
            assert lock.state is asynclock.LeaseState.HELD
            assert await _pttl(target, key) > 700  # (renewed there within 0.5 s)
            with pytest.raises(RuntimeError, match="already held by this task"):
                async with asynclock.lease(cluster, "moving", prefix=prefix):
                    pass
            with pytest.raises(LockBusy):
                async with asynclock.lease(other, "moving", blocking=False, prefix=prefix):
                    pass
        assert lock.state is asynclock.LeaseState.RELEASED
        assert await _pttl(target, key) == -2  # (released there)
        # the first cluster client still has the old map: its acquire is MOVED, reloads
        async with asynclock.lease(cluster, "moving", ttl=1.0, prefix=prefix) as again:
            assert await _pttl(target, again.key) > 0
            assert again.fencing_token > lock.fencing_token
    finally:
        await other.aclose()


async def test_a_held_lease_is_renewed_while_its_slot_migrates(
    nodes: list[RedisServer], cluster: RedisCluster, prefix: str
) -> None:
    """Mid-migration (the slot MIGRATING on its owner, IMPORTING on the target, the key
    already moved) the owner answers a renewal with ASK: the lease is renewed on the
    target after ASKING, stays held, and stays held once the migration ends."""
    key = f"{prefix}{{halfway}}"
    source, target = _owner_and_other(nodes, key)
    renewals = _Renewals()
    async with asynclock.lease(
        cluster, "halfway", ttl=1.5, prefix=prefix, on_event=renewals.on_event
    ) as lock:
        await renewals.more(1)
        slot = await anyio.to_thread.run_sync(_start_migration, source, target, key)
        await renewals.more(2)
        assert lock.state is asynclock.LeaseState.HELD
        assert await lock.is_held(verify=True)  # (on the target, after ASKING)
        with pytest.raises(AskError):  # (not on the source any more)
            await _pttl(source, key)
        assert await _pttl(target, key, asking=True) > 700
        await anyio.to_thread.run_sync(_finish_migration, nodes, target, slot)
        await renewals.more(2)
        assert lock.state is asynclock.LeaseState.HELD
        assert await _pttl(target, key) > 700
    assert lock.state is asynclock.LeaseState.RELEASED
    assert await _all_keys_left(nodes, prefix) == []


async def test_an_acquire_waits_for_its_slots_migration(
    nodes: list[RedisServer], cluster: RedisCluster, prefix: str
) -> None:
    """A blocking acquire of a lock whose slot is halfway through a migration (its owner
    answers ASK) waits for the migration to end, longer than its old give-up of about
    1.5 s, then takes the lock on the new owner; its blocking_timeout counts once, from
    the call, across the attempts."""
    key = f"{prefix}{{later}}"
    source, target = _owner_and_other(nodes, key)
    slot = await anyio.to_thread.run_sync(_start_migration, source, target, key)
    waiting = asyncio.create_task(
        asynclock.acquire(cluster, "later", ttl=5.0, blocking_timeout=30.0, prefix=prefix)
    )
    done, _ = await asyncio.wait([waiting], timeout=2.5)
    assert not done, waiting.result() if not waiting.exception() else waiting.exception()
    await anyio.to_thread.run_sync(_finish_migration, nodes, target, slot)
    async with asyncio.timeout(10):
        lock = await waiting
    try:
        assert await _pttl(target, key) > 0
    finally:
        await lock.release()
    other = f"{prefix}{{never}}"
    source, target = _owner_and_other(nodes, other)
    slot = await anyio.to_thread.run_sync(_start_migration, source, target, other)
    try:
        started = time.monotonic()
        with pytest.raises(asynclock.AcquireTimeout):
            await asynclock.acquire(cluster, "never", blocking_timeout=1.0, prefix=prefix)
        assert time.monotonic() - started < 5.0
    finally:
        await anyio.to_thread.run_sync(_finish_migration, nodes, target, slot)


async def test_an_acquire_waits_while_its_slot_is_not_served(
    nodes: list[RedisServer], cluster: RedisCluster, prefix: str
) -> None:
    """The lock's slot stops being served (its owner drops it: the cluster answers
    CLUSTERDOWN, as during a failover): a blocking acquire waits, and takes the lock once
    the slot is served again, rather than raising the first CLUSTERDOWN."""
    key = f"{prefix}{{down}}"
    owner = _owner(nodes, key)
    slot = int(owner.command("CLUSTER", "KEYSLOT", key).strip()[1:])
    owner.command("CLUSTER", "DELSLOTS", slot)
    try:
        waiting = asyncio.create_task(
            asynclock.acquire(cluster, "down", ttl=5.0, blocking_timeout=60.0, prefix=prefix)
        )
        done, _ = await asyncio.wait([waiting], timeout=1.5)
        assert not done, waiting.exception()
    finally:
        owner.command("CLUSTER", "ADDSLOTS", slot)
    async with asyncio.timeout(30):
        lock = await waiting
    await lock.release()


def _node_id(server: RedisServer) -> str:
    return server.command("CLUSTER", "MYID").split(b"\r\n")[1].decode()


def _sees_replica(server: RedisServer, replica: str, primary: str) -> bool:
    """Whether ``server``'s CLUSTER NODES lists node ``replica`` as a connected replica
    of node ``primary`` (past the handshake: only then does it vote for its promotion)."""
    for line in server.command("CLUSTER", "NODES").decode(errors="replace").splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[0] == replica:
            flags = fields[2].split(",")
            return (
                "slave" in flags
                and "handshake" not in flags
                and fields[3] == primary
                and fields[7] == "connected"
            )
    return False


async def test_a_failover_of_the_locks_primary(
    nodes: list[RedisServer], cluster: RedisCluster, cluster_type: ClusterType, prefix: str
) -> None:
    """The primary of a held lock (confirmed by its replica: min_replicas=1) is
    SIGKILLed and the cluster promotes its replica: the holder is cancelled at its
    deadline, nobody gets the lock before that, and new leases reach the new primary
    through the same cluster clients (their slot maps reloaded)."""
    key = f"{prefix}{{failover}}"
    primary = _owner(nodes, key)
    replica = RedisServer(cluster=True).start()
    survivors = [n for n in nodes if n is not primary]  # (they vote for the promotion)
    other = cluster_type(host="127.0.0.1", port=survivors[0].port)
    try:
        primary.command("CLUSTER", "MEET", "127.0.0.1", replica.port)
        wait_until(
            lambda: b"cluster_known_nodes:4" in replica.command("CLUSTER", "INFO"),
            "the new node did not join",
        )
        primary_id, replica_id = _node_id(primary), _node_id(replica)
        replica.command("CLUSTER", "REPLICATE", primary_id)
        wait_until(
            lambda: b"master_link_status:up" in replica.command("INFO", "replication"),
            "the replica did not sync",
        )
        for server in survivors:
            wait_until(
                lambda s=server: _sees_replica(s, replica_id, primary_id),
                f"node {server.port} does not know the replica yet",
            )
        await other.initialize()
        rival_in: float | None = None
        holder_out = 0.0
        refused: list[BaseException] = []  # (the rival's, for a failure's message)

        async def rival() -> None:
            nonlocal rival_in
            while True:
                try:
                    async with asynclock.lease(
                        other, "failover", ttl=1.0, blocking=False, prefix=prefix
                    ):
                        rival_in = time.monotonic()
                        return
                except (LockBusy, RedisError) as exc:
                    refused[-9:] = [*refused[-9:], exc]
                await asyncio.sleep(0.05)

        waiter_in: float | None = None

        async def waiter() -> None:
            """A blocking acquire made while the primary is dead waits for the promotion
            (within its blocking_timeout), rather than failing at once."""
            nonlocal waiter_in
            async with asynclock.lease(
                other, "failover", ttl=1.0, blocking_timeout=25, prefix=prefix
            ):
                waiter_in = time.monotonic()

        held: asynclock.Lease | None = None
        async with asyncio.timeout(10):  # (a replica slow to acknowledge: try again)
            while held is None:
                with contextlib.suppress(ReplicationTimeout):
                    held = await asynclock.acquire(
                        cluster, "failover", ttl=1.5, min_replicas=1, prefix=prefix
                    )
        with pytest.raises(LockLost):
            async with held.guard():
                primary.kill()
                rival_task = asyncio.create_task(rival())
                waiter_task = asyncio.create_task(waiter())
                try:
                    await anyio.sleep_forever()
                finally:
                    holder_out = time.monotonic()
        with contextlib.suppress(LockLost):
            await held.release()
        try:
            async with asyncio.timeout(30):
                await rival_task
        except TimeoutError:
            state = "\n".join(
                f"node {s.port}:\n{s.command('CLUSTER', 'NODES').decode(errors='replace')}"
                for s in [replica, *survivors]
            )
            pytest.fail(
                f"no rival got in 30 s after the kill: {refused!r}\n{state}\n"
                f"the replica's log:\n{replica.log_tail(40)}"
            )
        assert rival_in is not None
        assert rival_in >= holder_out
        async with asyncio.timeout(30):
            await waiter_task  # (raises what the waiter's acquire raised)
        assert waiter_in is not None
        assert waiter_in >= holder_out
        async with asyncio.timeout(30):
            while True:  # (the first client's map names the dead primary until reloaded)
                with contextlib.suppress(LockBusy, RedisError):
                    async with asynclock.lease(cluster, "failover", ttl=1.0, prefix=prefix) as lock:
                        promoted = Redis(host="127.0.0.1", port=replica.port)
                        try:
                            assert await promoted.exists(lock.key) == 1
                        finally:
                            await promoted.aclose()
                        break
                await asyncio.sleep(0.05)
    finally:
        await other.aclose()
        replica.stop()
