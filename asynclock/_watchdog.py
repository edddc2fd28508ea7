"""The watchdog: renews every held lease of a client every ttl/3 until its block exits.

Design note. A lease is valid until ``safe_until = t_send + ttl - drift``, where ``t_send``
is the loop time just before the last *confirmed* acquire or renew command was sent:
Redis set the key's expiry after it received that command, so the key cannot expire
before ``t_send + ttl`` unless the server's clock runs fast, which ``drift`` allows for.

Renewing every ttl/3 (from the last confirmed ``t_send``) leaves two thirds of the TTL
to confirm a renewal: a slow or failed attempt is retried, with a short backoff, while
time remains. Each attempt has its own time limit (at most ttl/3, never past the
deadline), so one hung connection cannot hold a renewal past the deadline.

The watchdog does not declare the deadline loss itself: a loop timer armed at
``safe_until`` does (see ``Lease._arm``), so the body is cancelled at the deadline even
while a renewal command is still in flight. A reply of 0 means the key no longer holds
our token: lost at once, no retry can bring it back. Any other failure (timeout,
connection error, a failover's READONLY/LOADING) leaves the outcome unknown: the lease
turns SUSPECT and its deadline does not move.

One :class:`Watchdog` serves every lease of a client (per event loop): a single loop
timer fires when the earliest renewal is due, and every renewal due within a few
milliseconds travels in one pipeline on the client's dedicated renewal connection. Each lease
keeps its own schedule, deadline and outcome; coalescing only changes how the commands
travel, so ten thousand leases cost one task and a pipeline per tick, not ten thousand
tasks, and nothing runs between renewals. Each batch runs as a task of its own, so one
hung batch cannot delay the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from ._lane import exchange
from ._scripts import RENEW

if TYPE_CHECKING:
    from ._lease import Lease

__all__ = ["Watchdog", "report_stall"]

log = logging.getLogger("asynclock")

_WINDOW: Final = 0.05  # seconds (at most ttl/30): renewals due this close travel together
_BATCH: Final = 1000  # most renewals in one pipeline


def report_stall(lease: Lease, due: float, now: float, what: str) -> None:
    """Log a warning if a timer of ``lease`` ran much later than ``due`` (loop times).

    Lateness means the event loop (or the whole process) was stalled: a blocking call in
    a coroutine, a long CPU-bound stretch, a GC pause, SIGSTOP. Code that does not await
    cannot be cancelled, so the guarded work may have run past the lease's deadline.
    """
    late = now - due
    if late > max(0.1, lease.ttl / 6):
        log.warning(
            "asynclock: event loop stall of %.3fs detected (%s of lease %r ran late); "
            "nothing that does not await can be interrupted, so the guarded work may have "
            "overlapped another holder: rely on the fencing token",
            late,
            what,
            lease.name,
        )


class Watchdog:
    """Renews the leases of one client and watches their deadlines; see the design note."""

    def __init__(self, loop: asyncio.AbstractEventLoop, renewer: Callable[[], Redis]) -> None:
        self._loop = loop
        self._renewer = renewer
        self._order = itertools.count()
        self._due = _Timeline(loop, self._fire)  # when each lease renews next
        self._deadlines = _Timeline(loop, self._check_deadlines)  # each lease's safe_until
        self._batches: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> bool:
        """True while renewals are in flight (tasks that may still touch Redis)."""
        return bool(self._batches)

    def schedule(self, lease: Lease, due: float) -> None:
        """Renew ``lease`` at loop time ``due`` (replacing any earlier schedule of it)."""
        lease._due = due
        self._due.add(due, next(self._order), lease)

    def watch_deadline(self, lease: Lease) -> None:
        """Call ``lease._on_deadline()`` once its ``safe_until`` has passed.

        One entry per lease: when it comes up and the lease was renewed meanwhile, it is
        put back at the new ``safe_until``; a renewal costs no timer of its own.
        """
        self._deadlines.add(lease.safe_until, next(self._order), lease)

    def idle(self) -> None:
        """No lease of the client is held any more: forget every schedule."""
        self._due.clear()
        self._deadlines.clear()

    async def aclose(self) -> None:
        """Stop renewing and wait for renewals in flight to be cancelled."""
        self._due.cancel()
        self._deadlines.cancel()
        batches = list(self._batches)
        for task in batches:
            task.cancel()
        for task in batches:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _check_deadlines(self, now: float) -> None:
        timeline = self._deadlines
        while timeline.entries and timeline.entries[0][0] <= now:
            _, _, lease = heapq.heappop(timeline.entries)
            if lease._state_active:
                if lease.safe_until > now:
                    timeline.entries_push(lease.safe_until, next(self._order), lease)
                else:
                    lease._on_deadline()
        timeline.rearm(now)

    def _fire(self, now: float) -> None:
        """The earliest renewal is due: send every renewal due within the window."""
        timeline = self._due
        batch: list[Lease] = []
        window = 0.0
        while timeline.entries:
            due, _, lease = timeline.entries[0]
            if lease._due != due or not lease._active:
                heapq.heappop(timeline.entries)  # a stale entry, or an ended lease
                continue
            if not batch:
                window = min(_WINDOW, lease.ttl / 30)
            if due > now + window or len(batch) >= _BATCH:
                break
            heapq.heappop(timeline.entries)
            lease._due = None
            report_stall(lease, due, now, "the renewal")
            batch.append(lease)
        timeline.rearm(now)
        if batch:
            task = self._loop.create_task(self._renew(batch), name="asynclock-renewal")
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _renew(self, batch: list[Lease]) -> None:
        """One attempt for each lease of ``batch``; never raises (failures are per lease)."""
        try:
            t_send, replies = await self._send(batch)
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            for lease in batch:
                self._retry(lease, exc)
            return
        except BaseException as exc:  # a bug: never silence, never leave a lease unwatched
            for lease in batch:
                lease._fail(exc)
            return
        for lease, reply in zip(batch, replies, strict=True):
            if not lease._active:
                continue
            if isinstance(reply, BaseException):
                self._retry(lease, reply)
            elif reply == 1:
                if lease._confirm(t_send):
                    lease._backoff = None
                    self.schedule(lease, lease._last_send + lease.ttl / 3)
            else:
                lease._renewal_refused()

    async def _send(self, batch: list[Lease]) -> tuple[float, list[object]]:
        """Send the batch's renewals in one write; returns t_send and a reply (or the
        per-command error) per lease. Raises on a connection error or the time limit."""
        loop = self._loop
        t_send = loop.time()
        earliest = min(lease.safe_until for lease in batch)
        limit = min(earliest - t_send, min(lease.ttl for lease in batch) / 3)
        client = self._renewer()
        packed = b"".join(lease._renew_command() for lease in batch)
        async with asyncio.timeout(max(limit, 0.0)):
            replies = await exchange(client, packed, len(batch))
            if any(isinstance(r, NoScriptError) for r in replies):
                # A restarted or failed-over server forgot the script: load it, send again.
                await client.script_load(RENEW.source)
                t_send = loop.time()
                replies = await exchange(client, packed, len(batch))
        return t_send, replies

    def _retry(self, lease: Lease, error: BaseException) -> None:
        """The outcome is unknown: SUSPECT, and try again shortly while time remains."""
        if not lease._active:
            return
        lease._suspect(error)
        backoff = lease._backoff or min(lease.ttl / 30, 0.05)
        lease._backoff = min(backoff * 2, lease.ttl / 10, 1.0)
        pause = backoff * random.uniform(0.5, 1.0)
        retry_at = self._loop.time() + pause
        if retry_at < lease.safe_until:
            self.schedule(lease, retry_at)


class _Timeline:
    """A heap of (loop time, tie-breaker, lease) with one loop timer for its earliest entry."""

    __slots__ = ("_at", "_callback", "_loop", "_timer", "entries")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[float], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf
        self.entries: list[tuple[float, int, Lease]] = []

    def add(self, at: float, order: int, lease: Lease) -> None:
        heapq.heappush(self.entries, (at, order, lease))
        if at < self._at:
            self._arm(at)

    def entries_push(self, at: float, order: int, lease: Lease) -> None:
        """Add without arming (the callback re-arms when it is done)."""
        heapq.heappush(self.entries, (at, order, lease))

    def rearm(self, now: float) -> None:
        if self.entries:
            self._arm(max(self.entries[0][0], now))

    def clear(self) -> None:
        """Forget every entry. The timer stays armed (it finds nothing to do), so a
        client that takes short leases one after another arms no timer per lease."""
        self.entries.clear()

    def cancel(self) -> None:
        self.entries.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = None, math.inf

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = self._loop.call_at(at, self._run), at

    def _run(self) -> None:
        self._timer, self._at = None, math.inf
        self._callback(self._loop.time())
