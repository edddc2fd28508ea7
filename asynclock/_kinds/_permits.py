"""Acquiring a permit of a semaphore (``lease(..., limit=N)``), the semaphore kind's way in.

Design note. A semaphore of N is N permit keys, ``<prefix>{name}:permit:<i>``; a permit
held is a lease of its own on one of them. So once acquired it is renewed, watched,
lost and released by the same code as a mutex's lease, through the seam of its kind
(PERMIT_RENEW and PERMIT_RELEASE, which keep the index below in step; the read-back of
its key is a mutex's); a permit whose holder dies expires on its own, by its TTL. Taking
one is here: the SEMAPHORE_ACQUIRE script finds a free slot in the semaphore's index
``<prefix>{name}:permits`` (a sorted set of slot -> the server time its key expires at,
0 once released) in O(log N) whatever the limit, takes its key, minting a fencing token
from the lock's one counter (so fencing tokens increase per name across all permits),
or answers when the first held permit expires. The attempt's void key records the slot
taken, so a retry of ours (and the undo) finds its permit without a scan.

Waiting reuses the client's waiting room (see ``_wakeup``): waiters of one client queue
in one line per semaphore, the head tries, subscribes to the lock's release channel after
a failed try and tries again, then sleeps until a release of any permit (published by
RELEASE, or by this client's own release) or until the first permit would expire. A head
that takes a permit wakes the next in line, which tries in its turn, since more permits
may be free. No permit is handed over: releasers let waiters of every client compete.

As for a mutex, an attempt whose outcome is unknown is sent once more with the same
token (the script finds its own permit), and one that stays unknown, or is cancelled,
is abandoned: SEMAPHORE_ABANDON deletes the permit if that attempt took one and leaves a
tombstone the script honours, so a late arrival cannot take a permit after all.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from typing import NamedTuple, cast

from redis.exceptions import MaxConnectionsError, ResponseError

from .._base._exceptions import AcquireTimeout, LimitConflict, LockBusy
from .._base._options import LeaseOptions
from .._base._shield import finish
from .._redis._lane import not_sent
from .._redis._scripts import (
    SEMAPHORE_ABANDON,
    SEMAPHORE_ACQUIRE,
    UNKNOWN_OUTCOME,
    Arg,
    run_idempotent,
)
from .._session._connections import Companion
from .._session._wakeup import Waiter
from ._bound import TIMEOUT_GRACE, held, no_answer, one_attempt, round_trip_end

__all__ = ["PermitAcquisition", "PermitGrant"]

log = logging.getLogger("asynclock")


class PermitGrant(NamedTuple):
    """A permit taken: our token, the fencing token minted, ``t_send``, and the permit's
    slot (which of the ``limit`` keys holds it)."""

    token: str
    fencing_token: int
    t_send: float
    slot: int


class PermitAcquisition:
    """One acquire of a permit: a single attempt, or the wait in line until one succeeds."""

    __slots__ = ("_companion", "_landed", "_loop", "_options", "_token")

    def __init__(self, companion: Companion, options: LeaseOptions) -> None:
        self._companion = companion
        self._options = options
        self._loop = companion.loop
        self._token = secrets.token_hex(16)
        self._landed = False  # an attempt of ours may have taken a permit, not handed out

    async def run(self) -> PermitGrant:
        """Take a permit, by one attempt or by waiting in line, as the options say.

        Raises:
            LockBusy: ``blocking=False`` and every permit is held.
            AcquireTimeout: ``blocking_timeout`` passed first.
            LimitConflict: the semaphore's permits are held with another ``limit``, or
                the name is held as a plain lock.
            redis.exceptions.RedisError: Redis refused or stayed unreachable.
        """
        options = self._options
        timeout = options.blocking_timeout
        deadline = None if timeout is None else self._loop.time() + timeout
        try:
            if one_attempt(options):
                for _ in range(2):  # (a second try when the reply came too late to use)
                    grant, pttl = await self._attempt(deadline)
                    if grant is None:
                        if options.blocking:  # (blocking_timeout=0)
                            raise held(options, pttl)
                        raise LockBusy(options.name, pttl / 1000 if pttl >= 0 else None)
                    if self._usable(grant.t_send):
                        return grant
                raise AcquireTimeout(options.name, 0.0, "Redis answered too late to use it")
            return await self._wait(deadline)
        except BaseException as exc:
            if self._landed:
                await self._abandon(TIMEOUT_GRACE if isinstance(exc, AcquireTimeout) else None)
            raise

    async def _wait(self, deadline: float | None) -> PermitGrant:
        options = self._options
        room = self._companion.room
        channel = options.channel
        waiter = room.join(channel, Waiter(self._token, options.ttl_ms, options.fence_ttl_ms))
        waiter.event.set()  # (tries at once on becoming head: leave() sets it then too)
        subscribed = False
        held_ms: int | None = None  # the last failed attempt's word on the holder
        try:
            while True:
                wait: float | None = None
                head = room.is_head(channel, waiter)
                if not head:
                    waiter.event.clear()  # (woken when it becomes head, by leave())
                elif waiter.event.is_set():
                    waiter.event.clear()
                    if deadline is not None and self._loop.time() >= deadline:
                        raise held(options, held_ms)  # (an attempt now would be too late)
                    grant, pttl = await self._attempt(deadline)
                    if grant is not None:
                        if self._usable(grant.t_send):
                            return grant
                        waiter.event.set()  # refresh our own permit at once
                        continue
                    held_ms = pttl
                    if not subscribed:
                        subscribed = True
                        if await room.subscribe(channel, deadline):
                            waiter.event.set()  # subscribed first, now try again
                            continue
                    wait = self._fallback(pttl)
                if deadline is not None:
                    left = deadline - self._loop.time()
                    if left <= 0:
                        raise held(options, held_ms)
                    wait = left if wait is None else min(wait, left)
                try:
                    async with asyncio.timeout(wait):
                        await waiter.event.wait()
                except TimeoutError:
                    waiter.event.set()  # the first permit expires about now: try again
        finally:
            # (the next in line tries now: another permit may be free, or, if we gave
            # up, the one we were woken for)
            room.leave(channel, waiter, wake_next=True)

    def _fallback(self, pttl_ms: int) -> float:
        """Seconds to wait before trying again without a notification."""
        if pttl_ms < 0:  # no permit expires (set from outside): look again after a ttl
            return self._options.ttl
        pttl = pttl_ms / 1000
        return pttl + random.uniform(0.001, 0.005 + pttl * 0.02)

    def _usable(self, t_send: float) -> bool:
        """Whether a permit taken by an attempt sent at ``t_send`` leaves at least a third
        of its TTL; if not, the caller tries again with the same token (which refreshes
        our own permit in one round trip)."""
        options = self._options
        left = options.safe_until(t_send) - self._loop.time()
        self._landed = left < options.ttl / 3
        if self._landed:
            log.warning(
                "acquire of a permit of %r took %.3fs of a %.3fs ttl; refreshing before use",
                options.name,
                self._loop.time() - t_send,
                options.ttl,
            )
        return not self._landed

    async def _attempt(self, deadline: float | None) -> tuple[PermitGrant | None, int]:
        """One try: (the grant, 0), or (None, pttl in ms of the first permit to expire).

        An unknown outcome is sent once more with the same token; one that stays unknown,
        the deadline passing or a cancellation abandon the attempt (see ``run``).

        Raises:
            AcquireTimeout: ``deadline`` passed before Redis answered.
            LimitConflict: see ``run``.
        """
        options = self._options
        base = options.base_key
        keys = [
            base + ":limit",
            options.fence_key,
            f"{base}:void:{self._token}",
            base,
            options.permits_key,
        ]
        args: list[Arg] = [self._token, options.ttl_ms, options.fence_ttl_ms, options.limit]
        task = asyncio.current_task()
        before = task.cancelling() if task is not None else 0
        client = self._companion.lane
        retried = False
        while True:
            t_send = self._loop.time()
            try:
                try:
                    reply = await SEMAPHORE_ACQUIRE(
                        client, keys, args, round_trip_end(deadline, t_send)
                    )
                except MaxConnectionsError:  # the caller's pool is full: nothing was sent
                    t_send = self._loop.time()
                    ends = round_trip_end(deadline, t_send)
                    reply = await SEMAPHORE_ACQUIRE(self._companion.overflow(), keys, args, ends)
                break
            except UNKNOWN_OUTCOME as exc:
                if not_sent(exc) and not retried:
                    raise  # (never reached Redis: nothing to undo)
                self._landed = True  # (it may have: run() undoes it)
                if deadline is not None and self._loop.time() >= deadline:
                    raise no_answer(options) from exc
                if retried:
                    raise
                retried = True
            except ResponseError:
                raise  # the server refused the script: it wrote nothing
            except BaseException:
                self._landed = True
                raise
        status, value, *rest = cast(list[int | bytes], reply)
        status = int(status)
        if task is not None and task.cancelling() > before:  # (see _shield.cancel_dropped)
            self._landed = self._landed or status == 1
            raise asyncio.CancelledError
        if status == 1:
            self._landed = False
            return PermitGrant(self._token, int(value), t_send, int(rest[0])), 0
        self._landed = False
        if status == 0:
            return None, int(value)
        if status == -2:
            theirs = value.decode() if isinstance(value, bytes) else str(value)
            raise LimitConflict(options.name, f"held with limit={theirs}, not {options.limit}")
        if status == -3:
            raise LimitConflict(options.name, "held as a plain lock (limit=1)")
        raise RuntimeError("asynclock: an abandoned acquire attempt was answered")

    async def _abandon(self, limit: float | None = None) -> None:
        """Undo an attempt that may have taken a permit, and stop it from taking one
        later, within ``limit`` seconds (at most ``release_timeout``)."""
        options = self._options
        companion = self._companion
        keys = [f"{options.base_key}:void:{self._token}", options.permits_key, options.base_key]
        args: list[Arg] = [
            self._token,
            options.tombstone_ms,
            options.channel,
            companion.room.origin,
        ]
        bound = options.release_timeout if limit is None else min(limit, options.release_timeout)
        try:
            work = run_idempotent(SEMAPHORE_ABANDON, companion.lane, companion.overflow, keys, args)
            await finish(work, bound)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "could not undo an acquire of a permit of %r that may have "
                "landed (%r); if it did, the permit expires by its TTL",
                options.name,
                exc,
            )
        finally:
            self._landed = False
            companion.room.wake(options.channel)
