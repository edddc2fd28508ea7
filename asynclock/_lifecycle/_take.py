"""Taking a lock: the kind's acquisition on the right server, as a ``Lease``.

Design note. ``take`` picks the way in of the lease's kind (``_kinds``), on the server
that holds the lock (for a Redis Cluster, the primary that owns its slot, see
``_redis._cluster``), and returns the held lease, not yet watched: its caller starts it
with no await in between, so a cancellation cannot fall between the grant and the lease
that owns it. With ``min_replicas`` the lease is confirmed by replicas first
(``_replicas``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import replace

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

from .._base._events import EventHook, LeaseEventKind, hooks, report
from .._base._exceptions import AcquireTimeout, LockBusy
from .._base._options import Client, LeaseOptions, is_cluster, redis_api
from .._kinds._engine import Kind, acquire
from .._kinds._fair import Fair
from .._kinds._mutex import Job, JobConflict, JobDone, Mutex
from .._kinds._permits import Permits
from .._kinds._shared import Shared
from .._redis._cluster import node_client, reload_slots
from .._redis._lane import not_sent
from .._session._connections import Companion, companion_for
from ._lease import Tenure
from ._release import let_go, unretain
from ._replicas import confirm_replicas

__all__ = ["begin", "take"]

log = logging.getLogger("asynclock")


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
        if hook is not None or hooks():
            now = loop.time()
            why = "busy" if isinstance(exc, LockBusy) else "timeout"
            failed = LeaseEventKind.ACQUIRE_FAILED
            report(hook, failed, options.name, 0, now, 0.0, why, now - t_call)
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
    loop = asyncio.get_running_loop()
    retry = _SlotRetry(options, loop)
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
    companion.check_eviction_once()
    try:
        token, grant = await acquire(companion, options, kind)
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
