"""The short path to Redis for acquires and releases.

Design note. An uncontended ``async with lease(...)`` is two round trips, and on that hot
path redis-py's per-command machinery costs a good part of a round trip: with a socket
timeout set (5 s by default) every write runs under ``asyncio.wait_for``, which makes a
task and costs extra event-loop iterations, and every read under a timeout of its own.

A :class:`Lane` keeps a few connections (a quarter of the pool's capacity, 16 at most;
none for a pool of fewer than 4) checked out of the caller's own pool while leases come and
go, with their socket timeout set aside, and bounds each exchange (write and read
together) by the connection's own socket timeout, or less when the caller has less time.
The connections stay in the caller's pool's books, so closing the client closes them; they
are given back (their timeout restored) once the lane has gone unused for ``_LINGER``
seconds, and when the event loop shuts down.

The bounds share one loop timer per lane (``_Bound``). An ``asyncio.timeout`` armed around
each exchange cost about 3 µs (a timer made, pushed on the loop's heap and cancelled), two
per lease, for a limit that an exchange of a fraction of a millisecond never reaches. The
shared timer is armed for the earliest bound in flight and is not cancelled when an
exchange ends; it re-arms only for an earlier bound, so while leases come and go it fires
about once per shortest bound in use (a release's ``release_timeout``, 2 s by default),
finding nothing due, and is cancelled when the lane gives its connections back. An
exchange past its bound is cancelled as ``asyncio.timeout`` would cancel it, and raises
``TimeoutError``; a cancellation from elsewhere passes through unchanged.

When all of its connections are busy, a call waits in the lane's line, and the next
connection to come free writes the calls in line in one write (``_BATCH`` at most) and
reads their replies in order (``_drain``): a burst of thousands of acquires or releases
costs a few writes and no further connections, where each call on a connection of its
own costs a round trip and, past the caller's pool, a wait for a free one (a release of
10,000 leases at once left most of them to their TTL that way). A caller that leaves the
line (its deadline, a cancellation) before its call is written leaves nothing sent; one
that leaves after has its reply read and dropped. A lane of no connections (a small
pool) sends every call the ordinary way (:func:`exchange`). When the caller's pool is
exhausted as the lane borrows, it raises ``MaxConnectionsError`` with nothing sent. A
connection that fails or is interrupted mid-exchange is disconnected and reconnects on
its next use; every call of a batch that failed gets the error (its outcome unknown),
and the callers already send again after an unknown outcome (once, or, for a cleanup,
until Redis answers within its bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError, MaxConnectionsError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from ._cluster import is_sharded
from ._compat import as_connection_error, as_max_connections_error, exhausted, get_connection
from ._valkey import as_redis_error, redis_errors, valkey_errors

__all__ = [
    "Lane",
    "encoding_in",
    "encoding_of",
    "exchange",
    "mark_not_sent",
    "not_sent",
    "reaches_another",
    "reply_text",
]

_SIZE: Final = 16  # connections the lane may hold at once, and at most 1/4 of the pool's
_LINGER: Final = 1.0  # seconds unused after which the lane gives its connections back
_BATCH: Final = 64  # calls in line written at once by a lane connection (see _drain)


def encoding_in(settings: Mapping[str, Any]) -> tuple[str, str]:
    """The encoding and error handler that connections made with ``settings`` use for
    text (arguments sent, channel names read back)."""
    return settings.get("encoding", "utf-8"), settings.get("encoding_errors", "strict")


def encoding_of(client: Redis | RedisCluster) -> tuple[str, str]:
    """The encoding and error handler ``client``'s connections use for arguments."""
    return encoding_in(client.get_connection_kwargs())


class Lane:
    """Connections borrowed from one client's pool for the hot path; see the design note."""

    def __init__(self, client: Redis, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.encoding = encoding_of(client)
        """How the client's connections encode arguments: (encoding, error handler)."""
        self.sharded = is_sharded(client)
        """A client of a cluster node: scripts publish with ``SPUBLISH``."""
        self.home: tuple[str, int] | None = None
        """Where the lane's connections must lead (host, port), once known (a Sentinel
        client's primary, see ``_session._connections``): one coming back from a call that
        leads elsewhere is closed, to reconnect there at its next use."""
        self._loop = loop
        self._idle: list[tuple[Any, float | None]] = []  # (connection, its socket timeout)
        self._held = 0  # connections checked out by the lane, idle or busy
        self._borrowing = 0  # of those, being checked out still (none to serve the line yet)
        self._used = 0.0  # loop time of the last call
        self._keeper: asyncio.Task[None] | None = None
        self._closing = False  # set when the keeper is cancelled (the loop shuts down)
        limit = getattr(client.connection_pool, "max_connections", None) or _SIZE * 4
        self._size = min(_SIZE, int(limit) // 4)  # leave the application its pool (0: none)
        self._bounds: set[_Bound] = set()  # the bounded exchanges in flight
        self._timer: asyncio.TimerHandle | None = None  # the bounds' shared timer
        self._line: deque[_InLine] = deque()  # calls waiting for a connection
        self._drains: set[asyncio.Task[None]] = set()  # (referenced while they run)

    async def call(
        self, packed: bytes, deadline: float | None = None, count: int = 1, *, alone: bool = False
    ) -> object:
        """Send one packed command and return its reply; an error reply is returned, not
        raised, as by :func:`exchange`. With ``count`` above 1, ``packed`` holds that many
        commands, and the list of their replies is returned.

        The exchange is bounded by the connection's socket timeout and ends by
        ``deadline`` (loop time) if given; past either, ``TimeoutError`` is raised. While
        every lane connection is busy the call waits in line (see the design note), or,
        ``alone`` (a command the server may hold, as ``WAIT``: none may wait behind it),
        goes the ordinary way. Raises ``MaxConnectionsError`` (nothing sent) when the
        caller's pool is exhausted, and the connection error or cancellation that
        interrupted the exchange (the outcome is then unknown).
        """
        self._used = now = self._loop.time()
        if self._idle:
            connection, saved = self._idle.pop()
        elif self._held < self._size:
            connection, saved = await self._borrow_by(now, deadline)
        elif self._size and not alone and not self._closing:  # all busy: in line (_drain)
            return await self._in_line(_InLine(packed, count, self._loop.create_future()), deadline)
        else:  # no lane (a small pool), or a call that must go alone: the ordinary way
            async with asyncio.timeout_at(deadline):
                replies = await exchange(self.client, packed, count)
            return replies[0] if count == 1 else replies
        ends = deadline
        if saved is not None and (ends is None or now + saved < ends):
            ends = now + saved
        try:
            if ends is None:  # (nothing bounds it: a client made with socket_timeout=None)
                reply = await _round_trip(connection, packed, count)
            else:
                reply = await self._bounded(connection, packed, ends, count)
        except BaseException:
            if self._line and not self._closing:  # (calls wait: it reconnects for them)
                await connection.disconnect(nowait=True)
                await self._free(connection, saved)
            else:
                await self._return_connection(connection, saved)
            raise
        await self._free(connection, saved)
        return reply

    async def _borrow_by(self, now: float, deadline: float | None) -> tuple[Any, float | None]:
        """A connection borrowed for a call made at loop time ``now``, within half of the
        time it has (a blocking pool may make us wait). Failing that, nothing was sent:
        ``MaxConnectionsError`` (the caller falls back to asynclock's own pool with the
        rest), or the connection error marked as not sent (the server could not be
        reached, or refused us); the calls in line then fail too if no connection is left
        to serve them."""
        try:
            async with asyncio.timeout_at(None if deadline is None else (now + deadline) / 2):
                return await self._borrow()
        except (RedisConnectionError, OSError, TimeoutError) as exc:
            if self._held == self._borrowing:  # (no connection left to serve the line)
                self._fail_line(f"the lane could not connect: {exc!r}")
            if not isinstance(exc, TimeoutError) and not _exhausted(exc):
                mark_not_sent(exc)
                raise
            raise MaxConnectionsError(f"asynclock: no lane connection: {exc!r}") from exc

    async def _free(self, connection: Any, saved: float | None) -> None:
        """A connection done with its exchange: to the line's calls if any wait (a drain
        of its own), else idle (back to the pool if the event loop is shutting down)."""
        if self._closing:  # the event loop is shutting down: nothing stays borrowed
            self._fail_line("the event loop is shutting down")
            await self._return_connection(connection, saved)
            return
        home = self.home
        if home is not None and reaches_another(connection, home):
            await connection.disconnect(nowait=True)  # (the primary moved: see home)
        if self._line:
            drain = self._loop.create_task(self._drain(connection, saved), name="asynclock-drain")
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        else:
            self._idle.append((connection, saved))

    async def _in_line(self, waiting: _InLine, deadline: float | None) -> object:
        """Wait in line for ``waiting``'s reply, by ``deadline`` (loop time) if given."""
        self._line.append(waiting)
        try:
            async with asyncio.timeout_at(deadline):
                return await waiting.reply
        finally:
            if not waiting.reply.done():  # (left the line: not to be written)
                waiting.reply.cancel()
            elif not waiting.reply.cancelled():  # (an error we left before raising is
                waiting.reply.exception()  # retrieved: nothing logged as unretrieved)

    async def _drain(self, connection: Any, saved: float | None) -> None:
        """Write the calls in line on ``connection``, ``_BATCH`` at a time in one write,
        and hand each its reply, until the line is empty; then the connection is free.
        A batch that fails gives each of its calls the error; at a cancellation (the
        event loop shutting down) the calls left in line get a connection error too,
        with nothing sent, and the connection goes back to the pool."""
        try:
            while self._line:
                batch: list[_InLine] = []
                while self._line and len(batch) < _BATCH:
                    waiting = self._line.popleft()
                    if not waiting.reply.done():  # (else its caller left: not sent)
                        batch.append(waiting)
                if batch:
                    await self._write(connection, saved, batch)
        except BaseException:
            self._fail_line("the lane closed")
            await self._return_connection(connection, saved)
            raise
        await self._free(connection, saved)

    def _fail_line(self, why: str) -> None:
        """Give every call in line a connection error marked as not sent (none was
        written): no connection of the lane is left to serve them (``why``); their
        callers go the way they go when the lane cannot connect."""
        while self._line:
            waiting = self._line.popleft()
            if not waiting.reply.done():
                error = RedisConnectionError(f"asynclock: {why}")
                mark_not_sent(error)
                waiting.reply.set_exception(error)

    async def _write(self, connection: Any, saved: float | None, batch: list[_InLine]) -> None:
        """One exchange of ``batch``'s calls on ``connection`` (bounded by its socket
        timeout ``saved``); each call's reply, or the error that ended the exchange, is
        handed to its caller. Raises only a cancellation of the drain itself."""
        count = sum(waiting.count for waiting in batch)
        packed = b"".join(waiting.packed for waiting in batch)
        try:
            if saved is None:  # (nothing bounds it: a client made with socket_timeout=None)
                replies = await _round_trip(connection, packed, count)
            else:
                replies = await self._bounded(connection, packed, self._loop.time() + saved, count)
        except BaseException as exc:
            for waiting in batch:  # (first: nothing below may leave a caller waiting)
                if not waiting.reply.done():
                    waiting.reply.set_exception(_copy_of(exc))
            await connection.disconnect(nowait=True)  # (its replies are out of step)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        _hand_out(batch, [replies] if count == 1 else cast(list[object], replies))

    def idle_connections(self) -> list[Any]:
        """The connections the lane holds idle."""
        return [connection for connection, _ in self._idle]

    async def _bounded(self, connection: Any, packed: bytes, ends: float, count: int = 1) -> object:
        """:func:`_round_trip`, ended by loop time ``ends`` with ``TimeoutError`` as
        ``asyncio.timeout_at(ends)`` would end it, on the shared timer (see the note)."""
        task = asyncio.current_task()
        assert task is not None  # (asyncio runs every coroutine it awaits in a task)
        bound = _Bound(task, ends, task.cancelling())
        try:
            self._bounds.add(bound)
            timer = self._timer
            if timer is None or ends < timer.when():
                self._arm(ends)
            reply = await _round_trip(connection, packed, count)
        except BaseException as exc:
            # Our cancellation is taken back (as asyncio.timeout does); it becomes a
            # TimeoutError unless another cancellation of the task is pending too.
            if (
                bound.expired
                and task.uncancel() <= bound.cancelling  # (called whenever it expired)
                and isinstance(exc, asyncio.CancelledError)
            ):
                raise TimeoutError from exc
            raise
        finally:
            self._bounds.discard(bound)
        if bound.expired:  # expired as the reply came, and the exchange swallowed it
            task.uncancel()
        return reply

    def _arm(self, at: float) -> None:
        """(Re-)arm the shared timer for loop time ``at``."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(at, self._expire, at)

    def _expire(self, armed_for: float) -> None:
        """The shared timer: cancel every exchange whose bound has come (the loop may run
        a timer a hair before its time: ``armed_for`` counts as come), and re-arm for the
        earliest bound left."""
        self._timer = None
        due = max(armed_for, self._loop.time())
        try:
            for bound in tuple(self._bounds):
                if not bound.expired and bound.ends <= due:
                    bound.expired = True
                    bound.task.cancel()
        finally:  # (whatever happened above, no bound is left without the timer)
            left = [bound.ends for bound in self._bounds if not bound.expired]
            if left:
                self._arm(min(left))

    async def _borrow(self) -> tuple[Any, float | None]:
        self._held += 1  # counted before the await: a burst takes no more than _size
        self._borrowing += 1
        try:  # (a valkey-py pool's error made redis-py's as well: see _valkey)
            connection = await redis_errors(get_connection(self.client.connection_pool))
        except BaseException:
            self._held -= 1
            raise
        finally:
            self._borrowing -= 1
        timeout = connection.socket_timeout
        connection.socket_timeout = None  # our own bound replaces it (see the design note)
        if self._keeper is None:
            self._keeper = self._loop.create_task(self._keep(), name="asynclock-lane")
        return connection, (float(timeout) if timeout else None)

    async def _return_connection(self, connection: Any, saved_timeout: float | None) -> None:
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
                else:  # (every borrowed connection busy: look again a linger later)
                    await asyncio.sleep(_LINGER - idle_for if self._idle else _LINGER)
        except asyncio.CancelledError:
            self._closing = True  # calls still in flight give theirs back when done
            self._fail_line("the event loop is shutting down")
            raise
        finally:
            self._keeper = None
            await self.aclose()  # (it raises nothing: each give-back is guarded)

    async def aclose(self) -> None:
        """Give every idle connection back to the caller's pool (busy ones go back when
        their call fails, or later when the lane is found unused)."""
        if not self._bounds and self._timer is not None:  # (it refers to the lane)
            self._timer.cancel()
            self._timer = None
        while self._idle:
            connection, saved = self._idle.pop()
            with contextlib.suppress(Exception):
                await self._return_connection(connection, saved)


def reaches_another(connection: Any, address: tuple[str, int]) -> bool:
    """Whether ``connection`` is connected to a server other than ``address``."""
    if not getattr(connection, "is_connected", False):
        return False
    return (connection.host, int(connection.port)) != address


_NOT_SENT: Final = "_asynclock_not_sent"


def mark_not_sent(error: BaseException) -> None:
    """Mark ``error`` as raised before its command was sent (no connection could be had
    or made) or refused unrun (NOAUTH): the command did not run."""
    setattr(error, _NOT_SENT, True)


def not_sent(error: BaseException) -> bool:
    """Whether ``error`` was raised before its command was sent (see ``mark_not_sent``):
    its outcome is known, nothing ran."""
    return getattr(error, _NOT_SENT, False) is True


def _exhausted(error: BaseException) -> bool:
    """Whether a failure to get a connection from a pool means that the pool had none
    free (nothing was tried; another pool may do) rather than that the server could not
    be reached or refused the connection."""
    return exhausted(error) or "No connection available" in str(error)


@dataclass(eq=False, slots=True)
class _InLine:
    """A call waiting in a lane's line: its packed command(s), how many, and the future
    its reply (or list of replies) goes to."""

    packed: bytes
    count: int
    reply: asyncio.Future[object]


def _hand_out(batch: list[_InLine], replies: list[object]) -> None:
    """Give each call of ``batch`` its reply (or its list of ``count`` replies), in order,
    from ``replies``; a call whose caller left has its reply dropped."""
    start = 0
    for waiting in batch:
        if not waiting.reply.done():
            end = start + waiting.count
            waiting.reply.set_result(replies[start] if waiting.count == 1 else replies[start:end])
        start += waiting.count


def _copy_of(error: BaseException) -> BaseException:
    """The error that ended a batch's exchange, for one of its callers: a copy each (a
    raised exception takes the raiser's traceback), caused by the original; a
    cancellation of the drain (the loop shutting down) as a connection error."""
    if isinstance(error, asyncio.CancelledError):
        copied: BaseException = RedisConnectionError("asynclock: the lane closed mid-exchange")
    else:
        try:
            copied = copy.copy(error)
        except Exception:  # (an exception whose arguments cannot make it again)
            copied = RedisConnectionError(f"asynclock: {error!r}")
    copied.__cause__ = error
    return copied


@dataclass(eq=False, slots=True)  # (eq=False: hashed by identity, in Lane._bounds)
class _Bound:
    """A bounded exchange in flight: its task, its end (loop time), the task's count of
    cancellation requests before it began, and whether the shared timer cancelled it."""

    task: asyncio.Task[Any]
    ends: float
    cancelling: int
    expired: bool = False


async def _round_trip(connection: Any, packed: bytes, count: int = 1) -> object:
    try:
        await connection.send_packed_command(packed, check_health=False)
        if count == 1:
            try:
                return await connection.read_response()
            except _READ_ERRORS + valkey_errors() as error:
                return _error_reply(error)
        return await _replies(connection, count)
    except AttributeError as error:  # (a dropped connection, on some Pythons: _compat)
        raise as_connection_error(error)  # noqa: B904 (chained by as_connection_error)
    except valkey_errors() as error:  # (a valkey-py connection's: see _valkey)
        raise as_redis_error(error) from error.__cause__


_READ_ERRORS: Final[tuple[type[BaseException], ...]] = (ResponseError, AuthenticationError)


async def _replies(connection: Any, count: int) -> list[object]:
    """The next ``count`` replies read on ``connection``, an error reply (NOSCRIPT,
    READONLY, OOM, ...) in its place (see ``_error_reply``)."""
    replies: list[object] = []
    for _ in range(count):
        try:
            replies.append(await connection.read_response())
        except _READ_ERRORS + valkey_errors() as error:
            replies.append(_error_reply(error))
    return replies


def _error_reply(error: BaseException) -> object:
    """What reading a reply that raised ``error`` gives: an error reply in its place
    (a valkey-py one made redis-py's as well, see ``_valkey``); a NOAUTH, whose command
    did not run, is raised marked as not sent, anything else raised as it is."""
    translated = as_redis_error(error)
    if isinstance(translated, AuthenticationError):
        mark_not_sent(translated)
    elif isinstance(translated, ResponseError):
        return translated
    raise translated from error.__cause__


_NO_CONNECTION: Final[tuple[type[BaseException], ...]] = (RedisConnectionError, OSError)


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
    try:
        connection = await get_connection(pool)
    except _NO_CONNECTION + valkey_errors() as exc:
        error = as_max_connections_error(as_redis_error(exc))  # (redis-py < 8: _compat)
        mark_not_sent(error)
        raise error  # noqa: B904 (chained by as_max_connections_error)
    try:
        await connection.send_packed_command(packed)
        return await _replies(connection, count)
    except BaseException as exc:
        # At once: a graceful close could wait for the peer, and a renewal in flight must
        # end by its lease's deadline.
        await connection.disconnect(nowait=True)
        if isinstance(exc, AttributeError):  # (a dropped connection, on some Pythons)
            raise as_connection_error(exc)  # noqa: B904 (chained by as_connection_error)
        if isinstance(exc, valkey_errors()):  # (a valkey-py connection's: see _valkey)
            raise as_redis_error(exc) from exc.__cause__
        raise
    finally:
        await pool.release(connection)


def reply_text(value: object) -> str:
    """A reply's bytes (a client that does not decode) or str as str (UTF-8, an
    undecodable byte replaced)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
