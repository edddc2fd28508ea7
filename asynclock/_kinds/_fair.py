"""Acquiring a lock in arrival order (``lease(..., fair=True)``), the fair kind's way in.

Design note. A fair lock is the plain lock (same key, renewed, lost and released the same
way) with a queue in Redis beside it: FAIR_ACQUIRE enqueues a waiter at its first
attempt, with the server's time as its place, and lets only the first live waiter take
the lock once it is free. Every waiter says it is alive by each attempt, and tries at
least every ``FAIR_PATIENCE / 2`` seconds; a waiter that died is dropped from the head of
the queue once ``FAIR_PATIENCE`` has passed since its last attempt. So a dead waiter
delays the queue by at most ``FAIR_PATIENCE`` plus one retry period (3 s), and one that
gives up (cancelled, timed out) leaves at once (FAIR_LEAVE), waking the others.

Unlike the plain lock's line, where only the head of a client's line tries, every fair
waiter of a client tries on each release: its place in the queue is the server's, and a
client's own order would not match it. A release wakes them all (they listen to the
lock's channel in the client's waiting room, outside its line), and the lock is never
handed over within a client (``_release``). A plain ``lease()`` of the same name
does not queue: it takes the lock whenever it finds it free.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from typing import Final, cast

from redis.exceptions import MaxConnectionsError, ResponseError

from .._base._exceptions import AcquireTimeout, LockBusy
from .._base._options import LeaseOptions
from .._base._shield import finish
from .._redis._lane import not_sent
from .._redis._scripts import FAIR_ACQUIRE, FAIR_LEAVE, UNKNOWN_OUTCOME, Arg, run_idempotent
from .._session._connections import Companion
from ._bound import TIMEOUT_GRACE, held, no_answer, one_attempt, round_trip_end

__all__ = ["FAIR_PATIENCE", "FairAcquisition", "FairGrant"]

log = logging.getLogger("asynclock")

FAIR_PATIENCE: Final = 2.0
"""Seconds a fair waiter counts as waiting after its last attempt (it tries at least
twice as often): how long a waiter that died can hold up the queue."""


class FairGrant:
    """The lock taken: our token, the fencing token minted, and ``t_send``."""

    __slots__ = ("fencing_token", "t_send", "token")

    def __init__(self, token: str, fencing_token: int, t_send: float) -> None:
        self.token = token
        self.fencing_token = fencing_token
        self.t_send = t_send


class FairAcquisition:
    """One acquire of a fair lock: a single attempt, or the wait until our turn."""

    __slots__ = ("_companion", "_landed", "_loop", "_options", "_queued", "_token")

    def __init__(self, companion: Companion, options: LeaseOptions) -> None:
        self._companion = companion
        self._options = options
        self._loop = companion.loop
        self._token = secrets.token_hex(16)
        self._landed = False  # an attempt of ours may have taken the lock, not handed out
        self._queued = False  # an attempt of ours may have queued us

    async def run(self) -> FairGrant:
        """Take the lock, by one attempt or by waiting for our turn.

        Raises:
            LockBusy: ``blocking=False`` and the lock is held, or others wait for it.
            AcquireTimeout: ``blocking_timeout`` passed first.
            redis.exceptions.RedisError: Redis refused or stayed unreachable.
        """
        options = self._options
        timeout = options.blocking_timeout
        deadline = None if timeout is None else self._loop.time() + timeout
        try:
            if one_attempt(options):
                for _ in range(2):  # (a second try when the reply came too late to use)
                    grant, pttl = await self._attempt(deadline, wait=False)
                    if grant is None:
                        if options.blocking:  # (blocking_timeout=0)
                            raise held(options, pttl)
                        raise LockBusy(options.name, pttl / 1000 if pttl > 0 else None)
                    if self._usable(grant.t_send):
                        return grant
                raise AcquireTimeout(options.name, 0.0, "Redis answered too late to use it")
            return await self._wait(deadline)
        except BaseException as exc:
            if self._landed or self._queued:
                await self._leave(TIMEOUT_GRACE if isinstance(exc, AcquireTimeout) else None)
            raise

    async def _wait(self, deadline: float | None) -> FairGrant:
        options = self._options
        room = self._companion.room
        channel = options.channel
        event = asyncio.Event()
        room.listen(channel, event)
        subscribed = False
        held_ms: int | None = None  # the last failed attempt's word on the holder
        try:
            while True:
                event.clear()
                if deadline is not None and self._loop.time() >= deadline:
                    raise held(options, held_ms)  # (an attempt now would be too late)
                grant, pttl = await self._attempt(deadline, wait=True)
                if grant is not None:
                    if self._usable(grant.t_send):
                        return grant
                    continue  # refresh our own key at once
                held_ms = pttl
                if not subscribed:
                    subscribed = True
                    if await room.subscribe(channel, deadline):
                        continue  # subscribed first, now try again
                # (at least every FAIR_PATIENCE / 2: our place in the queue stays alive)
                wait = FAIR_PATIENCE / 2 * random.uniform(0.8, 1.0)
                if pttl > 0:
                    wait = min(wait, pttl / 1000 + random.uniform(0.001, 0.005))
                if deadline is not None:
                    left = deadline - self._loop.time()
                    if left <= 0:
                        raise held(options, held_ms)
                    wait = min(wait, left)
                try:
                    async with asyncio.timeout(wait):
                        await event.wait()
                except TimeoutError:
                    pass
        finally:
            room.unlisten(channel, event)

    def _usable(self, t_send: float) -> bool:
        """Whether a lock taken by an attempt sent at ``t_send`` leaves at least a third
        of its TTL; if not, the caller tries again (refreshing our own key)."""
        options = self._options
        left = options.safe_until(t_send) - self._loop.time()
        self._landed = left < options.ttl / 3
        return not self._landed

    async def _attempt(self, deadline: float | None, *, wait: bool) -> tuple[FairGrant | None, int]:
        """One try: (the grant, 0), or (None, the holder's pttl in ms; 0 when the lock is
        free but another waiter's turn). ``wait``: join (or stay in) the queue.

        An unknown outcome is sent once more with the same token; one that stays unknown,
        the deadline passing or a cancellation leave the queue (see ``run``).

        Raises:
            AcquireTimeout: ``deadline`` passed before Redis answered.
        """
        options = self._options
        base = options.base_key
        keys = [
            options.key,
            options.fence_key,
            f"{base}:void:{self._token}",
            base + ":queue",
            base + ":queue:alive",
        ]
        patience_ms = round(FAIR_PATIENCE * 1000)
        args: list[Arg] = [
            self._token,
            options.ttl_ms,
            options.fence_ttl_ms,
            patience_ms,
            "wait" if wait else "",
        ]
        task = asyncio.current_task()
        before = task.cancelling() if task is not None else 0
        client = self._companion.lane
        retried = False
        while True:
            t_send = self._loop.time()
            try:
                try:
                    reply = await FAIR_ACQUIRE(client, keys, args, round_trip_end(deadline, t_send))
                except MaxConnectionsError:  # the caller's pool is full: nothing was sent
                    t_send = self._loop.time()
                    ends = round_trip_end(deadline, t_send)
                    reply = await FAIR_ACQUIRE(self._companion.overflow(), keys, args, ends)
                break
            except UNKNOWN_OUTCOME as exc:
                if not_sent(exc) and not retried:
                    raise  # (never reached Redis: nothing to undo)
                self._landed = True  # (it may have: run() undoes it)
                self._queued = self._queued or wait
                if deadline is not None and self._loop.time() >= deadline:
                    raise no_answer(options) from exc
                if retried:
                    raise
                retried = True
            except ResponseError:
                raise  # the server refused the script: it wrote nothing
            except BaseException:
                self._landed = True
                self._queued = self._queued or wait
                raise
        status, value = (int(x) for x in cast(list[int], reply))
        if task is not None and task.cancelling() > before:  # (see _shield.cancel_dropped)
            self._landed = self._landed or status == 1
            self._queued = self._queued or wait
            raise asyncio.CancelledError
        self._landed = False
        if status == 1:
            self._queued = False  # (taking it took us out of the queue)
            return FairGrant(self._token, value, t_send), 0
        if status == 0:
            self._queued = wait
            return None, value
        raise RuntimeError("asynclock: an abandoned acquire attempt was answered")

    async def _leave(self, limit: float | None = None) -> None:
        """Leave the queue, and undo an attempt that may have taken the lock, within
        ``limit`` seconds (at most ``release_timeout``)."""
        options = self._options
        companion = self._companion
        base = options.base_key
        keys = [options.key, f"{base}:void:{self._token}", base + ":queue", base + ":queue:alive"]
        args: list[Arg] = [
            self._token,
            options.tombstone_ms,
            options.channel,
            companion.room.origin,
        ]
        bound = options.release_timeout if limit is None else min(limit, options.release_timeout)
        try:
            work = run_idempotent(FAIR_LEAVE, companion.lane, companion.overflow, keys, args)
            await finish(work, bound)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "could not leave the queue of the fair lock %r (%r); the place "
                "lapses within %gs, and a lock it took expires by its TTL",
                options.name,
                exc,
                FAIR_PATIENCE,
            )
        finally:
            self._landed = self._queued = False
            companion.room.wake(options.channel)  # (the others: the head may have changed)
