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
from .._base._options import Client, LeaseOptions, is_cluster
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
_SLOT_PAUSE = 0.05  # seconds before the first retry after ASK/TRYAGAIN (doubled each)
_SLOT_PAUSE_MOST = 0.5  # seconds: the longest pause between those retries


async def _take_on_cluster(
    cluster: RedisCluster, options: LeaseOptions, hook: EventHook | None, job: Job | None
) -> Tenure:
    """``_take`` on the primary that owns the lock's slot (see ``_redis._cluster``). A
    ``MOVED``, or a node that cannot be reached (nothing sent), reloads the slot map and
    tries again (``_SLOT_TRIES`` in all). ``ASK`` or ``TRYAGAIN`` (the slot is migrating),
    or ``CLUSTERDOWN`` (no node serves the slot: a failover under way), waits a little and
    tries again: while ``blocking``, until that ends or ``blocking_timeout`` runs out
    (counted once, from the call, across attempts); otherwise ``_SLOT_TRIES`` times."""
    loop = asyncio.get_running_loop()
    wait = options.blocking_timeout
    deadline = None if wait is None else loop.time() + wait
    pause = _SLOT_PAUSE
    moved = 0
    attempts = 0
    while True:
        attempts += 1
        attempt = options
        if deadline is not None and attempts > 1:
            attempt = replace(options, blocking_timeout=max(0.0, deadline - loop.time()))
        try:
            node = await node_client(cluster, options.base_key)
            return await _take(node, attempt, hook, job)
        except (
            MovedError,
            AskError,
            TryAgainError,
            ClusterDownError,
            RedisConnectionError,
        ) as exc:
            if isinstance(exc, MovedError | RedisConnectionError):
                moved += 1
                if moved >= _SLOT_TRIES or (
                    isinstance(exc, RedisConnectionError) and not not_sent(exc)
                ):
                    raise
            else:  # ASK, TRYAGAIN: a migration under way; CLUSTERDOWN: a failover
                left = None if deadline is None else deadline - loop.time()
                if not options.blocking and attempts >= _SLOT_TRIES:
                    raise
                if left is not None and left <= pause:
                    down = isinstance(exc, ClusterDownError)
                    why = "its slot was not served" if down else "its slot was migrating"
                    raise AcquireTimeout(options.name, wait or 0.0, why) from exc
                await asyncio.sleep(pause)
                pause = min(pause * 2, _SLOT_PAUSE_MOST)
            try:
                await reload_slots(cluster)
            except (RedisError, RedisClusterException) as exc:
                # (the next attempt goes by the map as it is, and tells what is wrong)
                log.debug("reloading the cluster's slot map failed: %r", exc)


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
