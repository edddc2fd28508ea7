"""What a closed event loop leaves behind in a client's connection pools.

Design note. A redis-py client made outside any event loop (a module-level client, the
usual pytest-asyncio set-up with a new loop per test) is used on one loop after another.
Its pool keeps the connections the previous loop opened; their streams belong to a loop
that has closed, so the next command on one fails with ``RuntimeError: Event loop is
closed`` (or "attached to a different loop"), and so does closing one the ordinary way,
since a transport closes through its own loop. When a client is first used on a new loop
(see ``companion_for``), asynclock closes the sockets of such connections itself and marks
the connections disconnected, so they connect afresh, on the new loop, at their next use.
Connections of a loop that is still open are never touched: a client shared with a loop
running in another thread is not ours to close.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = [
    "forget_closed_loops",
    "forget_connection",
    "idle_connections",
    "pool_connections",
]


def forget_closed_loops(pool: Any) -> int:
    """Disconnect the connections of ``pool`` (a redis-py asyncio pool) whose streams
    belong to a closed event loop, without that loop. Returns how many were."""
    return sum(forget_connection(connection) for connection in pool_connections(pool))


def idle_connections(pool: Any) -> list[Any]:
    """The connections ``pool`` (a redis-py asyncio pool) holds idle."""
    return _members(pool, "_available_connections")


def pool_connections(pool: Any) -> list[Any]:
    """Every connection ``pool`` (a redis-py asyncio pool) has made, idle or in use."""
    return [*_members(pool, "_available_connections"), *_members(pool, "_in_use_connections")]


def _members(pool: Any, attribute: str) -> list[Any]:
    try:
        return list(getattr(pool, attribute, None) or ())
    except TypeError:  # (a pool class that keeps them otherwise: nothing to do)
        return []


def forget_connection(connection: Any) -> bool:
    """Disconnect ``connection`` if its stream belongs to a closed event loop, without
    that loop; returns whether it did."""
    writer = getattr(connection, "_writer", None)
    loop = getattr(writer, "_loop", None)
    if loop is None or not loop.is_closed():
        return False
    transport = getattr(writer, "transport", None)
    # Marks the transport closing (so the stream does not warn when collected), then
    # fails to schedule the rest on the closed loop; the socket is closed here instead.
    with contextlib.suppress(Exception):
        transport.close()  # type: ignore[union-attr]
    sock = getattr(transport, "_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
        # The transport would close (and warn about) the socket when collected; it is
        # closed already, and its loop can no longer run the transport's own close.
        with contextlib.suppress(AttributeError):
            transport._sock = None  # type: ignore[union-attr]
    connection._reader = None
    connection._writer = None
    with contextlib.suppress(Exception):  # (AttributeError too: a connection without a parser)
        connection._parser.on_disconnect()
    return True
