"""Fencing in PostgreSQL: a lease's fencing token checked in the same transaction as the
effects it guards (extra ``asynclock[postgres]``; ``asyncpg`` or ``psycopg`` 3).

::

    await asynclock.postgres.install(conn)               # once per start, any process
    async with asynclock.lease(redis, f"job:{job_id}") as lock:
        async with conn.transaction():                    # asyncpg; psycopg alike
            await asynclock.postgres.fence(conn, lock)    # LockLost(FENCED) if stale
            ...                                           # the effects, then commit

Design note. ``fence()`` upserts ``(lease key, fencing token)`` into the fence table unless
a higher token is recorded, in one statement (``INSERT ... ON CONFLICT DO UPDATE ... WHERE
recorded <= ours``). PostgreSQL locks the conflicting row whether or not it updates it,
until the transaction ends: transactions fenced by the same lock serialize, so a stale
holder whose transaction began first cannot commit after a newer holder's, and once a
newer token is recorded every older one is refused. A holder passes the fence as often as
it likes (``>=``), one transaction after another. Fencing tokens only grow, even when
Redis lost its keys (they are floored at Redis's clock), so the record stays right across
a Redis restart or ``FLUSHALL``. The drivers are recognized by their type, never imported
here: nothing is loaded that the application did not load itself.
"""

from __future__ import annotations

import re
from typing import Any

from ._base._exceptions import LockLost, LossReason
from ._lifecycle._lease import Lease, LeaseState

__all__ = ["fence", "install"]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")
_INSTALL_LOCK = 0x6173796E636C6B  # (pg_advisory_xact_lock key: "asynclk")


def _table(table: object) -> str:
    """``table`` as a quoted SQL identifier (``schema.name`` allowed), checked before I/O."""
    if not isinstance(table, str):
        raise TypeError(f"table must be a str, not {type(table).__name__}")
    if not _IDENTIFIER.match(table):
        raise ValueError(
            f"table must be a plain identifier (letters, digits, _; schema.name allowed), "
            f"got {table!r}"
        )
    return ".".join(f'"{part}"' for part in table.split("."))


def _driver(conn: object) -> str:
    """'asyncpg' or 'psycopg' by the connection's type, or TypeError."""
    for cls in type(conn).__mro__:
        module = cls.__module__
        if module.startswith("asyncpg"):
            return "asyncpg"
        if module.startswith("psycopg") and cls.__name__ == "AsyncConnection":
            return "psycopg"
    raise TypeError(
        "conn must be an asyncpg connection or a psycopg (3) AsyncConnection, "
        f"not {type(conn).__module__}.{type(conn).__qualname__}"
    )


def _in_transaction(conn: Any, driver: str) -> bool:
    if driver == "asyncpg":
        return bool(conn.is_in_transaction())
    from psycopg.pq import TransactionStatus  # (psycopg is loaded: conn is one of its)

    return bool(conn.info.transaction_status == TransactionStatus.INTRANS)


async def install(conn: Any, table: str = "asynclock_fences") -> None:
    """Create the fence table if it does not exist. Safe to call on every start, from
    many processes at once (they serialize on an advisory lock). Runs in a transaction
    of its own (a savepoint, inside the caller's).

    Raises:
        TypeError, ValueError: ``conn`` is not a supported connection, or ``table`` is
            not a plain identifier (before any I/O).
    """
    name = _table(table)
    _driver(conn)
    statements = (
        f"SELECT pg_advisory_xact_lock({_INSTALL_LOCK})",
        f"CREATE TABLE IF NOT EXISTS {name} ("
        "name text PRIMARY KEY, token bigint NOT NULL, "
        "fenced_at timestamptz NOT NULL DEFAULT now())",
    )
    async with conn.transaction():
        for statement in statements:
            await conn.execute(statement)


async def fence(conn: Any, lease: Lease, table: str = "asynclock_fences") -> None:
    """Record ``lease.fencing_token`` for the lease's lock in the caller's open transaction
    unless a higher token was recorded, and keep that row locked until the transaction
    ends. One round trip. Call it before the transaction's effects; a holder may fence
    any number of transactions.

    Raises:
        LockLost: a higher token is recorded (``reason`` ``fenced``: a newer holder has
            written; this transaction must not commit, so let the error leave the
            ``async with conn.transaction()``), or the lease is already known lost
            (without a query).
        RuntimeError: not inside a transaction, or the lease was given back (before any
            query).
        TypeError, ValueError: bad arguments (before any query).
    """
    name = _table(table)
    driver = _driver(conn)
    if not isinstance(lease, Lease):
        raise TypeError(f"lease must be an asynclock Lease, not {type(lease).__name__}")
    if lease.state is LeaseState.LOST:
        raise LockLost(lease.name, lease.lost_reason or LossReason.DEADLINE)
    if lease.state is LeaseState.RELEASED:
        raise RuntimeError(f"the lease {lease.name!r} has been given back: nothing to fence")
    if not _in_transaction(conn, driver):
        raise RuntimeError(
            "fence() must run inside the transaction of the effects it guards: open one "
            "first (async with conn.transaction(): ...)"
        )
    sql = (
        f"INSERT INTO {name} AS f (name, token) VALUES ({{0}}, {{1}}) "
        "ON CONFLICT (name) DO UPDATE SET token = EXCLUDED.token, fenced_at = now() "
        "WHERE f.token <= EXCLUDED.token RETURNING f.token"
    )
    key, token = lease.key, lease.fencing_token
    if driver == "asyncpg":
        row = await conn.fetchrow(sql.format("$1", "$2"), key, token)
    else:
        cursor = await conn.execute(sql.format("%s", "%s"), (key, token))
        row = await cursor.fetchone()
    if row is None:
        raise LockLost(lease.name, LossReason.FENCED, "a newer holder's token is recorded")
