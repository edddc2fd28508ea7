"""valkey-py clients (issue 30): ``valkey.asyncio.Valkey`` wherever a redis-py client goes.

The contract through valkey-py clients on every engine: each kind of lock, a loss, a
waiter woken by a release, once(), every(), inspect(), exclusive(), the testing kit; and
valkey-py's own exceptions, which asynclock handles as redis-py's and the application
still catches as valkey-py's (see ``asynclock._redis._valkey``). ``ValkeyCluster`` and
a valkey-py Sentinel's ``master_for()`` clients run tests/test_cluster.py and
tests/test_sentinel.py; every deployment runs tests/test_compat_table.py's cells.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.exceptions

import asynclock
from asynclock import LockBusy, LockLost, LossReason
from asynclock.testing import History, ServerInfo, check_fencing, check_no_overlap, keys_left

pytest.importorskip("valkey")
import valkey.asyncio
import valkey.exceptions

Valkey = valkey.asyncio.Valkey


@pytest.fixture
async def make_valkey(redis_server: ServerInfo) -> AsyncIterator[Callable[..., Valkey]]:
    clients: list[Valkey] = []

    def factory(**kwargs: object) -> Valkey:
        client = Valkey.from_url(redis_server.url, **kwargs)
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.aclose()


@pytest.fixture(params=[False, True], ids=["bytes", "str"])
def vclient(request: pytest.FixtureRequest, make_valkey: Callable[..., Valkey]) -> Valkey:
    return make_valkey(decode_responses=request.param)


async def test_exclusion_renewal_and_a_woken_waiter(
    vclient: Valkey, make_valkey: Callable[..., Valkey], prefix: str
) -> None:
    """Two valkey-py clients: one holds past several renewals, the other waits and is
    woken by the release (not by the TTL: 30 s)."""
    other = make_valkey()
    async with asynclock.lease(vclient, "x", ttl=0.3, prefix=prefix) as held:
        first = held.fencing_token
        with pytest.raises(LockBusy):
            async with asynclock.lease(other, "x", blocking=False, prefix=prefix):
                pass
        waiter = asyncio.create_task(_take(other, "x", prefix))
        await asyncio.sleep(0.5)  # (renewed meanwhile: ttl 0.3)
        assert await held.is_held(verify=True)
        assert not waiter.done()
    assert await asyncio.wait_for(waiter, 5) > first


async def _take(client: Valkey, name: str, prefix: str) -> int:
    async with asynclock.lease(client, name, ttl=30, prefix=prefix) as held:
        return held.fencing_token


async def test_every_kind(vclient: Valkey, prefix: str) -> None:
    """A semaphore, shared leases, a fair lock and acquire(), seen by inspect()."""
    permits = [await asynclock.acquire(vclient, "sem", limit=2, prefix=prefix) for _ in "ab"]
    with pytest.raises(LockBusy):
        await asynclock.acquire(vclient, "sem", limit=2, blocking=False, prefix=prefix)
    for permit in permits:
        await permit.release()
    readers = [await asynclock.acquire(vclient, "rw", shared=True, prefix=prefix) for _ in "ab"]
    assert (await asynclock.inspect(vclient, "rw", prefix=prefix)).shared_holders == 2
    with pytest.raises(LockBusy):
        await asynclock.acquire(vclient, "rw", blocking=False, prefix=prefix)
    for reader in readers:
        await reader.release()
    async with asynclock.lease(vclient, "fair", fair=True, prefix=prefix) as held:
        assert held.fencing_token > 0
    lease = await asynclock.acquire(vclient, "acq", ttl=5, prefix=prefix)
    info = await asynclock.inspect(vclient, "acq", prefix=prefix)
    assert info.held
    assert info.fencing_token == lease.fencing_token
    await lease.release()


async def test_a_loss_cancels_the_body(vclient: Valkey, prefix: str) -> None:
    started = asyncio.Event()
    with pytest.raises(LockLost) as caught:
        async with asynclock.lease(vclient, "lost", ttl=0.3, prefix=prefix):
            started.set()
            await vclient.delete(f"{prefix}{{lost}}")
            await asyncio.Event().wait()  # (cancelled by the loss)
    assert started.is_set()
    assert caught.value.reason is LossReason.NOT_OWNER


async def test_apps(vclient: Valkey, prefix: str) -> None:
    """once(), idempotent() with a template, exclusive(), every()."""
    runs: list[int] = []

    async def job(n: int) -> int:
        runs.append(n)
        return n * 2

    assert await asynclock.once(vclient, "job:{n}", job, 2, prefix=prefix) == 4
    assert await asynclock.once(vclient, "job:{n}", job, 2, prefix=prefix) == 4
    assert runs == [2]
    assert await asynclock.forget(vclient, "job:2", prefix=prefix)

    @asynclock.exclusive(lambda: vclient, "ex:{n}", busy="skip", prefix=prefix)
    async def ex(n: int) -> int:
        return n

    assert await ex(5) == 5

    ticks = 0
    ticked = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        ticks += 1
        ticked.set()

    schedule = asyncio.create_task(asynclock.every(vclient, "tick", 0.2, tick, prefix=prefix))
    await asyncio.wait_for(ticked.wait(), 5)
    schedule.cancel()
    with pytest.raises(asyncio.CancelledError):
        await schedule
    assert ticks >= 1


async def test_scripts_flushed_are_loaded_again(vclient: Valkey, prefix: str) -> None:
    """NOSCRIPT, a valkey-py error reply, is handled as redis-py's."""
    await vclient.script_flush()
    async with asynclock.lease(vclient, "flushed", prefix=prefix) as held:
        assert held.fencing_token > 0


async def test_valkey_errors_are_both(prefix: str) -> None:
    """A server that cannot be reached: the error is valkey-py's ConnectionError for the
    application and redis-py's for asynclock's handling; refused before any I/O: bad
    clients."""
    client = Valkey(host="127.0.0.1", port=1)
    with pytest.raises(valkey.exceptions.ConnectionError) as caught:
        async with asynclock.lease(client, "x", prefix=prefix):
            pass
    assert isinstance(caught.value, redis.exceptions.ConnectionError)
    assert type(caught.value).__module__ == "valkey.exceptions"
    await client.aclose()


def test_every_client_is_accepted_and_anything_else_refused_by_name() -> None:
    """Valkey, ValkeyCluster (made without I/O) and a valkey-py Sentinel's master_for()
    are accepted; anything else is refused before any I/O, naming the argument and
    both libraries' clients."""
    cluster = valkey.asyncio.ValkeyCluster(host="127.0.0.1", port=1)
    sentinel = valkey.asyncio.Sentinel([("127.0.0.1", 1)])
    for client in (Valkey(host="127.0.0.1", port=1), cluster, sentinel.master_for("x")):
        assert isinstance(asynclock.lease(client, "x"), asynclock.LeaseContext)
    with pytest.raises(
        TypeError, match=r"redis must be .* valkey\.asyncio\.Valkey or ValkeyCluster"
    ):
        asynclock.lease(sentinel, "x")  # type: ignore[arg-type]  # (the manager itself)


async def test_the_testing_kit(
    vclient: Valkey, make_valkey: Callable[..., Valkey], prefix: str
) -> None:
    """History guards of two valkey-py clients' leases: no overlap, fencing in order;
    keys_left() on a valkey-py client sees a held key and nothing once released."""
    history = History()
    other = make_valkey()

    async def worker(client: Valkey, holder: str) -> None:
        for _ in range(3):
            async with asynclock.lease(client, "kit", ttl=5, prefix=prefix) as held:
                with history.guard_lease(held, holder):
                    assert await keys_left(client, prefix) == [held.key]
                    await asyncio.sleep(0.01)

    await asyncio.gather(worker(vclient, "a"), worker(other, "b"))
    assert len(history.intervals) == 6
    assert check_no_overlap(history.intervals) == []
    assert check_fencing(history.intervals) == []
    assert await keys_left(vclient, prefix) == []


def test_the_both_error_keeps_what_valkey_gave() -> None:
    from asynclock._redis._valkey import as_redis_error

    original = valkey.exceptions.NoScriptError("No matching script")
    original.extra = 1  # type: ignore[attr-defined]
    both = as_redis_error(original)
    assert isinstance(both, redis.exceptions.NoScriptError)
    assert isinstance(both, valkey.exceptions.NoScriptError)
    assert isinstance(both, redis.exceptions.ResponseError)
    assert both.args == original.args
    assert both.extra == 1  # type: ignore[attr-defined]
    assert as_redis_error(both) is both
    assert repr(both)  # (redis-py 8 reads attributes its __init__ sets)
    plain = ValueError("x")
    assert as_redis_error(plain) is plain
    error = valkey.exceptions.ValkeyError("y")
    assert type(as_redis_error(error)).__mro__[1] is redis.exceptions.RedisError
    cluster_error = as_redis_error(valkey.exceptions.SlotNotCoveredError("z"))
    assert isinstance(cluster_error, redis.exceptions.SlotNotCoveredError)
    assert isinstance(cluster_error, redis.exceptions.RedisClusterException)
    assert isinstance(cluster_error, valkey.exceptions.ValkeyClusterException)
