"""Acquiring a lock: one attempt, or a wait in the local line until one succeeds.

Design note. An attempt is one round trip (the ACQUIRE script). Its outcome is unknown
after a connection error or timeout, so it is sent once more with the same token: if
the first landed, the retry finds our own key and answers with the same fencing token.
If the outcome stays unknown, or the caller is cancelled (even by a cancellation that
redis-py's internal ``wait_for`` swallowed), the attempt is abandoned before the error
propagates: the ABANDON script deletes the key if that attempt set it and leaves a
tombstone for its token, which the ACQUIRE script honours, so the cleanup is safe even
if it overtakes the attempt on the way to Redis.

A blocking acquire first tries at once when nobody of its client waits for the lock (no
line bookkeeping on the uncontended path); otherwise, or after that try failed, it queues
in the client's ``WaitingRoom`` (see ``_wakeup``): the head of the line tries, subscribes
to the release channel (and its client's grant channel for the lock) after a failed first
try and tries again (so no release slips between the two), then sleeps until woken by a
release, handed the lock by a releaser of its own client, granted it by a releaser of
another, or until the holder's key would expire (PTTL plus jitter). A failed try of a
blocking wait offers its token for such a grant; from then on, giving up means
withdrawing the offer (``_abandon``), since a grant may already have landed. A grant that
was published but never read (a broken subscription) is found by the next try: the key
then holds our own token.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from typing import Final, NamedTuple, cast

from redis.asyncio import Redis
from redis.exceptions import MaxConnectionsError, OutOfMemoryError, ResponseError

from .._base._exceptions import AcquireTimeout, LockBusy
from .._base._options import LeaseOptions
from .._base._shield import finish
from .._redis._lane import Lane, exchange, not_sent
from .._redis._scripts import ACQUIRE, ACQUIRE_JOB, UNKNOWN_OUTCOME, Arg
from .._session._connections import Companion
from .._session._wakeup import Waiter
from ._bound import TIMEOUT_GRACE, held, no_answer, one_attempt, round_trip_end

__all__ = [
    "HANDOFF_PATIENCE_MS",
    "Acquisition",
    "Grant",
    "Job",
    "JobConflict",
    "JobDone",
    "JobUnstored",
    "register_ms",
    "unregister",
]

log = logging.getLogger("asynclock")

HANDOFF_PATIENCE_MS: Final = 5
"""A releaser hands the lock within its own client's line until a waiter of another
client has been registered this long (ms); then it grants the lock to that client's
offered token, or lets every client compete (see HANDOFF)."""


GRANT_FRESH_MS: Final = 1000
"""How old (ms) another client's offer may be for a release to grant it the key (and at
most a third of its TTL); an older offer gets a plain release and a wake-up instead. This
bounds how long after a waiter's last attempt a grant can go to a waiter that died."""


def register_ms(ttl_ms: int) -> int:
    """How long (ms) a registration as waiting lasts unless refreshed: 2 x ttl + 1 s.

    A waiting head refreshes it by each failed attempt, and tries at least every half of
    that (``Acquisition._fallback``), so a live wait never lapses; a crashed one does.
    """
    return 2 * ttl_ms + 1000


class Grant(NamedTuple):
    """A successful acquire: our token, the fencing token minted, and ``t_send``;
    ``handed``: handed over by a releaser (the key holds ``<token>:<fence>`` alone)."""

    token: str
    fencing_token: int
    t_send: float
    handed: bool = False


class Job(NamedTuple):
    """What makes an acquisition a job of ``once()``: the key of its result hash and the
    caller's fingerprint digest ('' checks nothing)."""

    result_key: str
    fingerprint: str


class JobDone(Exception):
    """Raised by an attempt of a job that found its result stored: ``payload``."""

    def __init__(self, payload: object) -> None:
        super().__init__("the job's result is stored")
        self.payload = payload


class JobUnstored(JobDone):
    """Raised by an attempt of a job that ran but whose result could not be stored: the
    marker left instead says why (``payload``)."""


class JobConflict(Exception):
    """Raised by an attempt of a job that found another fingerprint: ``theirs``."""

    def __init__(self, theirs: object) -> None:
        super().__init__("the job runs, or ran, with another fingerprint")
        self.theirs = theirs


class Acquisition:
    """One acquire: a single attempt, or the wait in the local line until one succeeds."""

    __slots__ = ("_companion", "_job", "_landed", "_loop", "_options", "_token", "_waiter")

    def __init__(self, companion: Companion, options: LeaseOptions, job: Job | None = None) -> None:
        self._companion = companion
        self._options = options
        self._job = job
        self._loop = companion.loop
        self._token = secrets.token_hex(16)
        self._landed = False  # our key is (or may be) set but not handed out
        self._waiter: Waiter | None = None  # our place in the local line while waiting

    async def run(self) -> Grant:
        """Acquire, by one attempt or by waiting in line, as the options say.

        Raises:
            LockBusy: ``blocking=False`` and another lease holds the lock.
            AcquireTimeout: ``blocking_timeout`` passed (``blocking_timeout=0``: the one
                attempt found the lock held), or (one attempt) Redis answered so late,
                twice, that too little of the TTL was left to hand the lease out.
            redis.exceptions.RedisError: Redis refused or stayed unreachable.
        """
        options = self._options
        try:
            if not one_attempt(options):
                return await self._wait()
            # (blocking_timeout=0: a bound for the round trip, and a timeout if held)
            deadline = None if not options.blocking else self._loop.time()
            for _ in range(2):
                status, value, t_send = await self._attempt(deadline=deadline)
                if status != 1:
                    if options.blocking:
                        raise held(options, value)
                    raise LockBusy(options.name, value / 1000 if value >= 0 else None)
                if self._usable(t_send):
                    return Grant(self._token, value, t_send)
            raise AcquireTimeout(options.name, 0.0, "Redis answered too late to use the lease")
        except BaseException as exc:
            waiter = self._waiter
            offered = waiter is not None and (waiter.offered or waiter.exposed)
            try:
                # (a job's result or conflict answered our last attempt: nothing of
                # ours is in flight, and a grant to a withdrawn offer is given back by
                # the room; no tombstone is left beside the result)
                done = isinstance(exc, JobDone | JobConflict)
                if self._landed or (offered and not done):
                    # We hold (or may be handed) the key, never used. Past the caller's
                    # blocking_timeout, undoing it may take only a short grace more.
                    timed_out = isinstance(exc, AcquireTimeout)
                    await self._abandon(TIMEOUT_GRACE if timed_out else None)
            finally:
                self._companion.room.in_use.discard(self._token)
            raise

    async def _wait(self) -> Grant:
        options = self._options
        room = self._companion.room
        channel = options.channel
        timeout = options.blocking_timeout
        deadline = None if timeout is None else self._loop.time() + timeout
        failed_first: int | None = None  # the holder's pttl, after a failed first attempt
        held_ms: int | None = None  # the holder's pttl, as the last failed attempt saw it
        if not room.waiting(channel):
            # Nobody of this client waits for the lock: try at once, without a place in
            # the line (the uncontended case costs no line bookkeeping).
            while True:
                status, value, t_send = await self._attempt(
                    waiting=True, in_line=False, deadline=deadline
                )
                if status != 1:
                    failed_first = held_ms = value
                    break
                if self._usable(t_send):
                    return Grant(self._token, value, t_send)
                if deadline is not None and self._loop.time() >= deadline:
                    raise AcquireTimeout(options.name, timeout or 0.0, "Redis is slow")
        waiter = self._waiter = room.join(
            channel, Waiter(self._token, options.ttl_ms, options.fence_ttl_ms)
        )
        granted: Grant | None = None
        in_background = False  # (past blocking_timeout, or a job found done: see below)
        try:
            subscribed = False
            fallback: float | None = None
            while True:
                if waiter.grant is not None:  # a releaser in this client handed it to us
                    fence, t_send = waiter.grant
                    waiter.grant = None
                    waiter.offered = False  # the handoff is over (_landed covers the key)
                    if self._usable(t_send):
                        granted = Grant(self._token, fence, t_send, handed=True)
                        return granted
                    waiter.event.set()  # too late to use: refresh it with an attempt
                # (a waiter holding the key, granted too late to use, refreshes it even
                # if it is not the head: a grant by another client can reach any waiter
                # whose token was offered)
                head = room.is_head(channel, waiter) or self._landed
                if head and (waiter.event.is_set() or fallback == 0 or failed_first is not None):
                    waiter.event.clear()
                    if failed_first is not None:  # just tried, before joining the line
                        status, value, t_send = 0, failed_first, 0.0
                        failed_first = None
                    elif deadline is not None and self._loop.time() >= deadline:
                        raise held(options, held_ms)  # (an attempt now would be too late)
                    else:
                        status, value, t_send = await self._attempt(waiting=True, deadline=deadline)
                    if status == 1:
                        if self._usable(t_send):
                            waiter.offered = False
                            granted = Grant(self._token, value, t_send)
                            return granted
                        if deadline is not None and self._loop.time() >= deadline:
                            raise AcquireTimeout(options.name, timeout or 0.0, "Redis is slow")
                        waiter.event.set()  # try again at once: it refreshes our own key
                        continue
                    self._landed = False  # (a key granted too late to use is gone)
                    held_ms = value
                    if not subscribed:
                        subscribed = True
                        if await room.subscribe(channel, deadline):
                            waiter.event.set()  # subscribed first, now try again
                            continue
                    fallback = self._fallback(value)
                elif not head:
                    fallback = failed_first = None
                wait = fallback
                if deadline is not None:
                    left = deadline - self._loop.time()
                    if left <= 0:
                        raise held(options, held_ms)
                    wait = left if wait is None else min(wait, left)
                fallback = await _wait_event(waiter.event, wait)
        except (AcquireTimeout, JobDone, JobConflict):
            in_background = True
            raise
        finally:
            # Having just taken the lock, do not send the next in line to try in vain:
            # our release will wake it.
            room.leave(channel, waiter, wake_next=granted is None)
            if not room.waiting(channel) and room.registered(channel):
                # Our line is empty: drop our registration as waiting. After a handoff
                # (decided when it was sent), past blocking_timeout (Redis may not
                # answer), or for a job found done (its caller returns the result at
                # once), this goes on in the background.
                if granted is None and not in_background:
                    await unregister(self._companion, options)
                else:
                    room.in_background(unregister(self._companion, options))

    def _fallback(self, pttl_ms: int) -> float:
        """Seconds to wait before trying again without a notification."""
        if pttl_ms < 0:  # a key without expiry (set from outside): look again after a ttl
            return self._options.ttl
        pttl = pttl_ms / 1000
        wait = pttl + random.uniform(0.001, 0.005 + pttl * 0.02)
        return min(wait, register_ms(self._options.ttl_ms) / 2000)  # keep registered

    def _usable(self, t_send: float) -> bool:
        """Whether a successful attempt sent at ``t_send`` leaves enough validity to use.

        If the reply came so late that less than a third of the TTL is left, the lease is
        not handed out; the caller tries again with the same token, which refreshes our
        own key in one round trip (no release and re-acquire that would add load to a
        server that is already slow).
        """
        ttl = self._options.ttl
        left = self._options.safe_until(t_send) - self._loop.time()
        if left >= ttl / 3:
            self._landed = False
            return True
        self._landed = True
        log.warning(
            "acquire of %r took %.3fs of a %.3fs ttl; refreshing before use",
            self._options.name,
            self._loop.time() - t_send,
            ttl,
        )
        return False

    async def _attempt(
        self, *, waiting: bool = False, in_line: bool = True, deadline: float | None = None
    ) -> tuple[int, int, float]:
        """One acquire: (1, fencing token) or (0, holder's pttl in ms), and its t_send.
        ``waiting``: part of a blocking wait (``in_line``: from a place in the line);
        ``deadline``: the loop time by which the wait ends (``blocking_timeout``).

        A connection error or timeout leaves the outcome unknown, so the same script is
        sent once more with the same token: if the first landed, the retry finds our own
        key and answers with the same fencing token. If the outcome stays unknown, the
        deadline passes, or the caller is cancelled, the attempt is abandoned (see
        ``_abandon``) before raising. An error raised before anything was sent (the
        server could not be reached, or refused the connection) is raised as it is.

        Raises:
            AcquireTimeout: ``deadline`` passed before Redis answered.
        """
        options = self._options
        keys = options.acquire_keys(self._token)
        job = self._job
        script = ACQUIRE
        if job is not None:
            script = ACQUIRE_JOB
            keys.append(job.result_key)
        # A blocking wait registers this client as waiting (see HANDOFF), so releasers
        # in other clients let it have the lock after at most HANDOFF_PATIENCE_MS.
        room = self._companion.room
        channel = options.channel
        on_success = ""
        if waiting:
            if room.waiting(channel) > (1 if in_line else 0):  # others of ours wait too
                on_success = "keep"
            elif room.registered(channel):
                on_success = "drop"
        args: list[Arg] = [
            self._token,
            options.ttl_ms,
            options.fence_ttl_ms,
            room.origin if waiting else "",
            register_ms(options.ttl_ms),
            on_success,
            "",  # (our send time, when offering our token: see below)
        ]
        if job is not None:
            args.append(job.fingerprint)
        # (the waiter whose token a failed attempt offers: see below)
        offering = self._waiter if waiting and in_line else None
        if offering is not None and not (
            room.is_head(channel, offering) and room.listening(channel)
        ):
            offering = None
        task = asyncio.current_task()  # (once: on Python 3.11 each lookup costs ~0.3 µs)
        before = task.cancelling() if task is not None else 0
        client: Redis | Lane = self._companion.lane
        may_have_landed = False
        while True:
            t_send = self._loop.time()
            if offering is not None:
                # A failed attempt of the head of our line offers our token to other
                # clients' releasers (see HANDOFF), who may then grant us the key; its
                # lease counts from t_send. Only a listening head offers: a grant is read
                # from the subscription, and should its notification be missed anyway
                # (the subscription broke), the head's next attempt finds the key holding
                # its own token and takes it. (Concurrent first attempts, made before
                # joining the line, are not heads: the one that joins second would wait,
                # never trying, and the key granted to it with it.)
                offering.exposed = True
                room.in_use.add(self._token)  # (until it failed, or its lease ended)
                args[6] = repr(t_send)
            try:
                try:
                    reply = await script(client, keys, args, round_trip_end(deadline, t_send))
                except MaxConnectionsError:  # the caller's pool is full: nothing was sent
                    client = self._companion.overflow()
                    t_send = self._loop.time()  # (the offer keeps the earlier time)
                    ends = round_trip_end(deadline, t_send)
                    reply = await script(client, keys, args, ends)
                break
            except UNKNOWN_OUTCOME as exc:
                if not_sent(exc):  # this try never reached Redis (down, or refused us)
                    if may_have_landed:  # (an earlier one may have)
                        await self._abandon()
                    raise
                if deadline is not None and self._loop.time() >= deadline:
                    self._landed = True  # (it may have: run() undoes it)
                    raise no_answer(options) from exc
                if not may_have_landed:
                    may_have_landed = True
                    continue
                await self._abandon()
                raise
            except ResponseError as exc:
                if may_have_landed:
                    await self._abandon()
                if isinstance(exc, OutOfMemoryError):
                    exc.add_note(
                        f"asynclock: cannot acquire {options.name!r}: Redis is out of memory "
                        "(maxmemory reached under noeviction); leases already held keep "
                        "renewing, new ones cannot be written"
                    )
                raise  # the server refused the script: it wrote nothing
            except BaseException:
                await self._abandon()
                raise
        raw_status, raw_value = cast(list[int | bytes], reply)  # (exactly two, or raise)
        status = int(raw_status)
        if status >= 2:  # (a job's: its result, another fingerprint's, or its marker)
            if task is not None and task.cancelling() > before:
                raise asyncio.CancelledError
            if status == 4:
                raise JobUnstored(raw_value)
            raise JobDone(raw_value) if status == 2 else JobConflict(raw_value)
        value = int(raw_value)
        if task is not None and task.cancelling() > before:  # (see cancel_dropped)
            if status == 1:
                await self._abandon()
            raise asyncio.CancelledError
        if status < 0:
            raise RuntimeError("asynclock: an abandoned acquire attempt was answered")
        if waiting:
            room.set_registered(channel, on_success == "keep" if status == 1 else True)
        return status, value, t_send

    async def _abandon(self, limit: float | None = None) -> None:
        """Undo an attempt that may have landed, and stop it from landing later, within
        ``limit`` seconds (at most ``release_timeout``)."""
        options = self._options
        companion = self._companion
        tombstone_ms = options.tombstone_ms
        bound = options.release_timeout if limit is None else min(limit, options.release_timeout)
        try:
            await companion.abandon(options.key, self._token, tombstone_ms, bound)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "could not undo an acquire attempt of %r that may have landed "
                "(%r); if it did, its key expires by its TTL",
                options.name,
                exc,
            )
        finally:
            self._landed = False
            companion.room.wake(options.channel)  # the key may be gone: let our line try


async def _wait_event(event: asyncio.Event, limit: float | None) -> float | None:
    """Wait for ``event`` up to ``limit`` seconds; returns 0 if it timed out, else None."""
    if limit is None:
        await event.wait()
        return None
    try:
        async with asyncio.timeout(limit):
            await event.wait()
    except TimeoutError:
        return 0
    return None


async def unregister(companion: Companion, options: LeaseOptions) -> None:
    """Our line for the lock is empty: drop our client's registration as a waiter, so
    that other clients' releasers hand the lock on within their own lines again without
    standing back for us (best effort; it expires by itself otherwise)."""
    command = companion.pack("HDEL", options.waiting_key, companion.room.origin)
    companion.room.set_registered(options.channel, False)
    try:
        await finish(exchange(companion.client, command, 1), min(1.0, options.release_timeout))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.debug("could not unregister a wait for %r: %r", options.name, exc)
