"""The ways in: ``async with lease(...)`` (a guarded block) and ``await acquire(...)`` (a
lease held until ``release()``), and the taking of a lock on the right server that every
way in shares (``begin``, ``take``).

Design note. Every way in (``lease()``, ``acquire()``, ``once()``; Redlock's servers
through ``take``) takes the lock the same way: ``take`` runs the acquisition engine of
``_kinds`` with the options' kind, on the server that holds the lock (for a Redis
Cluster, the primary that owns its slot, see ``_redis._cluster``, the slot map reloaded
and the attempt made again after a ``MOVED`` or a migration), and with ``min_replicas``
has the lease confirmed by replicas (``_replicas``). It returns the lease's ``Tenure``
not yet watched: ``begin`` starts it (its watchdog scheduled) with no await in between,
so a cancellation cannot fall between the grant and the lease that owns it, and reports
``acquired``. The caller gets the ``Lease``, the handle over it.

The keyword arguments of ``lease()`` and ``acquire()`` are defined once
(``LeaseKeywords`` for the type checker, ``_options.KEYWORDS`` with their defaults and
checks at run time) and passed on as they were given. A block enters a cancel scope
around its body; its exit releases the lease inside that scope made a shield (cheaper
than a scope of its own) unless the scope cancelled the body, in which case it is left
first (it would cancel the release too). Redlock (``_redlock``) is handed ``take``, so
that it stays below this module.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import TypedDict, Unpack, cast, overload

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from .._base._events import EventHook
from .._base._exceptions import AcquireTimeout, LockBusy
from .._base._options import KEYWORDS, Client, LeaseOptions, is_cluster, redis_api
from .._base._shield import ExcType, Traceback
from .._kinds._engine import Kind
from .._kinds._engine import acquire as acquire_by
from .._kinds._fair import Fair
from .._kinds._mutex import Job, JobConflict, JobDone, Mutex
from .._kinds._permits import Permits
from .._kinds._shared import Shared
from .._redis._cluster import node_client, reload_slots
from .._redis._lane import not_sent
from .._session._connections import Companion, HoldEntry, companion_for
from ._lease import Lease, LeaseState, Tenure, report_failed
from ._redlock import RedlockContext, RedlockLease, acquire_redlock
from ._release import Wake, after_release, let_go, unretain
from ._release import release as release_lease
from ._replicas import confirm_replicas

__all__ = ["HoldKeywords", "LeaseContext", "LeaseKeywords", "acquire", "begin", "lease", "take"]

log = logging.getLogger("asynclock")


class LeaseContext:
    """The async context manager returned by :func:`lease`; single use."""

    __slots__ = ("_entry", "_hook", "_options", "_redis", "_tenure")

    def __init__(self, redis: Client, options: LeaseOptions, hook: EventHook | None) -> None:
        self._redis: Client | None = redis  # None once entered
        self._options = options
        self._hook = hook
        self._tenure: Tenure | None = None
        self._entry: HoldEntry | None = None  # see Companion.holding

    async def __aenter__(self) -> Lease:
        redis = self._redis
        if redis is None:
            raise RuntimeError("a lease() context manager can be entered only once")
        self._redis = None
        held = await begin(redis, self._options, self._hook, block=True)
        self._tenure = held
        self._entry = held.companion.holding(held.options.base_key)  # (any kind's)
        return Lease(held)

    async def __aexit__(self, exc_type: ExcType, exc: BaseException | None, tb: Traceback) -> None:
        held = self._tenure
        if held is None:
            raise RuntimeError("__aexit__ called without a successful __aenter__")
        scope = held.exit_block()  # (from here on a loss can no longer cancel the block)
        # A block that ran past its safe deadline, with no await for the deadline's timer
        # to land in (a blocking call, a CPU-bound stretch), did not finish in time.
        held.overran("the exit")
        # Usually the release runs inside the block's own scope, made a shield (it is the
        # innermost scope now): cheaper than a scope of its own. A scope that cancelled
        # the block (the lease was lost) is left first, since it would cancel the release.
        inside = not scope.cancel_called
        body_error = exc
        if inside:
            scope.shield = True
        elif scope.__exit__(exc_type, exc, tb):
            body_error = None  # (swallowed by the scope)
        wake = Wake.OURS
        try:
            try:
                wake = await release_lease(held, shielded=inside)
            finally:
                if inside:
                    scope.__exit__(exc_type, exc, tb)  # never cancelled: swallows nothing
        finally:
            held.companion.left(self._entry)
            await after_release(held, wake)
        if held.state is LeaseState.LOST:  # (our scope only cancels the body then)
            held.raise_loss(body_error, "this block")


@overload
def lease(
    redis: Client,
    name: str,
    **options: Unpack[LeaseKeywords],
) -> LeaseContext: ...
@overload
def lease(
    redis: Sequence[Client],
    name: str,
    **options: Unpack[LeaseKeywords],
) -> RedlockContext: ...


def lease(
    redis: Client | Sequence[Client],
    name: str,
    **options: Unpack[LeaseKeywords],
) -> LeaseContext | RedlockContext:
    """Hold the lock ``name`` for the duration of an ``async with`` block.

    Args:
        redis: a ``redis.asyncio.Redis`` client (``decode_responses`` either way; a
            Sentinel's ``master_for()`` too) or a ``redis.asyncio.cluster.RedisCluster``
            (the lease runs on the primary that owns the lock's slot); valkey-py's
            ``Valkey`` and ``ValkeyCluster`` clients alike.
        name: the lock's name; non-empty.
        ttl: seconds the key lives in Redis unless renewed; the watchdog renews it every
            ``ttl / 3``. At least 0.03, at most ``9e11`` (every time argument takes a
            ``datetime.timedelta`` too). A whole number of thousands of seconds is warned
            about (``UserWarning``): likely milliseconds given as seconds.
        blocking: wait for the lock (True) or make one attempt (False).
        blocking_timeout: with ``blocking=True``, the most seconds to wait; None waits
            until acquired (the caller's own ``asyncio.timeout`` works too); 0 makes one
            attempt, as ``blocking=False`` does, but raises ``AcquireTimeout``.
        release_timeout: seconds allowed for the release on exit; past it the key is left
            to expire by its TTL.
        prefix: prepended to every key and channel of the lock.
        on_event: called with a :class:`LeaseEvent` at each step of the lease's life.
        fence_ttl: seconds the lock's fencing counter outlives its last acquisition (one
            small key per lock name); None: ``max(10 * ttl, 60)``. At least ``ttl``. The
            server's clock floors fencing tokens anyway; the counter keeps them increasing
            should that clock step back while it lives.
        hold_at_least: seconds from the acquisition during which the lock stays taken
            even once given back: a release before then keeps the key (owner-checked)
            until then instead of deleting it, so that a server whose scheduler fires
            late, by less than that, finds this run of the job taken (see the README's
            "once per tick"). Waiters are woken, and wait until the key expires.
        max_hold: the most seconds the lease may be held, counted from the acquisition
            (when the acquire command was sent): then the holder is cancelled and
            ``LockLost`` (``reason`` ``max_hold``) raised, even while renewals succeed,
            and the lease given back; None holds it as long as the holder lives. Not
            shorter than ``hold_at_least``. (A lease of :func:`acquire`: its guards are
            cancelled and its renewals stop; ``release()`` gives it back, raising
            ``LockLost``, else its key expires within ``ttl``.)
        limit: how many leases may hold the lock at once: 1 (a mutex), or up to 1000
            for a semaphore, each holder with a permit of its own that is renewed, lost
            and released as a lease is (a dead holder's permit expires by its TTL), and
            a fencing token from the lock's one counter. Waiters are woken by the
            release of any permit; permits are not handed over, so every client's
            waiters compete. One name, one limit: a permit asked for with another limit
            than the permits held raises ``LimitConflict``, as does a plain, fair or
            shared lease asked of a name whose permits are held.
        fair: waiters take the lock in the order they started waiting, across
            processes (a queue in Redis); a waiter that dies holds the queue up for at
            most about 3 s, one that gives up not at all. Only for a plain lock (not
            with ``limit``); a plain ``lease()`` of the same name does not queue.
        shared: a shared (read) lease: any number of them hold the lock at once, none
            beside an exclusive (plain) lease of the name; while an exclusive lease
            waits, new shared ones wait behind it, so writers are not starved. Each is
            renewed, lost and released as any lease. Not with ``limit``, ``fair`` or
            ``hold_at_least``.
        min_replicas: replicas of the primary that must confirm the lease (0 to 64):
            the acquisition counts only once ``WAIT`` reports that many replicas have
            it, within a tenth of the TTL (at most 5 s); otherwise the lease is given
            back and ``ReplicationTimeout`` raised. Each renewal is confirmed the same
            way, and one that is not counts as failed (SUSPECT, then lost at the safe
            deadline). Guards against a failover to a replica that never received the
            lease granting it again; costs a round trip to the replicas per
            acquisition and renewal.
        wait_aof: with ``min_replicas``, count only the replicas that have written the
            lease to their append-only file (``WAITAOF`` after the ``WAIT``, each for a
            tenth of the TTL; Redis and Valkey 7.2 and later, replicas with
            ``appendonly yes``), so that a replica restarted before a failover still has
            it. Replicas with ``appendfsync always`` confirm within a millisecond or so,
            with ``everysec`` within one to two seconds: give those leases a TTL of 30 s
            or more. A server without ``WAITAOF`` raises
            ``redis.exceptions.ResponseError`` at the acquisition (the lease given back).

    Raises (when the block is entered):
        LockBusy: ``blocking=False`` and another lease holds the lock (every permit).
        LimitConflict: ``limit`` differs from the limit the lock's permits are held
            with (a plain, fair or shared lease has limit 1), or a permit was asked of
            a name held as a plain lock.
        ReplicationTimeout: fewer than ``min_replicas`` replicas confirmed the
            acquisition in time; the lock was given back (also a ``TimeoutError``).
        AcquireTimeout: ``blocking_timeout`` passed first (also a ``TimeoutError``),
            round trips to Redis included; its message says whether the lock was held
            (and for how long its holder's lease runs) or Redis did not answer. The last
            attempt still gets 0.25 s for its round trip and undoing it 0.5 s more, so a
            silent Redis gives it within ``blocking_timeout`` plus at most 0.75 s.
        RuntimeError: this task already holds the lock (it is inside an ``async with``
            block or a ``guard()`` of it, through this client): leases are not
            re-entrant, and waiting would wait for itself forever.
        redis.exceptions.RedisError: Redis refused or could not be reached (as the
            client's own commands raise it: ``ConnectionError``,
            ``AuthenticationError``, ...).

    Raises (when the block exits):
        LockLost: the lease was lost while the block ran (the block was cancelled). An
            exception raised by the block itself propagates instead, with a note.

    ``TypeError``/``ValueError`` for bad arguments are raised here, before any I/O.
    """
    if isinstance(redis, list | tuple):  # (Redlock, experimental: see _redlock)
        return RedlockContext(_redlock(redis, name, options))
    client = cast(Client, redis)  # (a client, or _options raises TypeError)
    return LeaseContext(client, _options(client, name, options), options.get("on_event"))


@overload
async def acquire(
    redis: Client,
    name: str,
    **options: Unpack[LeaseKeywords],
) -> Lease: ...
@overload
async def acquire(
    redis: Sequence[Client],
    name: str,
    **options: Unpack[LeaseKeywords],
) -> RedlockLease: ...


async def acquire(
    redis: Client | Sequence[Client],
    name: str,
    **options: Unpack[LeaseKeywords],
) -> Lease | RedlockLease:
    """Take the lock ``name`` and hold it, renewed by the watchdog, until
    ``await lease.release()``: no task of the caller's holds it.

    For leases whose holding outlives any one stretch of work (a partition owned by this
    process, leadership). A loss cannot cancel work that nothing guards: run the work
    that must stop with the lease inside ``async with lease.guard():``, or check
    ``await lease.is_held()`` before each step, and pass ``lease.fencing_token`` to what
    the work writes. Always call ``release()``: until then the lease is renewed, even
    once nothing refers to it.

    The arguments, their units and the errors raised while acquiring are those of
    :func:`lease`; ``TypeError``/``ValueError`` for bad arguments are raised before any
    I/O. A cancellation while acquiring leaves no key behind.
    """
    if isinstance(redis, list | tuple):  # (Redlock, experimental: see _redlock)
        return await _redlock(redis, name, options)()
    client = cast(Client, redis)  # (a client, or _options raises TypeError)
    return Lease(await begin(client, _options(client, name, options), options.get("on_event")))


class HoldKeywords(TypedDict, total=False):
    """The keyword arguments of :func:`lease` and :func:`acquire` but ``blocking`` (the
    decorators say it their own way): their one definition for the type checker. Their
    meaning, units (seconds, or ``timedelta``) and defaults are ``lease()``'s."""

    ttl: float | timedelta
    blocking_timeout: float | timedelta | None
    release_timeout: float | timedelta
    prefix: str
    on_event: EventHook | None
    fence_ttl: float | timedelta | None
    hold_at_least: float | timedelta | None
    max_hold: float | timedelta | None
    limit: int
    fair: bool
    shared: bool
    min_replicas: int
    wait_aof: bool


class LeaseKeywords(HoldKeywords, total=False):
    """The keyword arguments of :func:`lease` and :func:`acquire`."""

    blocking: bool


def _options(redis: Client, name: str, given: Mapping[str, object]) -> LeaseOptions:
    """The validated options of ``lease()`` and ``acquire()`` (``on_event`` is checked
    here: it is the caller's, not the lease's), or ``TypeError``/``ValueError`` naming
    the bad argument, before any I/O."""
    if "on_event" not in given:
        return LeaseOptions.cached(redis, name, given)
    settings = dict(given)
    on_event = settings.pop("on_event")
    if on_event is not None and not callable(on_event):
        raise TypeError(f"on_event must be callable, not {type(on_event).__name__}")
    return LeaseOptions.cached(redis, name, settings)


_NOT_REDLOCK = ("hold_at_least", "max_hold", "limit", "fair", "shared", "min_replicas", "wait_aof")
"""Options a Redlock does not take (given with their defaults, they are not given)."""


def _redlock(
    servers: Sequence[Client], name: str, given: LeaseKeywords
) -> Callable[[], Awaitable[RedlockLease]]:
    """The acquisition of a Redlock (``acquire_redlock``, its arguments given: its options
    are the same for each of its servers), or ``TypeError`` / ``ValueError`` before any
    I/O: at least 3 distinct clients of single servers, and only the options of a plain
    lock."""
    if len(servers) < 3:
        raise ValueError(
            f"redis: a Redlock needs at least 3 independent servers, got {len(servers)}"
        )
    if len({id(server) for server in servers}) != len(servers):
        raise ValueError("redis: a Redlock's servers must be distinct clients")
    for server in servers:
        if is_cluster(server):
            raise TypeError("redis: a Redlock's servers must be single servers, not clusters")
    for option in _NOT_REDLOCK:
        if given.get(option, KEYWORDS[option]) != KEYWORDS[option]:
            raise ValueError(f"{option} cannot be given with a list of servers (Redlock)")
    options = [_options(server, name, given) for server in servers]  # (each one checked)
    return partial(acquire_redlock, servers, options[0], given.get("on_event"), take)


# -- taking the lock (every way in) -------------------------------------------------------


async def take(
    redis: Client, options: LeaseOptions, hook: EventHook | None, job: Job | None = None
) -> Tenure:
    """Acquire the lock of ``options`` (by the engine, ``_kinds._engine``; ``job``: for
    ``once()``): the held lease, not yet watched (the caller starts it without awaiting
    first), and, with ``min_replicas``, confirmed by that many replicas (``_replicas``)."""
    redis = redis_api(redis)
    if is_cluster(redis):
        held = await _take_on_cluster(redis, options, hook, job)
    else:
        held = await _take(redis, options, hook, job)
    if options.min_replicas:
        await confirm_replicas(held)
    return held


async def begin(
    redis: Client,
    options: LeaseOptions,
    hook: EventHook | None,
    job: Job | None = None,
    *,
    block: bool = False,
) -> Tenure:
    """The start of a lease, the same for every way in (``lease()``, ``acquire()``,
    ``once()``): ``take`` it, start it (its watchdog; ``block``: an ``async with`` block's,
    whose cancel scope, entered here in the caller's task, a loss cancels) and report
    ``acquired`` with the seconds it took; a busy lock or a timeout is reported as
    ``acquire_failed`` (``busy`` or ``timeout``). Redlock starts its servers' leases
    itself (``_redlock``): it reports one acquisition for all of them."""
    loop = asyncio.get_running_loop()
    t_call = loop.time()
    try:
        held = await take(redis, options, hook, job)
    except (LockBusy, AcquireTimeout) as exc:
        why = "busy" if isinstance(exc, LockBusy) else "timeout"
        report_failed(hook, options.name, why, t_call)
        raise
    scope = None
    if block:
        scope = held.companion.cancel_scope()
        scope.__enter__()  # (no await since the grant: see take)
    held.start(scope, waited=loop.time() - t_call)
    return held


_SLOT_TRIES = 5  # attempts after MOVED or an unreachable node (the map reloaded each time)
_SLOT_PAUSE = 0.05  # seconds before the first retry that waits (doubled each)
_SLOT_PAUSE_MOST = 0.5  # seconds: the longest pause between those retries
_SLOT_ERRORS = (MovedError, AskError, TryAgainError, ClusterDownError, RedisConnectionError)
"""What an acquire on a cluster tries again after, the slot map reloaded (see _SlotRetry)."""
_UNREACHABLE_PATIENCE = 30.0  # seconds a blocking acquire without blocking_timeout waits
# out its slot's unreachable primary (a failover takes the cluster's node timeout, 15 s
# by default, and a little more)


async def _take_on_cluster(
    cluster: RedisCluster, options: LeaseOptions, hook: EventHook | None, job: Job | None
) -> Tenure:
    """``_take`` on the primary that owns the lock's slot (see ``_redis._cluster``), the
    slot map reloaded after each failed attempt; when it tries again is ``_SlotRetry``'s."""
    retry = _SlotRetry(options, asyncio.get_running_loop())
    while True:
        attempt = retry.options()
        try:
            node = await node_client(cluster, options.base_key)
            return await _take(node, attempt, hook, job)
        except _SLOT_ERRORS as exc:
            await retry.after(exc)
            try:
                await reload_slots(cluster)
            except (RedisError, RedisClusterException) as exc:
                # (the next attempt goes by the map as it is, and tells what is wrong)
                log.debug("reloading the cluster's slot map failed: %r", exc)


class _SlotRetry:
    """When an acquire on a cluster tries again. A ``MOVED`` tries again at once
    (``_SLOT_TRIES`` in all). ``ASK`` or ``TRYAGAIN`` (the slot is migrating),
    ``CLUSTERDOWN`` (no node serves the slot), or a primary that cannot be reached (nothing
    sent: it died, and its replica is not promoted yet) wait a little and try again: while
    ``blocking``, until that ends or ``blocking_timeout`` runs out (counted once, from the
    call, across attempts; an unreachable primary, without one, ``_UNREACHABLE_PATIENCE``
    seconds); otherwise ``_SLOT_TRIES`` times in all, an unreachable node at once."""

    def __init__(self, options: LeaseOptions, loop: asyncio.AbstractEventLoop) -> None:
        self._options = options
        self._loop = loop
        start = loop.time()
        wait = options.blocking_timeout
        self._deadline = None if wait is None else start + wait
        self._patience = start + _UNREACHABLE_PATIENCE if wait is None else math.inf
        self._attempts = 0
        self._moved = 0
        self._pause = _SLOT_PAUSE

    def options(self) -> LeaseOptions:
        """The options of the next attempt: its ``blocking_timeout`` what is left."""
        self._attempts += 1
        deadline = self._deadline
        if deadline is None or self._attempts == 1:
            return self._options
        return replace(self._options, blocking_timeout=max(0.0, deadline - self._loop.time()))

    async def after(self, error: BaseException) -> None:
        """Wait before the next attempt, or raise: ``error`` itself, or ``AcquireTimeout``
        when the wait would pass ``blocking_timeout``."""
        options = self._options
        unreachable = isinstance(error, RedisConnectionError)
        if unreachable and not not_sent(error):
            raise error  # (sent: what became of it is the engine's, which gave up)
        if isinstance(error, MovedError) or (unreachable and not options.blocking):
            self._moved += 1
            if self._moved >= _SLOT_TRIES:
                raise error
            return
        if not options.blocking and self._attempts >= _SLOT_TRIES:
            raise error
        now = self._loop.time()
        if unreachable and now + self._pause > self._patience:
            raise error
        deadline = self._deadline
        if deadline is not None and deadline - now <= self._pause:
            timeout = options.blocking_timeout or 0.0
            raise AcquireTimeout(options.name, timeout, _why(error)) from error
        await asyncio.sleep(self._pause)
        self._pause = min(self._pause * 2, _SLOT_PAUSE_MOST)


def _why(error: BaseException) -> str:
    """What kept an acquire on a cluster from its lock (for ``AcquireTimeout``)."""
    if isinstance(error, ClusterDownError):
        return "its slot was not served"
    if isinstance(error, RedisConnectionError):
        return "its slot's primary could not be reached"
    return "its slot was migrating"


async def _take(
    redis: Redis, options: LeaseOptions, hook: EventHook | None, job: Job | None
) -> Tenure:
    """``take()`` on one server, by the engine (``_kinds._engine``) with the options'
    kind: the lease on the key the grant holds."""
    companion = companion_for(redis)
    if options.limit == 1:
        # (a task may hold more than one permit of a semaphore; any other lock taken again
        # by a task that holds it would wait for itself)
        companion.check_not_holding(options.base_key, options.name)
    kind = _kind(options, companion, job)
    companion.retain()
    companion.check_server_once()
    try:
        token, grant = await acquire_by(companion, options, kind)
    except (JobDone, JobConflict):
        # A job's result (or conflict): its caller returns at once; letting go of the
        # companion (closing idle side connections) goes on in the background.
        let_go(companion)
        raise
    except BaseException:
        await unretain(companion)
        raise
    hold = kind.holding(token, grant)
    # (a job's own attempt keeps its fingerprint in the key's value; a handed key not)
    suffix = f":{job.fingerprint}" if job and job.fingerprint and not grant.handed else ""
    return Tenure(hold, companion, token, grant.fencing_token, grant.t_send, hook, suffix)


def _kind(options: LeaseOptions, companion: Companion, job: Job | None) -> Kind:
    """The kind of lock the options ask for, as the engine's policy."""
    if options.limit > 1:
        return Permits(options)
    if options.fair:
        return Fair(options)
    if options.shared:
        return Shared(options)
    return Mutex(options, companion, job)
