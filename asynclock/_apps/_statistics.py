"""``statistics()``: what holds a lock and who waits for it, in the spirit of anyio's
``Lock.statistics()``, for every kind of lock, read from Redis in one round trip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from .._base._options import Client, LeaseOptions, is_cluster, redis_api
from .._redis._cluster import node_client
from .._redis._scripts import STATISTICS
from .._session._connections import companion_for

__all__ = ["LockStatistics", "statistics"]


@dataclass(frozen=True, slots=True)
class LockStatistics:
    """A snapshot of a lock (see :func:`statistics`). Times in seconds."""

    name: str
    exclusive: bool
    """A plain (exclusive) or fair lease holds the lock."""
    shared_holders: int
    """Shared (read) leases holding it."""
    permits_in_use: int
    """Permits of the semaphore held (0 if it is not one)."""
    limit: int | None
    """The limit its permits are held with; None when no permit was taken lately."""
    time_left: float | None
    """Seconds before the lock's key expires unless renewed; None when it has none."""
    waiting_clients: int
    """Clients (of any process) registered as waiting for an exclusive lease of it."""
    queued: int
    """Waiters in its fair queue (of any process)."""
    local_waiters: int
    """This client's waiters for it, in this event loop (every kind)."""

    @property
    def held(self) -> bool:
        """Whether anything holds the lock: an exclusive lease, a shared one, a permit."""
        return self.exclusive or self.shared_holders > 0 or self.permits_in_use > 0


async def statistics(redis: Client, name: str, *, prefix: str = "asynclock:") -> LockStatistics:
    """What holds the lock ``name`` now, and who waits for it: one round trip, nothing
    written. Works for every kind (plain, fair, shared, semaphore) at once.

    Raises ``TypeError``/``ValueError`` for bad arguments before any I/O, and what the
    client raises when Redis cannot be reached.
    """
    redis = redis_api(redis)
    options = LeaseOptions.cached(redis, name, {"prefix": prefix})
    base = options.base_key
    keys = [
        base,
        options.readers_key,
        options.limit_key,
        options.waiting_key,
        options.queue_key,
        options.alive_key,
        options.permits_key,
    ]
    if is_cluster(redis):  # (the lock's node: see _redis/_cluster)
        redis = await node_client(redis, base)
    companion = companion_for(redis)
    reply = await STATISTICS(companion.lane, keys, [])
    pttl, shared, readers, limit, permits, waiting, queued = (
        int(x) for x in cast(list[int], reply)
    )
    room = companion.room
    return LockStatistics(
        name=name,
        exclusive=pttl != -2 and not shared,
        shared_holders=readers,
        permits_in_use=permits,
        limit=limit or None,
        time_left=pttl / 1000 if pttl >= 0 else None,
        waiting_clients=waiting,
        queued=queued,
        local_waiters=room.waiting(options.channel) + room.listeners(options.channel),
    )
