"""The fault matrix of issue 3: each test names a fault, injects it for real, and checks
what must hold. TTLs are short (0.5-1 s) to keep the run fast; time bounds are generous.

Figures that are allowed but must be reported (overlap after data loss, cancellation
latency) go to the ``figures`` plugin and are printed after the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from figures import Figures
from helpers import run_out_of_memory, wait_until
from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError

import asynclock
from asynclock import LeaseEventKind, LeaseState, LockLost, LossReason
from asynclock._session._connections import companion_for
from asynclock.testing import FaultProxy, ProxyMode, RedisServer


def _on_renewal(event: asyncio.Event, sent_at: list[float] | None = None) -> Any:
    """A hook that sets ``event`` at each renewal, and notes in ``sent_at`` the loop time
    at which each confirmed renewal was sent (its ``at`` less its round trip)."""

    def hook(e: asynclock.LeaseEvent) -> None:
        if e.kind is LeaseEventKind.RENEWED:
            if sent_at is not None and e.latency is not None:
                sent_at.append(e.at - e.latency)
            event.set()

    return hook


async def _server_time(client: Redis) -> float:
    """The server's clock, in seconds since the epoch."""
    seconds, micros = await client.time()
    return seconds + micros / 1e6


# -- proxy delay --------------------------------------------------------------------------


@contextlib.contextmanager
def _events_on_loss(events: list[asynclock.LeaseEvent]) -> Iterator[None]:
    """A ``LockLost`` out of the block fails the test with the lease's events, which say
    which renewal took too long (or failed) and when."""
    try:
        yield
    except LockLost as lost:
        pytest.fail(f"{lost!r}; the lease's events: {events}")


async def test_delay_within_budget_loses_nothing(private_server: RedisServer, prefix: str):
    """Delay of 60 ms each way (RTT 120 ms < ttl/3): renewals still land; no LockLost."""
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        events: list[asynclock.LeaseEvent] = []
        try:
            with _events_on_loss(events):
                async with asynclock.lease(
                    client, "slow-net", ttl=0.9, prefix=prefix, on_event=events.append
                ) as lock:
                    proxy.set_mode(ProxyMode.DELAY, delay=0.06, jitter=0.02)
                    started = time.monotonic()
                    while time.monotonic() - started < 2.5:
                        assert await lock.is_held()
                        await asyncio.sleep(0.05)
                    proxy.set_mode(ProxyMode.PASS)
            kinds = [e.kind for e in events]
            # (the events in the message: a renewal failure says what took too long)
            assert kinds.count(LeaseEventKind.RENEWED) >= 6, events
            assert LeaseEventKind.LOST not in kinds, events
        finally:
            await client.aclose()


async def test_delay_beyond_budget_loses_at_the_safe_deadline(
    private_server: RedisServer, prefix: str
):
    """Delay of 0.5 s each way (RTT > ttl): LockLost(deadline) at the safe deadline,
    which is counted from the instant the last confirmed command was sent."""
    ttl = 0.6
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        renewed = asyncio.Event()
        sent_at: list[float] = []
        stopped_at = 0.0
        try:
            with pytest.raises(LockLost) as caught:
                async with asynclock.lease(
                    client,
                    "very-slow-net",
                    ttl=ttl,
                    prefix=prefix,
                    release_timeout=0.2,
                    on_event=_on_renewal(renewed, sent_at),
                ) as lock:
                    await renewed.wait()
                    t_send = sent_at[-1]  # (the confirmed renewal's send time)
                    proxy.set_mode(ProxyMode.DELAY, delay=0.5)
                    try:
                        await anyio.sleep_forever()
                    finally:
                        stopped_at = asyncio.get_running_loop().time()
            assert caught.value.reason is LossReason.DEADLINE
            assert lock.safe_until == pytest.approx(t_send + ttl - (ttl * 0.01 + 0.002))
            assert stopped_at >= lock.safe_until  # not before the deadline ...
            assert stopped_at - lock.safe_until < 0.2  # ... and promptly at it
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await client.aclose()


# -- blackhole ------------------------------------------------------------------------


async def test_blackhole_rival_only_after_server_expiry_and_client_heals(
    private_server: RedisServer, prefix: str
):
    """Blackhole both ways while holding: the body is cancelled by the deadline; a rival
    gets the lock only after the key expired on the server; after healing the client
    works again."""
    ttl = 0.9
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url, socket_timeout=2)
        rival = Redis.from_url(private_server.url)
        renewed = asyncio.Event()
        cancelled_wall = 0.0
        try:
            with pytest.raises(LockLost):
                async with asynclock.lease(
                    client,
                    "cut",
                    ttl=ttl,
                    prefix=prefix,
                    release_timeout=0.2,
                    on_event=_on_renewal(renewed),
                ) as lock:
                    await renewed.wait()
                    expires_at = int(await rival.execute_command("PEXPIRETIME", lock.key)) / 1000
                    proxy.set_mode(ProxyMode.BLACKHOLE)
                    rival_task = asyncio.create_task(_acquire_wall_time(rival, "cut", prefix))
                    try:
                        await anyio.sleep_forever()
                    finally:
                        cancelled_wall = time.time()
            rival_wall, rival_fence = await rival_task
            assert cancelled_wall < expires_at <= rival_wall + 0.005
            assert rival_fence > lock.fencing_token
            proxy.set_mode(ProxyMode.PASS)
            await proxy.reset_all()  # drop the connections that ate the blackholed bytes
            async with asynclock.lease(client, "healed", ttl=ttl, prefix=prefix) as again:
                assert await again.is_held(verify=True)
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await client.aclose()
            await rival.aclose()


async def _acquire_wall_time(redis: Redis, name: str, prefix: str) -> tuple[float, int]:
    async with asynclock.lease(redis, name, ttl=5, prefix=prefix, blocking_timeout=10) as lock:
        return time.time(), lock.fencing_token


# -- server stalls ----------------------------------------------------------------------


@pytest.mark.parametrize("stall", ["debug-sleep", "sigstop", "client-pause-write"])
async def test_server_stall_longer_than_ttl(private_server: RedisServer, prefix: str, stall: str):
    """A server stall longer than the TTL: LockLost at the deadline, no hang, no overlap."""
    ttl = 0.6
    client = Redis.from_url(private_server.url)
    staller = Redis.from_url(private_server.url)
    renewed = asyncio.Event()
    sleeper: asyncio.Task[Any] | None = None
    try:
        started = 0.0
        with pytest.raises(LockLost) as caught:
            async with asynclock.lease(
                client,
                "stalled",
                ttl=ttl,
                prefix=prefix,
                release_timeout=0.3,
                on_event=_on_renewal(renewed),
            ) as lock:
                await renewed.wait()
                await staller.ping()
                started = time.monotonic()
                if stall == "debug-sleep":
                    sleeper = asyncio.create_task(staller.execute_command("DEBUG", "SLEEP", "2"))
                elif stall == "sigstop":
                    private_server.pause()
                else:
                    await staller.execute_command("CLIENT", "PAUSE", "2000", "WRITE")
                await anyio.sleep_forever()
        assert caught.value.reason is LossReason.DEADLINE
        assert time.monotonic() - started < ttl + 0.3 + 1.0  # no hang
    finally:
        private_server.resume()
        if sleeper is not None:
            await sleeper
        await client.aclose()
        await staller.aclose()
    observer = Redis.from_url(private_server.url)
    try:  # nobody else held it meanwhile, and nothing of ours is left once the server moved on
        async with asynclock.lease(observer, "stalled", ttl=ttl, prefix=prefix) as after:
            assert after.fencing_token > lock.fencing_token
    finally:
        await observer.aclose()


# -- data loss ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["flushall", "del", "foreign-set"])
async def test_key_lost_on_the_server(private_server: RedisServer, prefix: str, how: str):
    """FLUSHALL, DEL, a foreign SET: LockLost within one renewal period; the release
    never deletes a foreign key."""
    ttl = 0.9
    client = Redis.from_url(private_server.url)
    try:
        with pytest.raises(LockLost) as caught:
            async with asynclock.lease(client, "wiped", ttl=ttl, prefix=prefix) as lock:
                done_at = time.monotonic()
                if how == "flushall":
                    await client.flushall()
                elif how == "del":
                    await client.delete(lock.key)
                else:
                    await client.set(lock.key, "foreign", px=60_000)
                await anyio.sleep_forever()
        assert caught.value.reason is LossReason.NOT_OWNER
        assert time.monotonic() - done_at < ttl / 3 + 0.5
        if how == "foreign-set":
            assert await client.get(lock.key) == b"foreign"
        else:
            assert await client.exists(lock.key) == 0
    finally:
        await client.aclose()


async def test_restart_without_persistence_loses_lease_and_fencing_holds(
    private_server: RedisServer, prefix: str, figures: Figures
):
    """Kill and restart without persistence: LockLost; a rival may take the lock before
    the holder notices (the overlap is measured and reported); its fencing token is higher
    even though the server lost its counter."""
    ttl = 0.9
    client = Redis.from_url(private_server.url)
    rival = Redis.from_url(private_server.url)
    rival_in = 0.0
    holder_out = 0.0
    try:
        with pytest.raises(LockLost) as caught:
            async with asynclock.lease(client, "volatile", ttl=ttl, prefix=prefix) as lock:
                private_server.kill()
                private_server.restart()
                async with asynclock.lease(rival, "volatile", ttl=ttl, prefix=prefix) as other:
                    rival_in = time.monotonic()
                    rival_fence = other.fencing_token
                    try:
                        await anyio.sleep_forever()
                    finally:
                        holder_out = time.monotonic()
        assert caught.value.reason in (LossReason.NOT_OWNER, LossReason.DEADLINE)
        assert rival_fence > lock.fencing_token
        overlap = holder_out - rival_in
        assert overlap < ttl  # at most until the holder's next renewal or its deadline
        figures.add(
            "restart without persistence",
            f"holders overlapped {overlap * 1000:.0f} ms (ttl {ttl} s); fencing held",
        )
    finally:
        await client.aclose()
        await rival.aclose()


@pytest.mark.parametrize("private_server", [{"persistence": True}], indirect=True)
async def test_clean_restart_with_appendfsync_always_loses_nothing(
    private_server: RedisServer, prefix: str
):
    """appendonly + appendfsync always and a clean restart: the key comes back, renewals
    resume (scripts reloaded after NOSCRIPT), the lease is never lost."""
    client = Redis.from_url(private_server.url)
    events: list[asynclock.LeaseEvent] = []
    try:
        async with asynclock.lease(
            client, "durable", ttl=2.0, prefix=prefix, on_event=events.append
        ) as lock:
            await asyncio.to_thread(private_server.restart)  # the loop keeps running
            renewed_after = len(events)
            started = time.monotonic()
            while time.monotonic() - started < 2.0:
                assert await lock.is_held()
                await asyncio.sleep(0.05)
            assert await lock.is_held(verify=True)
        kinds = [e.kind for e in events]
        assert LeaseEventKind.LOST not in kinds
        assert LeaseEventKind.RENEWED in [e.kind for e in events[renewed_after:]]
        assert lock.state is LeaseState.RELEASED
    finally:
        await client.aclose()


# -- memory ---------------------------------------------------------------------------


async def test_out_of_memory_refuses_acquire_but_held_leases_renew(
    private_server: RedisServer, prefix: str
):
    """Out of memory under noeviction: a new acquire fails with a clear error, a lease
    already held keeps renewing and releases cleanly."""
    client = Redis.from_url(private_server.url)
    events: list[asynclock.LeaseEvent] = []
    try:
        async with asynclock.lease(
            client, "held", ttl=0.6, prefix=prefix, on_event=events.append
        ) as lock:
            await run_out_of_memory(client, prefix)
            with pytest.raises(OutOfMemoryError) as caught:
                async with asynclock.lease(client, "new", ttl=0.6, prefix=prefix):
                    pass
            assert any("out of memory" in note for note in caught.value.__notes__)
            started = time.monotonic()
            while time.monotonic() - started < 1.5:
                assert await lock.is_held()
                await asyncio.sleep(0.05)
        kinds = [e.kind for e in events]
        assert kinds.count(LeaseEventKind.RENEWED) >= 4
        assert LeaseEventKind.LOST not in kinds
        assert LeaseEventKind.RELEASED in kinds
        assert await client.exists(prefix + "{held}", prefix + "{new}") == 0
    finally:
        await client.config_set("maxmemory", "0")
        await client.aclose()


async def test_out_of_memory_a_local_waiter_waits_and_is_handed_the_lock(
    private_server: RedisServer, prefix: str
):
    """Out of memory under noeviction: a blocking waiter of the same client keeps waiting
    (its registration as waiting is skipped, not fatal) and the holder's release hands it
    the lock (the handoff script writes nothing that memory can refuse first)."""
    client = Redis.from_url(private_server.url)
    entered = asyncio.Event()
    fences: list[int] = []

    async def waiter() -> None:
        async with asynclock.lease(client, "relay", ttl=5, prefix=prefix) as lock:
            fences.append(lock.fencing_token)
            entered.set()

    try:
        async with asynclock.lease(client, "relay", ttl=5, prefix=prefix) as first:
            await run_out_of_memory(client, prefix)
            task = asyncio.create_task(waiter())
            line = companion_for(client).room
            channel = f"{prefix}{{relay}}:released"
            # in line, its attempt answered "held" (its registration refused for memory)
            await wait_until(
                lambda: _true(line.waiting(channel) == 1 and line.registered(channel)),
                what="the waiter's failed attempt",
            )
            assert not task.done()
        async with asyncio.timeout(5):
            await entered.wait()
            await task
        assert fences[0] > first.fencing_token
        assert await client.exists(prefix + "{relay}") == 0
    finally:
        await client.config_set("maxmemory", "0")
        await client.aclose()


async def _true(value: bool) -> bool:
    return value


async def test_evicting_policy_is_warned_about_once(
    private_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
):
    """A server that may evict lock keys is named in a one-time warning."""
    setup = Redis.from_url(private_server.url)
    await setup.config_set("maxmemory", "100mb")
    await setup.config_set("maxmemory-policy", "allkeys-lru")
    await setup.aclose()
    client = Redis.from_url(private_server.url)
    try:
        with caplog.at_level(logging.WARNING, logger="asynclock"):
            for _ in range(3):
                async with asynclock.lease(client, "evictable", ttl=1, prefix=prefix):
                    await asyncio.sleep(0.01)
        warnings = [r for r in caplog.records if "allkeys-lru" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        await client.aclose()


# -- stalls of the holder -------------------------------------------------------------


def _rival_in_thread(url: str, name: str, prefix: str, result: dict[str, Any]) -> None:
    """Acquire from another thread with its own event loop (runs while ours is blocked)."""

    async def run() -> None:
        rival = Redis.from_url(url)
        try:
            async with asynclock.lease(rival, name, ttl=5, prefix=prefix, blocking_timeout=5) as r:
                result["fence"] = r.fencing_token
                result["at"] = time.monotonic()
        finally:
            await rival.aclose()

    asyncio.run(run())


async def test_event_loop_stall_is_caught_on_resume_and_logged(
    redis_server: Any, prefix: str, caplog: pytest.LogCaptureFixture
):
    """A blocking call in the body (2.5 x ttl): a rival takes the lock meanwhile; on resume
    the holder's is_held() is False before its next effect, LockLost(deadline) comes out,
    the stall is logged by name, and the rival's fencing token is higher."""
    ttl = 0.5
    client = Redis.from_url(redis_server.url)
    rival: dict[str, Any] = {}
    effects_after_stall = 0
    try:
        with (
            caplog.at_level(logging.WARNING, logger="asynclock"),
            pytest.raises(LockLost) as caught,
        ):
            async with asynclock.lease(client, "stalled", ttl=ttl, prefix=prefix) as lock:
                thread = threading.Thread(
                    target=_rival_in_thread, args=(redis_server.url, "stalled", prefix, rival)
                )
                thread.start()
                time.sleep(2.5 * ttl)  # noqa: ASYNC251 - the stall under test
                if await lock.is_held():
                    effects_after_stall += 1
                await asyncio.sleep(0)
                effects_after_stall += 1
        thread.join(10)
        assert caught.value.reason is LossReason.DEADLINE
        assert effects_after_stall == 0
        assert rival["fence"] > lock.fencing_token
        assert any("stall" in r.getMessage() for r in caplog.records)
    finally:
        await client.aclose()


# -- failover -------------------------------------------------------------------------


async def test_failover_to_a_replica_that_missed_the_acquire(
    private_server: RedisServer, prefix: str, figures: Figures
):
    """The replica missed the acquire and is promoted (REPLICAOF NO ONE): a rival gets the
    lock there while the old holder still believes it holds it (measured); the old holder
    is cancelled at its deadline; the rival's fencing token is higher."""
    ttl = 0.9
    replica = private_server.replica()
    primary_client = Redis.from_url(private_server.url)
    replica_client = Redis.from_url(replica.url)
    rival_in: list[tuple[float, int]] = []
    holder_out = 0.0
    try:
        await _wait_replicated(primary_client, replica_client, prefix)
        # Cut replication: the replica is stopped and the primary drops its link, so
        # the acquire below never reaches the replica.
        replica.pause()
        await primary_client.client_kill_filter(_type="replica")
        with pytest.raises(LockLost) as caught:
            async with asynclock.lease(
                primary_client, "failover", ttl=ttl, prefix=prefix, release_timeout=0.2
            ) as lock:
                private_server.pause()  # the primary dies (stops answering)
                replica.resume()
                await replica_client.execute_command("REPLICAOF", "NO", "ONE")
                rival = asyncio.create_task(_hold_briefly(replica_client, prefix, ttl, rival_in))
                try:
                    await anyio.sleep_forever()
                finally:
                    holder_out = time.monotonic()
        await rival
        assert caught.value.reason is LossReason.DEADLINE
        ((rival_at, rival_fence),) = rival_in
        assert rival_fence > lock.fencing_token
        double_grant = holder_out - rival_at
        assert double_grant < ttl
        figures.add(
            "failover to a replica that missed the acquire",
            f"double grant lasted {max(double_grant, 0) * 1000:.0f} ms (ttl {ttl} s); fencing held",
        )
    finally:
        private_server.resume()
        await primary_client.aclose()
        await replica_client.aclose()
        replica.stop()


async def _hold_briefly(
    redis: Redis, prefix: str, ttl: float, entered: list[tuple[float, int]]
) -> None:
    async with asynclock.lease(redis, "failover", ttl=ttl, prefix=prefix) as lock:
        entered.append((time.monotonic(), lock.fencing_token))
        await asyncio.sleep(ttl)


async def _wait_replicated(primary: Redis, replica: Redis, prefix: str) -> None:
    """Wait until the replica has the primary's writes (WAIT blocks until acknowledged)."""
    await primary.set(prefix + "probe", "1")
    async with asyncio.timeout(10):
        while await replica.get(prefix + "probe") != b"1":
            await primary.execute_command("WAIT", 1, 100)


# -- cancellation latency --------------------------------------------------------------


async def test_cancellation_latency_after_the_deadline(
    private_server: RedisServer, prefix: str, figures: Figures
):
    """50 leases whose server stops: time from each safe deadline to its body having
    stopped; p50/p99 reported, and every body stopped within a generous bound."""
    ttl = 0.6
    client = Redis.from_url(private_server.url, max_connections=100)
    latencies: list[float] = []
    ready = asyncio.Event()
    entered = 0

    async def holder(i: int) -> None:
        nonlocal entered
        loop = asyncio.get_running_loop()
        try:
            async with asynclock.lease(
                client, f"n{i}", ttl=ttl, prefix=prefix, release_timeout=0.2
            ) as lock:
                entered += 1
                if entered == 50:
                    ready.set()
                try:
                    await anyio.sleep_forever()
                finally:
                    latencies.append(loop.time() - lock.safe_until)
        except LockLost:
            pass

    try:
        tasks = [asyncio.create_task(holder(i)) for i in range(50)]
        await ready.wait()
        private_server.pause()
        async with asyncio.timeout(ttl + 5):
            await asyncio.gather(*tasks)
    finally:
        private_server.resume()
        await client.aclose()
    assert len(latencies) == 50
    assert min(latencies) >= 0  # never before the deadline
    ordered = sorted(latencies)
    p50 = statistics.median(ordered) * 1000
    p99 = ordered[int(0.99 * (len(ordered) - 1))] * 1000
    assert max(latencies) < 0.5
    figures.add(
        "cancellation latency", f"deadline -> body stopped p50 {p50:.2f} ms, p99 {p99:.2f} ms"
    )


# -- no fault, many workers -------------------------------------------------------------


async def test_no_fault_eight_workers_two_hundred_rounds(
    redis_server: Any, make_client: Any, prefix: str, tmp_path: Any
):
    """No fault, 8 workers x 200 rounds (two clients, so waking crosses pub/sub too): no
    overlap, strictly increasing fences, an exact counter, no LockLost, no key left."""
    from asynclock.testing import (
        FencedStore,
        History,
        check_counter,
        check_fenced_writes,
        check_fencing,
        check_no_overlap,
        keys_left,
    )

    history = History()
    store = FencedStore(tmp_path / "fenced.db")
    clients = [make_client(redis_server.url), make_client(redis_server.url)]
    rounds = 200

    async def worker(n: int) -> None:
        redis = clients[n % 2]
        for _ in range(rounds):
            async with asynclock.lease(
                redis, "counter", ttl=1.0, prefix=prefix, on_event=history.on_event
            ) as lock:
                with history.guard_lease(lock, f"w{n}"):
                    assert await lock.is_held()
                    assert await store.increment("counter", fencing_token=lock.fencing_token)

    try:
        async with asyncio.timeout(120):
            await asyncio.gather(*(worker(n) for n in range(8)))
        intervals = history.intervals
        assert len(intervals) == 8 * rounds
        assert not check_no_overlap(intervals)
        assert not check_fencing(intervals)
        assert not check_counter(8 * rounds, store.read_int("counter"))
        assert not check_fenced_writes(store)
        assert not history.losses
        assert await keys_left(clients[0], prefix) == []
    finally:
        store.close()


# -- the holder process paused ----------------------------------------------------------

_PAUSED_HOLDER = """
import asyncio, sys, time
from redis.asyncio import Redis
import asynclock
from asynclock.testing import FencedStore

async def main(url, prefix, db):
    store = FencedStore(db)
    redis = Redis.from_url(url)
    lock = None
    try:
        async with asynclock.lease(redis, "job", ttl=0.6, prefix=prefix) as lock:
            print("held", lock.fencing_token, flush=True)
            while True:
                if not await lock.is_held():
                    print("stopped-before-effect", time.monotonic(), flush=True)
                    await asyncio.sleep(3600)  # the loss cancels us here
                store.write("resource", "holder", lock.fencing_token, holder="paused")
                print("wrote", time.monotonic(), flush=True)
                await asyncio.sleep(0.02)
    except asynclock.LockLost as lost:
        print("LockLost", lost.reason.value, time.monotonic(), flush=True)
    stale = store.write("resource", "stale", lock.fencing_token, holder="paused")
    print("stale-write-accepted", stale, flush=True)
    await redis.aclose()

asyncio.run(main(*sys.argv[1:]))
"""


async def test_paused_holder_process_is_fenced_off(
    redis_server: Any, make_client: Any, prefix: str, tmp_path: Any
):
    """The holder process is SIGSTOPped for 2.5 x ttl: a rival takes over (overlap is
    allowed), the fenced resource accepts no stale write, and on resume the holder stops
    before its next effect and raises LockLost."""
    import os
    import signal
    import sys

    from asynclock.testing import FencedStore, check_fenced_writes

    ttl = 0.6
    db = tmp_path / "fenced.db"
    store = FencedStore(db)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _PAUSED_HOLDER,
        redis_server.url,
        prefix,
        str(db),
        stdout=asyncio.subprocess.PIPE,
        cwd=os.getcwd(),
    )
    assert child.stdout is not None
    try:
        async with asyncio.timeout(30):
            first = (await child.stdout.readline()).split()
            assert first[0] == b"held"
            holder_fence = int(first[1])
            await child.stdout.readline()  # it has written once
            child.send_signal(signal.SIGSTOP)
            rival = make_client(redis_server.url)
            async with asynclock.lease(rival, "job", ttl=ttl, prefix=prefix) as lock:
                assert lock.fencing_token > holder_fence
                assert store.write("resource", "rival", lock.fencing_token, holder="rival")
                await asyncio.sleep(2.5 * ttl)  # the pause (a fault's length, not a wait)
                resumed_at = time.monotonic()
                child.send_signal(signal.SIGCONT)
                lines = [line.split() for line in (await child.stdout.read()).splitlines()]
        await child.wait()
        writes_after = [float(w[1]) for w in lines if w[0] == b"wrote" and float(w[1]) > resumed_at]
        assert writes_after == []  # no effect after resuming
        losses = [w[:2] for w in lines if w[0] == b"LockLost"]
        assert losses == [[b"LockLost", b"deadline"]]
        assert [b"stale-write-accepted", b"False"] in lines
        assert store.read("resource") == "rival"
        assert not check_fenced_writes(store)
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            await child.wait()
        store.close()


async def test_an_acquire_answered_too_late_is_not_handed_out(
    private_server: RedisServer, prefix: str
):
    """An acquire whose reply leaves under a third of the TTL is not handed out: it is
    refreshed with the same token while the caller waits, and undone if time runs out."""
    ttl = 0.6
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        observer = Redis.from_url(private_server.url)
        try:
            await client.ping()
            proxy.set_mode(ProxyMode.DELAY, delay=0.25)  # round trip 0.5 s of a 0.6 s ttl
            with pytest.raises(asynclock.AcquireTimeout):
                async with asynclock.lease(
                    client, "late", ttl=ttl, prefix=prefix, blocking_timeout=1.5
                ):
                    pytest.fail("a lease with too little validity left was handed out")
            with pytest.raises(asynclock.AcquireTimeout):
                async with asynclock.lease(client, "late", ttl=ttl, prefix=prefix, blocking=False):
                    pytest.fail("a lease with too little validity left was handed out")
            assert await observer.exists(prefix + "{late}") == 0  # undone, nothing left
            proxy.set_mode(ProxyMode.DELAY, delay=0.05)  # round trip 0.1 s: fine
            async with asynclock.lease(client, "late", ttl=ttl, prefix=prefix) as lock:
                assert lock.time_left > ttl / 3
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await client.aclose()
            await observer.aclose()
