"""The connections asynclock keeps beside a user's Redis client.

Design note. Acquire and release travel on the caller's own client (one round trip each,
on the hot path). Renewals must not queue behind the application's traffic, so they go
over a dedicated pool built from the same *connection settings* (never from the pool's
internal objects), with redis-py's retries turned off: the watchdog retries by itself,
against its deadline. Release falls back to that pool when the caller's pool fails (an
exhausted pool raises at once in redis-py 8), and acquires go to a small pool of its own
that queues instead of failing when the caller's pool is exhausted.

One :class:`Companion` exists per user client and event loop. It is in use while any lease
or waiter of that client is alive; when the last one leaves, its connections are closed,
so nothing is left open when the application closes its client.

Sentinel: renewals follow the primary the sentinels name, at every batch. A Sentinel
client's connections ask the sentinels where the primary is only when they connect, and
redis-py reconnects one only when the server it reaches answers ``READONLY``, that is once
the old primary has been turned into a replica. Between the promotion of a replica and
that demotion (up to about ten seconds: a sentinel reconfigures the old primary when it
next reads its ``INFO``, and never if it cannot reach it), the old primary still accepts
writes. Renewals sent there are lost with it, while the copy of the key on the new
primary runs out: a lease held across a failover was lost at its deadline, or, once the
key there had expired, found not ours.

So before each batch of renewals of a Sentinel client (one query per batch, every ttl/3,
not one per lease), ``Companion._follow_primary`` asks the sentinels where the primary is,
and closes every connection that still reaches another server: asynclock's own pools',
the wake-up subscription, the lane's idle ones and the caller's pool's idle ones. Each
reconnects through the sentinels at its next use, to the primary they name. The lane
also learns that address, and closes a connection that was busy meanwhile as it comes
back, so acquires and releases follow as well.
The query gets at most half of the batch's time; if no sentinel answers in time, the
renewal goes where its connection already is, as it did before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from .._base._shield import close_fully, finish
from .._redis._cluster import cluster_of, holding_of, is_sharded, mark_sharded
from .._redis._compat import fit_settings
from .._redis._lane import Lane, reaches_another, reply_text
from .._redis._leftovers import forget_closed_loops, idle_connections, pool_connections
from .._redis._scripts import ABANDON, Arg, has_set_if_equal, pack, pack_args, run_idempotent
from .._redis._valkey import family_of, sentinel_classes, valkey_errors
from ._wakeup import WaitingRoom
from ._watchdog import Watchdog

__all__ = ["Companion", "HoldEntry", "companion_for", "connection_settings"]

log = logging.getLogger("asynclock")

# Entries of ``ConnectionPool.connection_kwargs`` that are pool machinery, not settings.
_NOT_SETTINGS = frozenset(
    {
        "retry",
        "retry_on_error",
        "retry_on_timeout",
        "redis_connect_func",
        "himport_registry",
        "maint_notifications_pool_handler",
        "maint_notifications_config",
        "event_dispatcher",
        "connection_pool",
    }
)


def connection_settings(client: Redis) -> tuple[type[Any], dict[str, Any]]:
    """The connection class and settings for asynclock's own connections to ``client``'s
    server: the pool's plain connection settings, never its internal objects."""
    pool = client.connection_pool
    settings = {
        key: value
        for key, value in pool.connection_kwargs.items()
        if key not in _NOT_SETTINGS and not key.startswith("orig_")
    }

    # RESP2 and no CLIENT SETINFO: a new side connection needs no handshake round trips
    # (beyond AUTH/SELECT if configured), so reconnecting fits in a renewal's budget
    # even on a slow network. Our scripts' replies read the same in RESP2 and RESP3.
    # No health checks: redis-py's PING-before-a-command (``health_check_interval``)
    # would read a reply on the subscription connection while its listener reads, which
    # breaks it, and would add a round trip to a renewal's budget; our connections have
    # time limits and a heartbeat of their own.
    # (fit_settings: only what this redis-py's connection class takes, CLIENT SETINFO off)
    settings.update(protocol=2, health_check_interval=0)
    fitted = fit_settings(pool.connection_class, settings)
    if issubclass(pool.connection_class, sentinel_classes()[1]):
        # A Sentinel client's connections ask its pool (a weak proxy) where the primary
        # is now, at every connect: after a failover ours reconnect to the new one.
        fitted["connection_pool"] = pool.connection_kwargs["connection_pool"]
    return pool.connection_class, fitted


_OVERFLOW_CONNECTIONS = 32
_UNANSWERED: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
_ORPHAN_LIMIT = 1.0  # seconds allowed to give back a key granted to a waiter that left
_ORPHAN_TOMBSTONE_MS = 10_000


HoldEntry = tuple[str, "asyncio.Task[Any] | None"]
"""A task inside a block or guard of a lock: (the lock's lease key, the task)."""


class Companion:
    """Per-client, per-loop state: everything asynclock keeps beside a caller's client.

    Its duties: the renewal pool (``renewer``) and the overflow pool for a full caller's
    pool (``overflow``), both following a Sentinel's primary; the watchdog; the waiting
    room (its lines, its subscription and grants; ``_undo_grant`` gives back a grant to a
    waiter that left); the lane (the hot path's exchange on the caller's pool); packing
    commands in the client's encoding (``pack``, ``pack_args``); the register of the
    blocks and guards open per task (``holding``, ``left``, ``check_not_holding``:
    leases are not re-entrant); the undo of an abandoned attempt (``abandon_call``); the
    one-time server check (``check_server_once``); and its own lifetime (``retain``,
    ``unretain``, ``aclose_if_idle``, ``forget``)."""

    def __init__(self, client: Redis, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.loop = loop
        self.connection_class, self.settings = connection_settings(client)
        self.family = family_of(client)
        """redis-py's or valkey-py's classes, for asynclock's own pools (``_valkey``)."""
        self.sharded = is_sharded(client)
        """A client of a cluster node: sharded pub/sub (see ``_redis._cluster``)."""
        self.room = WaitingRoom(self.connection_class, self.settings, sharded=self.sharded)
        self.room.on_orphan = self._undo_grant
        self.lane = Lane(client, loop)
        """The hot path for acquires and releases, on connections of the caller's pool."""
        self._renewer: Redis | None = None
        self._overflow: Redis | None = None
        pool = client.connection_pool  # (a Sentinel pool of a primary: master_for)
        sentinel = isinstance(pool, sentinel_classes()[0]) and pool.is_master
        self.watchdog = Watchdog(loop, self.renewer, self._follow_primary if sentinel else None)
        self._users = 0
        self._server_check: asyncio.Task[object] | None = None  # (in the room's background)
        self.renews_by_command = False
        """The server renews a plain lease by ``SET ... IFEQ`` (learnt by
        ``check_server_once``; off again for good once it refuses one)."""
        # (lease key, task) -> how many blocks and guards of that lock the task is in: a
        # task that enters a lock it holds would wait for itself forever (see holding).
        # (One register for all the nodes of a cluster: a lock's slot moves between them.)
        cluster = cluster_of(client)
        self._holding: dict[HoldEntry, int] = {} if cluster is None else holding_of(cluster)
        # anyio's CancelScope() looks up the running event loop's backend every time; the
        # class it returns for this loop makes scopes directly.
        self.cancel_scope: type[anyio.CancelScope] = type(anyio.CancelScope())

    def retain(self) -> None:
        """Count one more lease or waiter using this companion."""
        self._users += 1

    def unretain(self) -> bool:
        """Count one less; True when nothing uses it any more and it should be closed."""
        self._users -= 1
        if self._users:
            return False
        self.watchdog.idle()
        clients = self._renewer is not None or self._overflow is not None
        return clients or self.room.open or self.watchdog.running  # (open: the server check)

    def check_not_holding(self, key: str, name: str) -> None:
        """Raise ``RuntimeError`` if the current task is inside a block or a guard of the
        lock whose lease key is ``key``: taking it again would wait for itself forever
        (leases are not re-entrant). Other tasks of the process wait their turn."""
        if self._holding and (key, asyncio.current_task()) in self._holding:
            raise RuntimeError(
                f"the lock {name!r} is already held by this task (an `async with` block or "
                "a guard() of it is open here): leases are not re-entrant, and waiting for "
                "it here would wait for this task itself forever"
            )

    def holding(self, key: str) -> HoldEntry:
        """Note that the current task entered a block or a guard of the lock of ``key``;
        returns the entry to give to :meth:`left`."""
        entry = (key, asyncio.current_task())
        self._holding[entry] = self._holding.get(entry, 0) + 1
        return entry

    def left(self, entry: HoldEntry | None) -> None:
        """The block or guard noted by :meth:`holding` has exited (None: nothing noted)."""
        if entry is None:
            return
        count = self._holding.pop(entry, 0) - 1
        if count > 0:
            self._holding[entry] = count

    def pack(self, *args: str | int) -> bytes:
        """One command in RESP, encoded as this client's connections would encode it."""
        return pack(args, *self.lane.encoding)

    def pack_args(self, *args: str | int) -> bytes:
        """Arguments of a command in RESP, encoded as this client's connections would
        encode them (without the header that counts them)."""
        return pack_args(args, *self.lane.encoding)

    def renewer(self) -> Redis:
        """The dedicated client for renewals (created on first use, retries off)."""
        if self._renewer is None:
            # No socket timeout: every renewal has a time limit of its own.
            self._renewer = self._own_client(self.family.pool, socket_timeout=None)
        return self._renewer

    async def _follow_primary(self, deadline: float) -> None:
        """A Sentinel client's renewals follow the primary (see the design note): ask the
        sentinels where it is (until loop time ``deadline``) and close every connection
        that reaches another server (the waiting room's subscription reconnects and
        subscribes again by itself; the lane, told, closes a busy one as it comes back).
        Never raises but a cancellation: a sentinel that does not answer leaves every
        connection as it is, and a connection that fails to close is left to fail at its
        next use."""
        pool = self.client.connection_pool
        try:
            async with asyncio.timeout_at(deadline):
                address: tuple[str, int] = await pool.get_master_address()  # type: ignore[attr-defined]
        except _UNANSWERED + valkey_errors() as exc:
            log.debug("no sentinel said where the primary is: %r", exc)
            return
        home = self.lane.home = (address[0], int(address[1]))
        # (a subscription that is None, or not connected, is passed over: reaches_another)
        connections = [self.room.connection, *self.lane.idle_connections(), *idle_connections(pool)]
        for client in (self._renewer, self._overflow):
            if client is not None:
                connections += pool_connections(client.connection_pool)
        for connection in connections:
            if reaches_another(connection, home):
                try:
                    await connection.disconnect(nowait=True)
                except Exception as exc:  # (it fails again at its next use, and reconnects)
                    log.debug("closing a connection to the old primary: %r", exc)

    def overflow(self) -> Redis:
        """A small pool that waits for a free connection (created on first use, retries off).

        Acquires and releases go here when the caller's pool is exhausted (redis-py 8
        raises at once instead of waiting), and releases retry here after a connection
        error, so a burst of thousands of leases queues instead of failing.
        """
        if self._overflow is None:
            self._overflow = self._own_client(
                self.family.blocking_pool, max_connections=_OVERFLOW_CONNECTIONS, timeout=None
            )
        return self._overflow

    def _own_client(self, pool_class: type[Any], **extra: Any) -> Redis:
        """A client of asynclock's own (``renewer``, ``overflow``): a new ``pool_class``
        pool of this client's connection settings, updated with ``extra``, and redis-py's
        retries off; marked sharded as its client is (see ``_redis._cluster``)."""
        settings = {**self.settings, **extra, "retry": self.family.no_retry()}
        pool = pool_class(connection_class=self.connection_class, **settings)
        client: Redis = self.family.client.from_pool(pool)
        if self.sharded:
            mark_sharded(client)
        return client

    def abandon_call(self, key: str, token: str, tombstone_ms: int) -> tuple[list[str], list[Arg]]:
        """ABANDON's keys and arguments for ``token`` on the lock whose lease key is ``key``
        (see the script): delete the key if it holds that token, withdraw the token's
        offer, and tombstone it for ``tombstone_ms``."""
        keys = [key, f"{key}:void:{token}", key + ":waiting"]
        return keys, [token, tombstone_ms, key + ":released", self.room.origin]

    async def _undo_grant(self, channel: str, token: str) -> None:
        """Give back a key that another client's releaser granted to ``token``, a waiter
        of ours that is gone (see ``WaitingRoom._granted``): delete it if it still holds
        that token, and tombstone the token. Best effort: the key expires by its TTL."""
        key = channel.removesuffix(":released")
        keys, args = self.abandon_call(key, token, _ORPHAN_TOMBSTONE_MS)
        try:  # (a task of the room's: closing the room waits for it, bounded; shielded)
            until = self.loop.time() + _ORPHAN_LIMIT  # (tried again while Redis is silent)
            work = run_idempotent(ABANDON, self.lane, self.overflow, keys, args, until=until)
            await finish(work, _ORPHAN_LIMIT)
        except Exception as exc:
            log.warning(
                "could not give back %s, granted to a waiter that left (%r); it expires by its TTL",
                key,
                exc,
            )
        finally:
            self.room.wake(channel)  # (its notification is our own: we ignore those)

    def check_server_once(self) -> None:
        """Once per client, in the background: learn whether the server renews by
        command (``renews_by_command``), and warn if it may evict lock keys.

        Under any ``maxmemory-policy`` but ``noeviction`` (with ``maxmemory`` set), Redis
        may delete a held lease's key to free memory, and another client can then take
        the lock. Each check is skipped quietly where its command is not allowed or
        fails (leases then renew by script); one cut short (the server did not answer,
        or the last lease ended first and its side work was cancelled) is made again by
        the next lease.
        """
        if self._server_check is None:  # (work of the room's: its aclose cancels it first)
            self._server_check = self.room.in_background(self._check_server())

    async def _check_server(self) -> None:
        done = False
        try:
            learnt = await has_set_if_equal(self.client)
            if learnt is not None:
                self.renews_by_command = learnt
                await _warn_if_evicting(self.client)
                done = True
        finally:
            if not done:  # (no answer, or cut short: the next lease makes it again)
                self._server_check = None

    def forget(self) -> None:
        """This companion's loop has closed: disconnect its own connections without that
        loop (see ``_leftovers``); what it did not close stays unused."""
        for client in (self._renewer, self._overflow):
            if client is not None:
                forget_closed_loops(client.connection_pool)
        self._renewer = self._overflow = None
        self.room.forget()

    async def aclose_if_idle(self) -> None:
        """Close the dedicated connections unless a lease or waiter came back meanwhile.

        Runs in the task that ended the last lease, while other tasks may take new ones:
        whether one did is asked again after every await, and what is closed by then
        reopens on use (a new renewal client, lane connection or subscription).
        """
        if self._users:
            return
        # The room first: work in its background (giving back a key granted to a waiter
        # that left, and the server check) runs on the lane, the overflow pool or the
        # client, and must end before they close.
        await self.room.aclose()  # (it stays open while anyone waits)
        if self._users:
            return  # a lease came meanwhile: its schedule must stay
        await self.watchdog.aclose()
        await self.lane.aclose()
        clients = [c for c in (self._renewer, self._overflow) if c is not None]
        self._renewer = self._overflow = None  # (before awaiting: a newcomer makes its own)
        if clients:  # (to the end: nothing refers to them any more)
            await close_fully(_aclose_each(clients))


async def _aclose_each(clients: list[Redis]) -> None:
    """Close each of ``clients``, also after an earlier one failed (the first error is
    raised once all were tried)."""
    errors: list[Exception] = []
    for client in clients:
        try:
            await client.aclose()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


async def _warn_if_evicting(client: Redis) -> None:
    try:
        async with asyncio.timeout(2.0):
            config = await client.config_get("maxmemory*")
    except Exception as exc:  # (a background task's: nothing may go unretrieved)
        log.debug("could not read the eviction policy: %r", exc)
        return
    settings = {reply_text(k): reply_text(v) for k, v in config.items()}
    policy = settings.get("maxmemory-policy", "noeviction")
    if policy != "noeviction" and settings.get("maxmemory", "0") not in ("0", ""):
        log.warning(
            "this Redis runs with maxmemory-policy %s, so it may evict lock keys "
            "under memory pressure and let two holders overlap; use noeviction for locks",
            policy,
        )


_ATTRIBUTE = "_asynclock_companion"
_OTHERS = "_asynclock_companions"  # loop -> the client's companion there, every open loop


def companion_for(client: Redis) -> Companion:
    """The companion of ``client`` in the running loop (made on first use).

    It is kept on the client itself: a client and its companion refer to each other, and
    go together once the application drops the client. (A weak map keyed by the client
    kept both forever, since the companion refers to its client; it was slower too.)
    """
    loop = asyncio.get_running_loop()
    companion: Companion | None = getattr(client, _ATTRIBUTE, None)
    # (a copy of a client, copy.copy, carries its original's companion: not its own)
    if companion is None or companion.loop is not loop or companion.client is not client:
        companion = _companion_on(client, loop)
        setattr(client, _ATTRIBUTE, companion)
    return companion


def _companion_on(client: Redis, loop: asyncio.AbstractEventLoop) -> Companion:
    """The companion of ``client`` on ``loop``, the client having been used on another
    loop last (or never): per-loop state is made per loop, and what closed loops left
    is dropped (see ``_leftovers``) so that none of it reaches this one."""
    known: dict[asyncio.AbstractEventLoop, Companion] = getattr(client, _OTHERS, None) or {}
    companions: dict[asyncio.AbstractEventLoop, Companion] = {}
    for other_loop, other in known.items():
        if other.client is not client:
            continue  # (the original's, seen through a copy.copy of it)
        if other_loop.is_closed():
            other.forget()
        else:
            companions[other_loop] = other
    companion = companions.get(loop)
    if companion is None:
        forget_closed_loops(client.connection_pool)
        companion = companions[loop] = Companion(client, loop)
    setattr(client, _OTHERS, companions)  # (a new dict: a copy's must not be its original's)
    return companion
