"""The short path to Redis for acquires and releases.

Design note. An uncontended ``async with lease(...)`` is two round trips, and on that hot
path redis-py's per-command machinery costs a good part of a round trip: with a socket
timeout set (5 s by default) every write runs under ``asyncio.wait_for``, which makes a
task and costs extra event-loop iterations, and every read under a timeout of its own.

A :class:`Lane` keeps a few connections (a quarter of the pool's capacity, 16 at most;
none for a pool of fewer than 4) checked out of the caller's own pool while leases come and
go, with their socket timeout set aside, and bounds each exchange (write and read
together) by one ``asyncio.timeout`` of the connection's own socket timeout, or less when
the caller has less time. The connections stay in the caller's pool's books, so closing
the client closes them; they are given back (their timeout restored) once the lane has
gone unused for ``_LINGER`` seconds, and when the event loop shuts down.

It is a fast path only. When all of its connections are busy, a call goes the ordinary
way on the client (:func:`exchange`), and when the caller's pool is exhausted it raises
``MaxConnectionsError`` with nothing sent, as that does. A connection that fails or is
interrupted mid-exchange is disconnected by redis-py and reconnects on its next use; the
callers already retry once after an unknown outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Final

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, ResponseError

__all__ = ["Lane", "encoding_of", "exchange"]

_SIZE: Final = 16  # connections the lane may hold at once, and at most 1/4 of the pool's
_LINGER: Final = 1.0  # seconds unused after which the lane gives its connections back


def encoding_of(client: Redis) -> tuple[str, str]:
    """The encoding and error handler ``client``'s connections use for arguments."""
    kwargs = client.connection_pool.connection_kwargs
    return kwargs.get("encoding", "utf-8"), kwargs.get("encoding_errors", "strict")


class Lane:
    """Connections borrowed from one client's pool for the hot path; see the design note."""

    __slots__ = (
        "_closing",
        "_held",
        "_idle",
        "_keeper",
        "_loop",
        "_size",
        "_used",
        "client",
        "encoding",
    )

    def __init__(self, client: Redis, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.encoding = encoding_of(client)
        """How the client's connections encode arguments: (encoding, error handler)."""
        self._loop = loop
        self._idle: list[tuple[Any, float | None]] = []  # (connection, its socket timeout)
        self._held = 0  # connections checked out by the lane, idle or busy
        self._used = 0.0  # loop time of the last call
        self._keeper: asyncio.Task[None] | None = None
        self._closing = False  # set when the keeper is cancelled (the loop shuts down)
        limit = getattr(client.connection_pool, "max_connections", None) or _SIZE * 4
        self._size = min(_SIZE, int(limit) // 4)  # leave the application its pool (0: none)

    async def call(self, packed: bytes, deadline: float | None = None) -> object:
        """Send one packed command and return its reply; an error reply is returned, not
        raised, as by :func:`exchange`.

        The exchange is bounded by the connection's socket timeout and ends by
        ``deadline`` (loop time) if given; past either, ``TimeoutError`` is raised. Raises
        ``MaxConnectionsError`` (nothing sent) when the caller's pool is exhausted, and
        the connection error or cancellation that interrupted the exchange (the outcome
        is then unknown).
        """
        loop = self._loop
        self._used = now = loop.time()
        if self._idle:
            connection, saved = self._idle.pop()
        elif self._held < self._size:
            # At most half of the caller's time goes to getting a connection (a blocking
            # pool may make us wait); failing that, nothing was sent: the caller falls
            # back to asynclock's own pool with the rest.
            try:
                async with asyncio.timeout_at(None if deadline is None else (now + deadline) / 2):
                    connection, saved = await self._borrow()
            except (RedisConnectionError, OSError, TimeoutError) as exc:
                raise MaxConnectionsError(f"asynclock: no lane connection: {exc!r}") from exc
        else:  # every lane connection is busy (or none allowed): the ordinary way
            async with asyncio.timeout_at(deadline):
                (reply,) = await exchange(self.client, packed, 1)
            return reply
        ends = deadline
        if saved is not None and (ends is None or now + saved < ends):
            ends = now + saved
        try:
            if ends is None:  # (nothing bounds it, as with a client made with
                # socket_timeout=None: an unarmed asyncio.timeout still costs ~1.4 µs)
                reply = await _round_trip(connection, packed)
            else:
                async with asyncio.timeout_at(ends):
                    reply = await _round_trip(connection, packed)
        except BaseException:
            await self._give_back(connection, saved)
            raise
        if self._closing:  # the event loop is shutting down: nothing stays borrowed
            await self._give_back(connection, saved)
        else:
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
        if self._keeper is None:
            self._keeper = self._loop.create_task(self._keep(), name="asynclock-lane")
        return connection, (float(timeout) if timeout else None)

    async def _give_back(self, connection: Any, saved_timeout: float | None) -> None:
        """Restore the connection's timeout and return it to the pool; a cancellation
        while the pool's lock is awaited does not leave it counted as in use."""
        connection.socket_timeout = saved_timeout
        self._held -= 1
        await asyncio.shield(self.client.connection_pool.release(connection))

    async def _keep(self) -> None:
        """While the lane holds connections: give the idle ones back once it has gone
        unused for _LINGER seconds, and when the event loop shuts down (this task is
        then cancelled), so that a loop that ends leaves nothing borrowed."""
        try:
            while self._held:
                idle_for = self._loop.time() - self._used
                if idle_for >= _LINGER and self._idle:
                    await self.aclose()
                elif self._idle:
                    await asyncio.sleep(_LINGER - idle_for)
                else:  # every borrowed connection is busy: look again a linger later
                    await asyncio.sleep(_LINGER)
        except asyncio.CancelledError:
            self._closing = True  # calls still in flight give theirs back when done
            raise
        finally:
            self._keeper = None
            with contextlib.suppress(Exception):
                await self.aclose()

    async def aclose(self) -> None:
        """Give every idle connection back to the caller's pool (busy ones go back when
        their call fails, or later when the lane is found unused)."""
        while self._idle:
            connection, saved = self._idle.pop()
            with contextlib.suppress(Exception):
                await self._give_back(connection, saved)


async def _round_trip(connection: Any, packed: bytes) -> object:
    await connection.send_packed_command(packed, check_health=False)
    try:
        return await connection.read_response()
    except ResponseError as error:
        return error


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
        # At once: a graceful close could wait for the peer, and a renewal in flight must
        # end by its lease's deadline.
        await connection.disconnect(nowait=True)
        raise
    finally:
        await pool.release(connection)
