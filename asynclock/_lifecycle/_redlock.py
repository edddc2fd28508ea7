"""Redlock, experimental: one lock over N independent Redis servers, held on a majority.

Design note. ``lease([r1, r2, r3], name)`` takes a plain lease of the lock on
every server at once, one attempt each, bounded by a third of the TTL: a server that
does not answer by then counts as not granting (its attempt is cancelled, which undoes
it). The lock is held when a majority granted it and, counting from when the attempts
were sent, at least a third of the TTL is left (the validity: ``ttl`` minus the time
taken minus the drift, as each lease's ``safe_until`` already counts it). Otherwise
every lease taken is given back and, while ``blocking``, the attempt is made again after
a random pause (Redlock polls: there is no wake-up across servers).

Each lease taken is an ordinary lease of its server: renewed by its client's watchdog,
lost at its own safe deadline, given back on exit. The Redlock lease listens to their
losses: once fewer than a majority are left, it is lost, and the guarded block (or each
``guard()``) is cancelled. So its safe deadline is the majority-th latest of its leases'
deadlines, each of which comes before that server's key can expire.

Its fencing token is the largest of its leases' tokens. Each server's tokens rise, and
two majorities share a server, but the largest of tokens minted on different servers
rises only while those servers' clocks agree better than the time between two holders
(tokens are the server's clock in microseconds, or above): a weaker token than a single
server's. The known critique (Kleppmann, 2016) applies: a process paused past its
validity, or clocks that jump, break the mutual exclusion; fencing is what protects the
resource then.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Final

import anyio
from redis.asyncio import Redis

from .._base._events import EventHook, LeaseEvent, LeaseEventKind, alone, report
from .._base._exceptions import AcquireTimeout, LockBusy, LockLost, LossReason
from .._base._options import Client, LeaseOptions
from .._base._shield import ExcType, Traceback, finish
from .._session._connections import HoldEntry, companion_for
from ._lease import LeaseState, Tenure, report_failed

__all__ = ["RedlockContext", "RedlockLease", "Take", "acquire_redlock"]

Take = Callable[[Client, LeaseOptions, EventHook | None], Awaitable[Tenure]]
"""How a plain lease of one server is taken, not yet started (``_context.take``; handed
in by the ways in, which sit above this module)."""

_RETRY_PAUSE = 0.2  # seconds: the most a blocking Redlock waits between rounds


class RedlockLease:
    """A lock held on a majority of independent servers (see :func:`asynclock.lease`
    with a list of clients). Experimental. Times in seconds, loop time.

    ``fencing_token`` is the largest of the servers' tokens; read the limits in the
    README before relying on it. ``state`` is HELD while a majority of the servers'
    leases is held, SUSPECT while only a majority is left with some of them renewing
    late, LOST once fewer than a majority are left, RELEASED once given back.
    """

    def __init__(self, name: str, ttl: float, servers: int, hook: EventHook | None) -> None:
        self._hook = hook
        self.name: Final = name
        self.ttl: Final = ttl
        self.servers: Final = servers
        """How many servers the lock is taken over."""
        self._leases: list[Tenure] = []  # (once a majority granted it: see acquire_redlock)
        self._quorum = servers // 2 + 1  # (a majority)
        self._lost: LossReason | None = None
        self._released = False
        self._scopes: list[anyio.CancelScope] = []
        self._loop = asyncio.get_running_loop()
        self._acquired_at = self._loop.time()  # (set again once held: see acquire_redlock)

    @property
    def held_on(self) -> int:
        """On how many servers the lease is held now (at least a majority while held)."""
        return sum(lease.held_locally() for lease in self._leases)

    @property
    def fencing_token(self) -> int:
        """The largest of the servers' fencing tokens (see the class's limits)."""
        return max(lease.fencing_token for lease in self._leases)

    @property
    def state(self) -> LeaseState:
        if self._lost is not None:
            return LeaseState.LOST
        if self._released:
            return LeaseState.RELEASED
        healthy = sum(lease.current_state() is LeaseState.HELD for lease in self._leases)
        return LeaseState.HELD if healthy >= self._quorum else LeaseState.SUSPECT

    @property
    def lost_reason(self) -> LossReason | None:
        return self._lost

    @property
    def safe_until(self) -> float:
        """Loop time until which a majority of the servers' leases is known held."""
        deadlines = [lease.deadline for lease in self._leases if lease.held_locally()]
        if len(deadlines) < self._quorum:
            return 0.0
        return sorted(deadlines)[-self._quorum]  # (the majority-th latest)

    @property
    def time_left(self) -> float:
        """Seconds left before the safe deadline; 0.0 once lost or released."""
        if self._lost is not None or self._released:
            return 0.0
        return max(0.0, self.safe_until - self._loop.time())

    @property
    def key(self) -> str:
        """The Redis key holding the lease: the same name on every server."""
        return self._leases[0].options.key

    @property
    def tokens(self) -> tuple[str, ...]:
        """The random token of the lease on each server that granted it. There is no
        one ``token``: each server's lease was taken with its own (an attempt is a plain
        lease of that server), and each key holds its own."""
        return tuple(lease.token for lease in self._leases)

    async def is_held(self, verify: bool = False) -> bool:
        """Whether the lock is still held on a majority. Always a checkpoint.

        With ``verify=False`` the answer is local and free. With ``verify=True`` every
        server's lease is also read back from its server (at once); a server whose key
        holds another value marks its lease lost, and the lock is lost once fewer than a
        majority are left (cancelling the block or the open guards). A server that does
        not answer counts as not confirming; no error is raised for it.
        """
        await asyncio.sleep(0)
        if self.time_left <= 0 or not verify:
            return self.time_left > 0
        live = [lease for lease in self._leases if lease.held_locally()]
        answers = await asyncio.gather(
            *(lease.is_held(verify=True) for lease in live), return_exceptions=True
        )
        confirmed = sum(answer is True for answer in answers)
        return confirmed >= self._quorum and self.time_left > 0

    async def extend(self) -> None:
        """Renew the lease on every server now (the watchdogs keep renewing as well).

        Raises:
            LockLost: the lock is lost (fewer than a majority of its servers' leases are
                left, now or before).
            RuntimeError: the lock has been given back.
            redis.exceptions.RedisError, TimeoutError: fewer than a majority confirmed the
                renewal, the lock not lost: the first such error (the watchdogs go on).
        """
        if self._released:
            raise RuntimeError(f"the lease {self.name!r} has been released")
        if self._lost is not None:
            raise LockLost(self.name, self._lost)
        live = [lease for lease in self._leases if lease.held_locally()]
        answers = await asyncio.gather(*(lease.extend() for lease in live), return_exceptions=True)
        if self._lost is not None:
            raise LockLost(self.name, self._lost)
        if sum(answer is None for answer in answers) >= self._quorum:
            return
        for answer in answers:
            if isinstance(answer, Exception) and not isinstance(answer, LockLost):
                raise answer
        raise LockLost(self.name, LossReason.NOT_OWNER)  # (unreachable: lost above)

    def guard(self) -> _Guard:
        """``async with lock.guard():``: a stretch of work that the loss of the majority
        cancels (raising ``LockLost`` at its exit). For a lock of :func:`acquire`."""
        return _Guard(self)

    async def release(self) -> None:
        """Give the lock back on every server (each release shielded and bounded by
        ``release_timeout``). Raises ``LockLost`` if the majority was lost before."""
        if not self._released:
            if self._scopes:
                raise RuntimeError(f"release() of {self.name!r} while a guard() of it is open")
            await self._give_back()
        if self._lost is not None:
            raise LockLost(self.name, self._lost)

    async def _give_back(self) -> None:
        """Give the lock back on every server, then report ``released`` for the lock as a
        whole (its servers' leases report to it alone), unless it was lost."""
        self._released = True  # (first: leases given back no longer count as lost)
        await _release_all(self._leases)
        if self._lost is None:
            now = self._loop.time()
            released, token = LeaseEventKind.RELEASED, self.fencing_token
            report(self._hook, released, self.name, token, now, 0.0, held=now - self._acquired_at)

    def _on_event(self, event: LeaseEvent) -> None:
        """A server's lease was lost: the Redlock is lost once fewer than a majority
        are left, and every scope under it cancelled."""
        if event.kind is not LeaseEventKind.LOST or self._lost is not None or self._released:
            return
        if self.held_on < self._quorum:
            self._lost = LossReason(event.detail)  # (a lease's loss reports its reason)
            for scope in self._scopes:
                scope.cancel()
            lost, token, at = LeaseEventKind.LOST, self.fencing_token, event.at
            report(self._hook, lost, self.name, token, at, event.safe_until, self._lost.value)

    def __repr__(self) -> str:
        return (
            f"<RedlockLease {self.name!r} {self.state.name} on {self.held_on} of "
            f"{self.servers} servers>"
        )


class _Guard:
    def __init__(self, lock: RedlockLease) -> None:
        self._lock = lock
        self._scope = anyio.CancelScope()
        self._entries: list[tuple[Tenure, HoldEntry]] = []

    async def __aenter__(self) -> RedlockLease:
        lock = self._lock
        if lock._lost is not None:
            raise LockLost(lock.name, lock._lost)
        if lock._released:
            raise RuntimeError(f"the lock {lock.name!r} has been released")
        lock._scopes.append(self._scope)
        self._scope.__enter__()
        # Noted on every server's client: the current task is in a block or guard of this
        # lock (a nested attempt of it would wait for itself: see acquire_redlock).
        self._entries = [(one, one.companion.holding(one.options.base_key)) for one in lock._leases]
        return lock

    async def __aexit__(self, exc_type: ExcType, exc: BaseException | None, tb: Traceback) -> None:
        lock = self._lock
        for lease, entry in self._entries:
            lease.companion.left(entry)
        swallowed = self._scope.__exit__(exc_type, exc, tb)
        lock._scopes.remove(self._scope)
        if lock._lost is not None and (exc is None or swallowed):
            raise LockLost(lock.name, lock._lost)


class RedlockContext:
    """``async with lease([r1, r2, r3], name)``: the block runs while a majority holds
    the lock, and is cancelled once it does not (``LockLost`` at its exit)."""

    def __init__(self, acquire: Callable[[], Awaitable[RedlockLease]]) -> None:
        self._acquire = acquire  # (acquire_redlock, its arguments given)
        self._guard: _Guard | None = None  # (the block's, over the lock taken)

    async def __aenter__(self) -> RedlockLease:
        if self._guard is not None:
            raise RuntimeError("a lease() context manager can be entered only once")
        self._guard = (await self._acquire()).guard()
        return await self._guard.__aenter__()

    async def __aexit__(self, exc_type: ExcType, exc: BaseException | None, tb: Traceback) -> None:
        guard = self._guard
        assert guard is not None
        try:
            with anyio.CancelScope(shield=True):
                await guard._lock._give_back()
        finally:
            await guard.__aexit__(exc_type, exc, tb)


async def acquire_redlock(
    servers: Sequence[Client], options: LeaseOptions, hook: EventHook | None, take: Take
) -> RedlockLease:
    """Take the lock of ``options`` on a majority of ``servers``, each server's lease with
    ``take`` (one attempt per round: ``options`` made non-blocking). See the design note.

    Raises:
        LockBusy: not blocking, and fewer than a majority granted the lock.
        AcquireTimeout: blocking, and ``blocking_timeout`` passed first (each round of
            attempts ends by then, 50 ms at the least).
        redis.exceptions.RedisError: no server could be reached in a round (blocking or
            not: waiting would wait for nothing).
    """
    attempt = replace(options, blocking=False, blocking_timeout=None)
    loop = asyncio.get_running_loop()
    t_call = loop.time()
    timeout = options.blocking_timeout
    deadline = None if timeout is None else t_call + timeout
    for server in servers:  # (a task in a block or guard of it would wait for itself)
        if isinstance(server, Redis):
            companion_for(server).check_not_holding(options.base_key, options.name)
    while True:
        lock = RedlockLease(options.name, options.ttl, len(servers), hook)
        limit = options.ttl / 3
        if deadline is not None:
            limit = min(limit, max(deadline - loop.time(), _SHORTEST_ROUND))
        leases, errors = await _take_all(servers, attempt, lock, limit, take)
        if len(leases) >= lock._quorum:
            lock._leases = leases
            if lock.safe_until - loop.time() >= options.ttl / 3:
                now = lock._acquired_at = loop.time()
                acquired, token = LeaseEventKind.ACQUIRED, lock.fencing_token
                report(hook, acquired, lock.name, token, now, lock.safe_until, waited=now - t_call)
                return lock
        await _release_all(leases)
        if errors and len(errors) == len(servers):
            raise errors[0]
        if not options.blocking:
            report_failed(hook, options.name, "busy", t_call)
            raise LockBusy(options.name)
        pause = random.uniform(0, min(_RETRY_PAUSE, options.ttl / 3))
        if deadline is not None and deadline - loop.time() <= pause:
            report_failed(hook, options.name, "timeout", t_call)
            raise AcquireTimeout(options.name, timeout or 0.0, "no majority of the servers")
        await asyncio.sleep(pause)


_SHORTEST_ROUND = 0.05  # seconds: a round of attempts near the blocking_timeout


async def _take_all(
    servers: Sequence[Client],
    options: LeaseOptions,
    lock: RedlockLease,
    limit: float,
    take: Take,
) -> tuple[list[Tenure], list[BaseException]]:
    """One attempt on every server at once, for at most ``limit`` seconds: the leases
    taken (started, each reporting its losses to ``lock``) and the errors raised. An
    attempt still running at the limit is cancelled (which undoes it); one that took
    the lock all the same is given back when it ends, in the background. If the caller
    is cancelled, every attempt is cancelled and waited for, and every lease taken
    given back, before the cancellation propagates (shielded; each undo and release is
    bounded by ``release_timeout``): nothing is left on any server."""
    tasks = [
        asyncio.ensure_future(take(server, options, alone(lock._on_event))) for server in servers
    ]
    try:
        await asyncio.wait(tasks, timeout=limit)
    except BaseException:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await finish(_settle(tasks), 2 * options.release_timeout)
        raise
    leases: list[Tenure] = []
    errors: list[BaseException] = []
    for task in tasks:
        if not task.done():
            task.add_done_callback(_give_back_late)  # (cancelled, it may still take it)
            task.cancel()
            continue
        error = task.exception()
        if error is None:
            lease = task.result()
            lease.start(None)
            leases.append(lease)
        elif not isinstance(error, LockBusy):
            errors.append(error)
    return leases, errors


async def _settle(tasks: Sequence[asyncio.Future[Tenure]]) -> None:
    """Cancel the attempts still running, wait for every one to end (a cancelled
    attempt undoes itself), and give back the leases they took."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    taken = [task.result() for task in tasks if not task.cancelled() and not task.exception()]
    for lease in taken:
        lease.start(None)
    await _release_all(taken)


_LATE: set[asyncio.Task[None]] = set()


def _give_back_late(task: asyncio.Future[Tenure]) -> None:
    """An attempt cancelled at the limit (or with its caller) ended: if it took the lock
    all the same, give the lease back (in the background, by ``_settle``)."""
    late = asyncio.ensure_future(_settle([task]))
    _LATE.add(late)
    late.add_done_callback(_LATE.discard)


async def _release_all(leases: list[Tenure]) -> None:
    """Give back every lease at once; each release is shielded and bounded, and a loss
    it reports (``LockLost``, returned by the gathering) is the Redlock's business, not an
    error here."""
    await asyncio.gather(*(lease.give_back() for lease in leases), return_exceptions=True)
