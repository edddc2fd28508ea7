"""Sentinel: renewals follow the primary the sentinels name, at every batch.

Design note. A Sentinel client's connections ask the sentinels where the primary is only
when they connect, and redis-py reconnects one only when the server it reaches answers
``READONLY``, that is once the old primary has been turned into a replica. Between the
promotion of a replica and that demotion (up to about ten seconds: a sentinel reconfigures
the old primary when it next reads its ``INFO``, and never if it cannot reach it), the old
primary still accepts writes. Renewals sent there are lost with it, while the copy of the
key on the new primary runs out: a lease held across a failover was lost at its deadline,
or, once the key there had expired, found not ours.

So before each batch of renewals of a Sentinel client (one query per batch, every ttl/3,
not one per lease), :func:`follow_primary` asks the sentinels where the primary is, and
closes every connection that still reaches another server: asynclock's own pools', the
wake-up subscription, the lane's idle ones and the caller's pool's idle ones. Each
reconnects through the sentinels at its next use, to the primary they name. The lane
also learns that address, and closes a connection that was busy meanwhile as it comes
back, so acquires and releases follow as well.
The query gets at most half of the batch's time; if no sentinel answers in time, the
renewal goes where its connection already is, as it did before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import RedisError

from .._redis._lane import Lane, reaches_another
from .._redis._leftovers import idle_connections, pool_connections
from .._redis._valkey import sentinel_classes, valkey_errors

__all__ = ["follow_primary", "sentinel_primary_pool"]

log = logging.getLogger("asynclock")


def sentinel_primary_pool(client: Redis) -> SentinelConnectionPool | None:
    """``client``'s pool if it is a Sentinel pool of a primary (``master_for``), else None."""
    pool = client.connection_pool
    if isinstance(pool, sentinel_classes()[0]) and pool.is_master:
        return pool  # type: ignore[no-any-return]
    return None


_UNANSWERED: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)


async def follow_primary(
    pool: SentinelConnectionPool,
    deadline: float,
    lane: Lane,
    own: Iterable[Redis | None],
    subscription: Any = None,
) -> None:
    """Ask the sentinels of ``pool`` where the primary is (until loop time ``deadline``)
    and close every connection that reaches another server: the ``own`` clients'
    (asynclock's pools), the waiting room's ``subscription`` (it reconnects and
    subscribes again by itself), the ``lane``'s idle ones (and tell the lane, which
    closes a busy one as it comes back) and the caller's pool's idle ones. Each
    reconnects through the sentinels at its next use. Never raises but a cancellation:
    a sentinel that does not answer leaves every connection as it is, and a connection
    that fails to close is left to fail at its next use."""
    try:
        async with asyncio.timeout_at(deadline):
            address: tuple[str, int] = await pool.get_master_address()  # type: ignore[no-untyped-call]
    except _UNANSWERED + valkey_errors() as exc:
        log.debug("no sentinel said where the primary is: %r", exc)
        return
    home = lane.home = (address[0], int(address[1]))
    # (a subscription that is None, or not connected, is passed over: reaches_another)
    connections = [subscription, *lane.idle_connections(), *idle_connections(pool)]
    for client in own:
        if client is not None:
            connections += pool_connections(client.connection_pool)
    for connection in connections:
        if reaches_another(connection, home):
            try:
                await connection.disconnect(nowait=True)
            except Exception as exc:  # (it fails again at its next use, and reconnects)
                log.debug("closing a connection to the old primary: %r", exc)
