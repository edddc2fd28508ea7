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

from ._scripts import RENEW

if TYPE_CHECKING:
    from ._lease import Lease

__all__ = ["Watchdog", "report_stall"]

log = logging.getLogger("asynclock")

_WINDOW: Final = 0.005  # seconds: renewals due this close together travel in one pipeline
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
    """Renews the leases of one client; see the module's design note."""

    def __init__(self, loop: asyncio.AbstractEventLoop, renewer: Callable[[], Redis]) -> None:
        self._loop = loop
        self._renewer = renewer
        self._due: list[tuple[float, int, Lease]] = []  # (due time, tie-breaker, lease)
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._batches: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> bool:
        """True while renewals are in flight (tasks that may still touch Redis)."""
        return bool(self._batches)

    def schedule(self, lease: Lease, due: float) -> None:
        """Renew ``lease`` at loop time ``due`` (replacing any earlier schedule of it)."""
        lease._due = due
        heapq.heappush(self._due, (due, next(self._order), lease))
        if due < self._timer_at:
            self._arm(due)

    def idle(self) -> None:
        """No lease of the client is held any more: forget every schedule."""
        self._due.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    async def aclose(self) -> None:
        """Stop renewing and wait for renewals in flight to be cancelled."""
        self.idle()
        batches = list(self._batches)
        for task in batches:
            task.cancel()
        for task in batches:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(at, self._fire), at

    def _fire(self) -> None:
        """The earliest renewal is due: send every renewal due within the window."""
        self._timer, self._timer_at = None, math.inf
        now = self._loop.time()
        batch: list[Lease] = []
        while self._due:
            due, _, lease = self._due[0]
            if lease._due != due or not lease._active:
                heapq.heappop(self._due)  # a stale entry, or an ended lease
                continue
            if due > now + _WINDOW or len(batch) >= _BATCH:
                self._arm(max(due, now))
                break
            heapq.heappop(self._due)
            lease._due = None
            report_stall(lease, due, now, "the renewal")
            batch.append(lease)
        if batch:
            task = self._loop.create_task(self._renew(batch), name="asynclock-renewal")
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _renew(self, batch: list[Lease]) -> None:
        """One attempt for each lease of ``batch``; never raises (failures are per lease)."""
        try:
            replies = await self._send(batch)
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
        for lease, (t_send, reply) in zip(batch, replies, strict=True):
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

    async def _send(self, batch: list[Lease]) -> list[tuple[float, object]]:
        """Send the batch's renewals; per lease: (t_send, reply or per-command error)."""
        loop = self._loop
        client = self._renewer()
        t_send = loop.time()
        earliest = min(lease.safe_until for lease in batch)
        limit = min(earliest - t_send, min(lease.ttl for lease in batch) / 3)
        async with asyncio.timeout(max(limit, 0.0)):
            if len(batch) == 1:
                lease = batch[0]
                return [(t_send, await RENEW(client, [lease.key], lease._renew_args))]
            pipe = client.pipeline(transaction=False)
            for lease in batch:
                pipe.evalsha(RENEW.sha, 1, lease.key, *lease._renew_args)
            replies: list[object] = await pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in replies):
                return [(t_send, r) for r in replies]
            # A restarted or failed-over server forgot the script: load it, send again.
            await client.script_load(RENEW.source)
            t_send = loop.time()
            pipe = client.pipeline(transaction=False)
            for lease in batch:
                pipe.evalsha(RENEW.sha, 1, lease.key, *lease._renew_args)
            replies = await pipe.execute(raise_on_error=False)
            return [(t_send, r) for r in replies]

    def _retry(self, lease: Lease, error: BaseException) -> None:
        """The outcome is unknown: SUSPECT, and try again shortly while time remains."""
        if not lease._active:
            return
        lease._suspect(error)
        backoff = lease._backoff or min(lease.ttl / 30, 0.05)
        lease._backoff = min(backoff * 2, lease.ttl / 10, 1.0)
        pause = backoff * random.uniform(0.5, 1.0)
        retry_at = min(self._loop.time() + pause, lease.safe_until)
        if retry_at < lease.safe_until:
            self.schedule(lease, retry_at)
