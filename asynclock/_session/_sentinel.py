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
closes every connection of asynclock's own pools (and the wake-up subscription) that
still reaches another server: the renewal then connects to the primary the sentinels
name, and the subscription reconnects there. When the address changed, the
caller's pool's idle connections are closed too (redis-py's ``get_master_address`` does
that), after the lane has given its connections back, so releases and acquires follow.
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

from .._redis._lane import Lane
from .._redis._leftovers import pool_connections

__all__ = ["follow_primary", "sentinel_primary_pool"]

log = logging.getLogger("asynclock")


def sentinel_primary_pool(client: Redis) -> SentinelConnectionPool | None:
    """``client``'s pool if it is a Sentinel pool of a primary (``master_for``), else None."""
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool) and pool.is_master:
        return pool
    return None


async def follow_primary(
    pool: SentinelConnectionPool,
    deadline: float,
    lane: Lane,
    own: Iterable[Redis | None],
    subscription: Any = None,
) -> None:
    """Ask the sentinels of ``pool`` where the primary is (until loop time ``deadline``)
    and close the connections of the ``own`` clients (asynclock's pools), and the
    waiting room's ``subscription``, that reach another server (the subscription
    reconnects and subscribes again by itself); if the primary moved, give the
    ``lane``'s connections back and close the caller's idle ones. Never raises but a
    cancellation: a sentinel that does not answer leaves every connection as it is."""
    before = pool.master_address
    try:
        async with asyncio.timeout_at(deadline):
            address: tuple[str, int] = await pool.get_master_address()  # type: ignore[no-untyped-call]
    except (RedisError, OSError, TimeoutError) as exc:
        log.debug("asynclock: no sentinel said where the primary is: %r", exc)
        return
    if before is not None and address != before:
        await lane.aclose()  # (its connections back, so that the next line closes them)
        await pool.disconnect(inuse_connections=False)
    connections = [] if subscription is None else [subscription]
    for client in own:
        if client is not None:
            connections += pool_connections(client.connection_pool)
    for connection in connections:
        if _reaches_another(connection, address):
            await connection.disconnect(nowait=True)


def _reaches_another(connection: Any, address: tuple[str, int]) -> bool:
    if not getattr(connection, "is_connected", False):
        return False
    return (connection.host, int(connection.port)) != (address[0], int(address[1]))
