"""Acquiring a shared (read) lease (``lease(..., shared=True)``), the shared kind's way in.

Design note. Any number of shared leases may hold a lock at once, and none while an
exclusive (plain) lease holds it. While shared leases hold it, the lock's key holds the
marker ``shared``, kept alive as long as the longest of them: a plain ``lease()`` finds
the lock taken, and waits (or registers as waiting) as it does for any holder. Each shared
lease has a lease key of its own (``<key>:reader:<token>``) that the watchdog renews with
the marker (SHARED_RENEW), that is lost and released as any lease's, and a member in the
lock's set of readers; the last one out deletes the marker and announces the release.

So that writers are not starved, a shared acquire waits while an exclusive waiter is
registered for the lock (a blocking ``lease()`` that found it taken registers, see
ACQUIRE): shared holders drain, the exclusive one gets in, and shared ones follow when it
releases. While a writer waits, shared waiters look again at least every second (its
registration says nothing when it gives up). Shared waiters listen to the lock's release
channel outside the client's line (all of them try at each release), and a shared lease
is never handed over.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from typing import cast

from redis.exceptions import MaxConnectionsError, ResponseError

from .._base._exceptions import AcquireTimeout, LockBusy
from .._base._options import LeaseOptions
from .._base._shield import finish
from .._redis._lane import not_sent
from .._redis._scripts import SHARED_ABANDON, SHARED_ACQUIRE, UNKNOWN_OUTCOME, Arg, run_idempotent
from .._session._connections import Companion
from ._bound import TIMEOUT_GRACE, held, no_answer, one_attempt, round_trip_end

__all__ = ["SharedAcquisition", "SharedGrant"]

log = logging.getLogger("asynclock")


class SharedGrant:
    """A shared lease taken: our token, the fencing token minted, and ``t_send``."""

    __slots__ = ("fencing_token", "t_send", "token")

    def __init__(self, token: str, fencing_token: int, t_send: float) -> None:
        self.token = token
        self.fencing_token = fencing_token
        self.t_send = t_send


class SharedAcquisition:
    """One acquire of a shared lease: a single attempt, or the wait until one succeeds."""

    __slots__ = ("_companion", "_landed", "_loop", "_options", "_token")

    def __init__(self, companion: Companion, options: LeaseOptions) -> None:
        self._companion = companion
        self._options = options
        self._loop = companion.loop
        self._token = secrets.token_hex(16)
        self._landed = False  # an attempt of ours may have taken a shared hold, unused

    @property
    def token(self) -> str:
        return self._token

    async def run(self) -> SharedGrant:
        """Take a shared lease, by one attempt or by waiting, as the options say.

        Raises:
            LockBusy: ``blocking=False`` and an exclusive lease holds the lock, or waits.
            AcquireTimeout: ``blocking_timeout`` passed first.
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
                        raise LockBusy(options.name, pttl / 1000 if pttl > 0 else None)
                    if self._usable(grant.t_send):
                        return grant
                raise AcquireTimeout(options.name, 0.0, "Redis answered too late to use it")
            return await self._wait(deadline)
        except BaseException as exc:
            if self._landed:
                await self._abandon(TIMEOUT_GRACE if isinstance(exc, AcquireTimeout) else None)
            raise

    async def _wait(self, deadline: float | None) -> SharedGrant:
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
                grant, pttl = await self._attempt(deadline)
                if grant is not None:
                    if self._usable(grant.t_send):
                        return grant
                    continue  # refresh our own hold at once
                held_ms = pttl
                if not subscribed:
                    subscribed = True
                    if await room.subscribe(channel, deadline):
                        continue  # subscribed first, now try again
                wait = options.ttl if pttl < 0 else pttl / 1000
                wait += random.uniform(0.001, 0.005 + wait * 0.02)
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
        """Whether a hold taken by an attempt sent at ``t_send`` leaves at least a third
        of its TTL; if not, the caller tries again (refreshing our own hold)."""
        options = self._options
        left = options.safe_until(t_send) - self._loop.time()
        self._landed = left < options.ttl / 3
        return not self._landed

    async def _attempt(self, deadline: float | None) -> tuple[SharedGrant | None, int]:
        """One try: (the grant, 0), or (None, ms to wait at most before trying again).

        An unknown outcome is sent once more with the same token; one that stays unknown,
        the deadline passing or a cancellation abandon the attempt (see ``run``).

        Raises:
            AcquireTimeout: ``deadline`` passed before Redis answered.
        """
        options = self._options
        base = options.base_key
        keys = [
            base,
            options.fence_key,
            f"{base}:void:{self._token}",
            options.waiting_key,
            options.readers_key,
            f"{base}:reader:{self._token}",
        ]
        args: list[Arg] = [self._token, options.ttl_ms, options.fence_ttl_ms]
        task = asyncio.current_task()
        before = task.cancelling() if task is not None else 0
        client = self._companion.lane
        retried = False
        while True:
            t_send = self._loop.time()
            try:
                try:
                    reply = await SHARED_ACQUIRE(
                        client, keys, args, round_trip_end(deadline, t_send)
                    )
                except MaxConnectionsError:  # the caller's pool is full: nothing was sent
                    t_send = self._loop.time()
                    ends = round_trip_end(deadline, t_send)
                    reply = await SHARED_ACQUIRE(self._companion.overflow(), keys, args, ends)
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
        status, value = (int(x) for x in cast(list[int], reply))
        if task is not None and task.cancelling() > before:  # (see _shield.cancel_dropped)
            self._landed = self._landed or status == 1
            raise asyncio.CancelledError
        self._landed = False
        if status == 1:
            return SharedGrant(self._token, value, t_send), 0
        if status == 0:
            return None, value
        raise RuntimeError("asynclock: an abandoned acquire attempt was answered")

    async def _abandon(self, limit: float | None = None) -> None:
        """Undo an attempt that may have taken a shared hold, and stop it from taking one
        later, within ``limit`` seconds (at most ``release_timeout``)."""
        options = self._options
        companion = self._companion
        base = options.base_key
        keys = [
            f"{base}:reader:{self._token}",
            base,
            options.readers_key,
            f"{base}:void:{self._token}",
        ]
        args: list[Arg] = [
            self._token,
            options.channel,
            companion.room.origin,
            options.tombstone_ms,
        ]
        bound = options.release_timeout if limit is None else min(limit, options.release_timeout)
        try:
            work = run_idempotent(SHARED_ABANDON, companion.lane, companion.overflow, keys, args)
            await finish(work, bound)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "could not undo a shared acquire of %r that may have landed "
                "(%r); if it did, it expires by its TTL",
                options.name,
                exc,
            )
        finally:
            self._landed = False
            companion.room.wake(options.channel)
