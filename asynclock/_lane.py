"""The short path to Redis for acquires and releases.

Design note. An uncontended ``async with lease(...)`` is two round trips, and on that hot
path redis-py's per-command machinery costs a good part of a round trip: with a socket
timeout set (5 s by default) every write runs under ``asyncio.wait_for``, which makes a
task and costs extra event-loop iterations, and every read under a timeout of its own.

A :class:`Lane` keeps a few connections (at most a quarter of the pool's capacity, and
16) checked out of the caller's own pool while
leases come and go, with their socket timeout set aside, and bounds each exchange (write
and read together) by one ``asyncio.timeout`` of the connection's own socket timeout. The
connections stay in the caller's pool's books, so closing the client closes them; they
are given back (their timeout restored) once the lane has gone unused for ``_LINGER``
seconds.

It is a fast path only. When all of its connections are busy, a call goes the ordinary
way on the client (``_scripts.exchange``), and when the caller's pool is exhausted it
raises ``MaxConnectionsError`` with nothing sent, as that does. A connection that fails
or is interrupted mid-exchange is disconnected by redis-py and reconnects on its next
use; the callers already retry once after an unknown outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Final

from redis.asyncio import Redis
from redis.exceptions import ResponseError

__all__ = ["Lane", "exchange"]

_SIZE: Final = 16  # connections the lane may hold at once, and at most 1/4 of the pool's
_LINGER: Final = 1.0  # seconds unused after which the lane gives its connections back


class Lane:
    """Connections borrowed from one client's pool for the hot path; see the design note."""

    __slots__ = ("_held", "_idle", "_loop", "_returning", "_size", "_timer", "_used", "client")

    def __init__(self, client: Redis, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self._loop = loop
        self._idle: list[tuple[Any, float | None]] = []  # (connection, its socket timeout)
        self._held = 0  # connections checked out by the lane, idle or busy
        self._used = 0.0  # loop time of the last call
        self._timer: asyncio.TimerHandle | None = None
        self._returning: asyncio.Task[None] | None = None
        limit = getattr(client.connection_pool, "max_connections", None) or _SIZE * 8
        self._size = max(1, min(_SIZE, int(limit) // 4))  # leave the application its pool

    async def call(self, packed: bytes, limit: float | None = None) -> object:
        """Send one packed command and return its reply; an error reply is returned, not
        raised, as by :func:`exchange`.

        The exchange is bounded by the connection's socket timeout and by ``limit``
        (seconds) if given; past it ``TimeoutError`` is raised. Raises
        ``MaxConnectionsError`` (nothing sent) when the caller's pool is exhausted, and
        the connection error or cancellation that interrupted the exchange (the outcome
        is then unknown).
        """
        self._used = self._loop.time()
        if self._idle:
            connection, saved = self._idle.pop()
        elif self._held < self._size:
            connection, saved = await self._borrow()
        else:  # every lane connection is busy: the ordinary way, bounded by limit
            async with asyncio.timeout(limit):
                (reply,) = await exchange(self.client, packed, 1)
            return reply
        bound = saved if limit is None or (saved is not None and saved < limit) else limit
        try:
            async with asyncio.timeout(bound):
                await connection.send_packed_command(packed, check_health=False)
                try:
                    reply = await connection.read_response()
                except ResponseError as error:
                    reply = error
        except BaseException:
            await self._give_back(connection, saved)
            raise
        self._idle.append((connection, saved))
        return reply

    async def _borrow(self) -> tuple[Any, float | None]:
        pool = self.client.connection_pool
        self._held += 1  # counted before the await: a burst takes no more than _size
        try:
            connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        except BaseException:
            self._held -= 1
            raise
        timeout = connection.socket_timeout
        connection.socket_timeout = None  # our own bound replaces it (see the design note)
        if self._timer is None:
            self._timer = self._loop.call_later(_LINGER, self._check)
        return connection, (float(timeout) if timeout else None)

    async def _give_back(self, connection: Any, saved_timeout: float | None) -> None:
        connection.socket_timeout = saved_timeout
        self._held -= 1
        await self.client.connection_pool.release(connection)

    def _check(self) -> None:
        """Give the idle connections back once the lane has gone unused for _LINGER s."""
        self._timer = None
        if not self._held:
            return
        idle_for = self._loop.time() - self._used
        if idle_for < _LINGER or self._returning is not None:
            self._timer = self._loop.call_later(max(_LINGER - idle_for, 0.01), self._check)
            return
        self._returning = self._loop.create_task(self.aclose(), name="asynclock-lane-return")

    async def aclose(self) -> None:
        """Give every idle connection back to the caller's pool (busy ones stay until
        their call returns, then go back when the lane is next found unused)."""
        try:
            while self._idle:
                connection, timeout = self._idle.pop()
                with contextlib.suppress(Exception):
                    await self._give_back(connection, timeout)
        finally:
            self._returning = None
            if self._held and self._timer is None:
                self._timer = self._loop.call_later(_LINGER, self._check)


async def exchange(client: Redis, packed: bytes, count: int) -> list[object]:
    """Write ``count`` packed commands at once on one of ``client``'s pooled connections
    and read their replies; a per-command error reply (NOSCRIPT, READONLY, OOM, ...) is
    returned in its place.

    This skips redis-py's per-command layers (retries, observability, pipelines): on the
    hot path they cost more than the round trip. On a connection error or cancellation
    mid-way the connection's state is unknown, so it is closed before it goes back to the
    pool. Raises ``MaxConnectionsError`` (nothing sent) when the pool is exhausted.
    """
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        await connection.send_packed_command(packed)
        replies: list[object] = []
        for _ in range(count):
            try:
                replies.append(await connection.read_response())
            except ResponseError as error:
                replies.append(error)
        return replies
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)
