"""Redis Cluster: a lock lives on the primary that owns its slot.

Design note. Every key of a lock shares the hash tag ``{name}``, so one slot, so one
primary holds all of them and every script runs there whole. A lease on a
``RedisCluster`` client is therefore a lease on that primary: :func:`node_client` gives
a plain ``Redis`` client of the primary that owns the lock's slot, made once per node and
kept on the cluster client, and everything else (the lane, the watchdog that renews in
batches, the wake-up subscription, handoffs) runs on it as on a single server. Renewals
are then coalesced per node, and handoffs are as fast as on one server.

A node client's pool keeps no idle connection of its own: a released connection is
closed. The lane (``_lane``) holds a few while leases come and go and gives them back
after a second unused, so a busy node costs no reconnects and an idle one holds nothing
open once the application is done with its cluster client.

Wake-ups use sharded pub/sub on the lock's node: a lock's channels carry its hash tag,
so they belong to its slot; scripts run through a node's clients publish with
``SPUBLISH`` (their sharded twins, see ``_scripts.Script``), which reaches only the
subscribers of that node (and its replicas), and the waiting room subscribes with
``SSUBSCRIBE`` there. When the slot moves, the node drops those subscriptions
(``sunsubscribe``) and waiting falls back on the holder's time left, as everywhere.

When the slot map changes (a migration, a failover), an acquire refused with ``MOVED`` or
``ASK``, or unable to reach its node, reloads the map and tries the node that owns the
slot now (see ``_lifecycle._context``). A held lease follows its slot: a renewal answered
``MOVED`` or ``ASK`` moves the lease to the node named in the answer (:func:`node_at`,
no round trip, made from the cluster's node settings if the map does not know it yet),
where it is renewed at once, with ``ASKING`` while the slot is still migrating (and
released so: see ``_lifecycle._lease``). ``MIGRATE`` moves a key whole, expiry
included, so the lease is never without its key, and renewals refused on the way only
count as failed ones.

A valkey-py ``ValkeyCluster`` client is one too: its node clients are valkey-py
``Valkey`` clients with valkey-py pools (``_valkey.Family``), and its slot map is loaded
through ``_valkey.redis_errors``, so that what it raises is redis-py's classes as well.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterDownError

from .._base._shield import retrieved
from ._valkey import family_of, redis_errors

__all__ = [
    "cluster_of",
    "holding_of",
    "is_sharded",
    "mark_sharded",
    "node_at",
    "node_client",
    "primary_clients",
    "reload_slots",
]

_NODES: Final = "_asynclock_nodes"  # on a cluster client: node name -> its node client
_CLUSTER: Final = "_asynclock_cluster"  # on a node client: a weak reference to its cluster
_SHARDED: Final = "_asynclock_sharded"  # on a client of a cluster node: True


def mark_sharded(client: Redis) -> None:
    """Mark ``client`` as a client of a cluster node: scripts run through it publish
    with ``SPUBLISH`` (see ``_scripts.Script``)."""
    setattr(client, _SHARDED, True)


def is_sharded(client: Redis) -> bool:
    """Whether ``client`` is a client of a cluster node (see :func:`mark_sharded`)."""
    return getattr(client, _SHARDED, False) is True


class _Closing:
    """Makes a pool class a node client's pool: connections given back are closed (see
    the design note)."""

    async def release(self, connection: Any) -> None:
        try:
            await connection.disconnect()
        finally:
            await super().release(connection)  # type: ignore[misc]


@functools.cache
def _node_pool(base: type[Any]) -> type[Any]:
    """The node pool class made of a library's pool class ``base`` (redis-py's or
    valkey-py's, see ``_valkey.Family``), made once per library."""
    return type("_NodePool", (_Closing, base), {})


async def node_client(cluster: RedisCluster, key: str) -> Redis:
    """A ``Redis`` client of the primary that owns ``key``'s slot (by the cluster
    client's slot map, loaded first if it never was)."""
    await redis_errors(cluster.initialize())  # (nothing once done)
    node = cluster.get_node_from_key(key)
    if node is None:  # (the map has no owner for the slot: the cluster is not ready)
        raise ClusterDownError(f"no node of the cluster owns the slot of {key!r}")
    return _client_of(cluster, node)


async def primary_clients(cluster: RedisCluster) -> list[Redis]:
    """A ``Redis`` client of each primary of the cluster (by its slot map)."""
    await redis_errors(cluster.initialize())
    return [_client_of(cluster, node) for node in cluster.get_primaries()]


def cluster_of(client: Redis) -> RedisCluster | None:
    """The cluster client whose node client ``client`` is (None: not one, or gone)."""
    ref: weakref.ref[RedisCluster] | None = getattr(client, _CLUSTER, None)
    return None if ref is None else ref()


_HOLDING: Final = "_asynclock_holding"  # on a cluster client: see holding_of


def holding_of(cluster: RedisCluster) -> dict[Any, int]:
    """The register of blocks and guards open of ``cluster``'s locks, shared by the
    companions of all its nodes (``Companion._holding``): a lock belongs to a slot, and
    a slot moves between nodes while a block of it is open."""
    holding: dict[Any, int] = vars(cluster).setdefault(_HOLDING, {})
    return holding


def node_at(cluster: RedisCluster, host: str, port: int) -> Redis | None:
    """The node client of the node at ``host``:``port`` (as a ``MOVED`` or ``ASK`` reply
    names it), with no round trip: made like the others if the slot map does not know
    that node yet. None if the cluster client knows no node at all."""
    name = f"{host}:{port}"
    client = _nodes(cluster).get(name)
    if client is not None:
        return client
    node = cluster.get_node(node_name=name)
    if node is not None:
        return _client_of(cluster, node)
    known = cluster.get_nodes()
    if not known:
        return None
    model = known[0]  # (every node of a cluster client has the same settings)
    settings = {**model.connection_kwargs, "host": host, "port": port}
    return _make(cluster, name, model, settings)


def _nodes(cluster: RedisCluster) -> dict[str, Redis]:
    """The node clients made for ``cluster``, by node name."""
    clients: dict[str, Redis] = vars(cluster).setdefault(_NODES, {})
    return clients


def _client_of(cluster: RedisCluster, node: Any) -> Redis:
    return _nodes(cluster).get(node.name) or _make(cluster, node.name, node, node.connection_kwargs)


def _make(cluster: RedisCluster, name: str, model: Any, settings: dict[str, Any]) -> Redis:
    """The node client of the node ``name``, made with ``settings`` and the connection
    class and pool size of ``model`` (a node of the cluster client)."""
    family = family_of(cluster)
    pool = _node_pool(family.pool)(
        connection_class=model.connection_class, max_connections=model.max_connections, **settings
    )
    client: Redis = family.client(connection_pool=pool)
    _nodes(cluster)[name] = client
    setattr(client, _CLUSTER, weakref.ref(cluster))
    mark_sharded(client)
    return client


async def reload_slots(cluster: RedisCluster) -> None:
    """Reload the cluster client's slot map (a slot moved, or a node failed over).

    Callers at once share one reload: the one in flight, or a new one. Two reloads of
    one client side by side each replace the client's node objects, and one may drop the
    other's old nodes before they are closed (valkey-py warns of them as unclosed); a
    hundred waiters of a failed-over lock would also send a hundred ``CLUSTER SLOTS``.
    The shared reload runs to its end even if its callers are cancelled."""
    loop = asyncio.get_running_loop()
    running: asyncio.Task[None] | None = getattr(cluster, _RELOADING, None)
    if running is None or running.get_loop() is not loop or running.done():
        reload = redis_errors(cluster.nodes_manager.initialize())
        running = loop.create_task(reload, name="asynclock-slot-map")
        running.add_done_callback(retrieved)  # (its error is its callers', if any are left)
        setattr(cluster, _RELOADING, running)
    await asyncio.shield(running)


_RELOADING: Final = "_asynclock_reloading"  # on a cluster client: its reload in flight
