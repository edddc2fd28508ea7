"""The lease: acquiring, holding (with its watchdog and deadline) and releasing one lock.

Design note. ``async with lease(...)`` acquires with one script (see ``_scripts``), then
enters a cancel scope around the body and starts the watchdog as a task of its own: the
body is not run inside an internal task group, so the user never sees an
``ExceptionGroup`` for a single failure, and the watchdog never raises (its failures
become ``LOST``). When the lease is lost the scope is cancelled, which cancels the body
and every task it started in task groups under it; ``__aexit__`` then raises ``LockLost``
unless the body raised an exception of its own, which propagates with a note.

The release on exit runs shielded from cancellation (inside the block's own scope, made a
shield, unless that scope cancelled the block) and bounded by ``release_timeout`` (see
``_shield.finish_idempotent``). With a waiter in this client's line it is a handoff to that
waiter (see ``_wakeup``); acquiring is in ``_acquire``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Final, final

import anyio
import anyio.lowlevel
from redis.asyncio import Redis
from redis.exceptions import MaxConnectionsError

from ._acquire import HANDOFF_PATIENCE_MS, Acquisition, fence_ttl_ms, register_ms, unregister
from ._connections import Companion, companion_for
from ._events import EventHook, LeaseEvent, LeaseEventKind, emit
from ._exceptions import LockLost, LossReason
from ._options import LeaseOptions
from ._scripts import (
    HANDOFF,
    RELEASE,
    RENEW,
    UNKNOWN_OUTCOME,
    Arg,
    Script,
    run_idempotent,
    unpack_arg,
)
from ._shield import cancel_dropped, cancelling, finish, finish_idempotent
from ._wakeup import Waiter
from ._watchdog import report_stall

__all__ = ["Lease", "LeaseContext", "LeaseState", "lease"]

log = logging.getLogger("asynclock")

_CLOSE_LIMIT: Final = 1.0  # seconds allowed to close idle side connections
_GET: Final = Script("get", "return redis.call('GET', KEYS[1])")


class LeaseState(enum.StrEnum):
    """Where a lease stands. ``LOST`` and ``RELEASED`` are terminal."""

    HELD = "held"
    """Held, and the last renewal was confirmed."""
    SUSPECT = "suspect"
    """A renewal is failing but the safe deadline has not passed; still held."""
    LOST = "lost"
    """Lost (see ``Lease.lost_reason``): the block was cancelled."""
    RELEASED = "released"
    """The block exited and the lease was given back."""

    def __str__(self) -> str:
        return self.value


_ACTIVE = (LeaseState.HELD, LeaseState.SUSPECT)


@final
class Lease:
    """One acquisition of one lock, yielded by ``async with lease(...)``.

    Sync attributes are local and free; methods that may touch Redis are ``async``.
    Times are seconds; ``safe_until`` is an event-loop (monotonic) time.
    """

    __slots__ = (
        "_backoff",
        "_closing",
        "_companion",
        "_due",
        "_hook",
        "_last_send",
        "_lost_cause",
        "_lost_reason",
        "_options",
        "_safe_until",
        "_scope",
        "_state",
        "_value",
        "fencing_token",
    )

    def __init__(
        self,
        options: LeaseOptions,
        companion: Companion,
        token: str,
        fencing_token: int,
        t_send: float,
        hook: EventHook | None,
    ) -> None:
        self._options = options
        self._companion = companion
        self._hook = hook
        self.fencing_token: Final = fencing_token
        """Strictly greater than every fencing token issued before for this name."""
        # The key's value, "<token>:<fencing token>" (the token is kept only in here).
        # Packed into the renew command's arguments at the first renewal (see _renew_tail).
        self._value: str | bytes = f"{token}:{fencing_token}"
        self._last_send = t_send
        self._safe_until = options.safe_until(t_send)
        self._state = LeaseState.HELD
        self._lost_reason: LossReason | None = None
        self._lost_cause: BaseException | None = None
        self._scope: anyio.CancelScope | None = None
        self._due: float | None = None  # when the watchdog renews next (loop time)
        self._backoff: float | None = None  # seconds before the next retry while SUSPECT
        self._closing = False

    # -- what the holder sees -----------------------------------------------------------

    @property
    def token(self) -> str:
        """The random token (128 bits, hex) identifying this lease in Redis."""
        return self._owner().partition(":")[0]

    @property
    def name(self) -> str:
        """The lock's name as given to :func:`lease`."""
        return self._options.name

    @property
    def key(self) -> str:
        """The Redis key holding the lease."""
        return self._options.key

    @property
    def ttl(self) -> float:
        """The lease's time to live in Redis, seconds; renewed every ttl/3."""
        return self._options.ttl

    @property
    def state(self) -> LeaseState:
        return self._state

    @property
    def lost_reason(self) -> LossReason | None:
        """Why the lease was lost, or None while it is not ``LOST``."""
        return self._lost_reason

    @property
    def safe_until(self) -> float:
        """Loop time (seconds) until which this process may believe it holds the lease."""
        return self._safe_until

    @property
    def time_left(self) -> float:
        """Seconds left before the safe deadline; 0.0 once lost, released or past it."""
        if self._state not in _ACTIVE:
            return 0.0
        return max(0.0, self._safe_until - self._companion.loop.time())

    async def is_held(self, verify: bool = False) -> bool:
        """Whether the lease is still held. Always a checkpoint (cancellation lands here).

        With ``verify=False`` the answer is local and free: False once the lease is lost,
        released, or past its safe deadline. With ``verify=True`` the token is also read
        back from Redis; finding another value there marks the lease ``LOST``
        (``not_owner``), which cancels the block (once the block has exited and the lease
        is being released, it only answers False).

        Raises:
            redis.exceptions.RedisError, TimeoutError: ``verify=True`` and Redis could
                not be asked before the safe deadline.
        """
        await anyio.lowlevel.checkpoint()
        if not self._held_locally():
            return False
        if not verify:
            return True
        before = cancelling()
        companion = self._companion
        async with asyncio.timeout(self.time_left):
            value = await run_idempotent(_GET, companion.client, companion.overflow, [self.key], [])
        if cancel_dropped(before):
            raise asyncio.CancelledError
        if _text(value) != self._owner():
            self._found_not_ours()
            return False
        return self._held_locally()

    async def extend(self) -> None:
        """Renew the lease now (the watchdog keeps renewing as well).

        Raises:
            LockLost: the lease is lost, or Redis answered that the key is no longer ours.
            redis.exceptions.RedisError, TimeoutError: the renewal could not be confirmed
                before the safe deadline; the lease is unchanged and the watchdog goes on.
        """
        if not self._held_locally():
            raise self._loss_error()
        before = cancelling()
        renewed = await self._renew_once(self.time_left)
        if cancel_dropped(before):
            raise asyncio.CancelledError
        if not renewed:
            raise self._loss_error()

    def __repr__(self) -> str:
        left = f" {self.time_left:.1f}s left" if self._state in _ACTIVE else ""
        lost = f" ({self._lost_reason})" if self._lost_reason else ""
        return f"<Lease {self.name!r} {self._state.name}{lost} fence={self.fencing_token}{left}>"

    # -- machinery (used by the context manager and the watchdog) ----------------------

    @property
    def _active(self) -> bool:
        return self._state in _ACTIVE and not self._closing

    @property
    def _state_active(self) -> bool:
        return self._state in _ACTIVE

    def _held_locally(self) -> bool:
        return self._state in _ACTIVE and self._companion.loop.time() < self._safe_until

    def _owner(self) -> str:
        """The key's value while we own it: ``<token>:<fencing token>``."""
        value = self._value
        if isinstance(value, bytes):
            return unpack_arg(value, 1).decode("ascii")
        return value

    def _loss_error(self) -> LockLost:
        reason = self._lost_reason or LossReason.DEADLINE
        return LockLost(self.name, reason)

    def _event(self, kind: LeaseEventKind, detail: str = "") -> None:
        if self._hook is not None:
            event = LeaseEvent(
                kind,
                self.name,
                self.fencing_token,
                self._companion.loop.time(),
                self._safe_until,
                detail,
            )
            emit(self._hook, event)

    def _start(self, scope: anyio.CancelScope) -> None:
        """Schedule the first renewal, which also watches the deadline (no await in
        between)."""
        self._scope = scope
        self._companion.watchdog.schedule(self, self._last_send + self.ttl / 3)

    def _on_deadline(self) -> None:
        """Called by the watchdog once ``safe_until`` has passed."""
        if self._state not in _ACTIVE or self._closing:
            return  # ended, or the block finished in time and is being released
        self._deadline_passed("the deadline")

    def _deadline_passed(self, what: str) -> None:
        """``safe_until`` has passed (noticed by ``what``): log a stall, lose the lease."""
        report_stall(self, self._safe_until, self._companion.loop.time(), what)
        self._lose(LossReason.DEADLINE, self._lost_cause)

    async def _renew_once(self, limit: float) -> bool:
        """One renewal attempt of at most ``limit`` seconds.

        Returns True if renewed, False if the lease is (now) lost. Raises the Redis or
        timeout error when the outcome is unknown.
        """
        client = self._companion.renewer()
        t_send = self._companion.loop.time()
        async with asyncio.timeout(limit):
            reply = await RENEW(client, [self.key], [self._owner(), self._options.ttl_ms])
        if reply != 1:
            self._found_not_ours()
            return False
        return self._confirm(t_send)

    def _confirm(self, t_send: float, safe_until: float | None = None) -> bool:
        """A renewal sent at ``t_send`` was confirmed (``safe_until`` is its new deadline,
        when the caller has computed it). Returns False if the lease is (now) lost."""
        if self._state not in _ACTIVE:
            return False
        if self._companion.loop.time() >= self._safe_until:
            self._lose(LossReason.DEADLINE, self._lost_cause)
            return False
        if safe_until is None:
            safe_until = self._options.safe_until(t_send)
        if safe_until > self._safe_until:
            self._safe_until = safe_until  # (the watchdog reads it when it looks next)
            self._last_send = t_send
        self._state = LeaseState.HELD
        self._lost_cause = None
        self._event(LeaseEventKind.RENEWED)
        return True

    def _renew_tail(self) -> bytes:
        """The arguments of this lease's RENEW call in RESP: key, value, ttl in ms (they
        never change). Packed at the first renewal; from then on they are the only copy
        of the value (see ``_owner``), which keeps a held lease small."""
        value = self._value
        if isinstance(value, bytes):
            return value
        options = self._options
        self._value = packed = self._companion.pack_args(options.key, value, options.ttl_ms)
        return packed

    def _found_not_ours(self) -> None:
        """A renewal or a read-back of ours found the key not ours: lost, unless the
        block has exited (the release in flight may have deleted it: no proof then)."""
        if not self._closing:
            self._lose(LossReason.NOT_OWNER)

    def _fail(self, cause: BaseException) -> None:
        self._lose(LossReason.WATCHDOG_FAILED, cause)  # (first: logging may raise)
        log.error("asynclock: the watchdog of %r failed", self.name, exc_info=cause)

    def _suspect(self, cause: BaseException) -> None:
        if self._state in _ACTIVE:
            self._state = LeaseState.SUSPECT
            self._lost_cause = cause  # kept as the cause should the deadline pass
            self._event(LeaseEventKind.RENEW_FAILED, repr(cause))

    def _lose(self, reason: LossReason, cause: BaseException | None = None) -> None:
        if self._state not in _ACTIVE:
            return
        self._state = LeaseState.LOST
        self._lost_reason = reason
        self._lost_cause = cause
        if self._scope is not None and not self._closing:
            self._scope.cancel()  # (once the block is exiting, nothing is left to cancel)
        log.warning("asynclock: lease %r lost: %s", self.name, reason.value)
        self._event(LeaseEventKind.LOST, reason.value)

    def _end(self) -> None:
        if self._state in _ACTIVE:
            self._state = LeaseState.RELEASED


class LeaseContext:
    """The async context manager returned by :func:`lease`; single use."""

    __slots__ = ("_hook", "_lease", "_options", "_redis")

    def __init__(self, redis: Redis, options: LeaseOptions, hook: EventHook | None) -> None:
        self._redis: Redis | None = redis  # None once entered
        self._options = options
        self._hook = hook
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        redis = self._redis
        if redis is None:
            raise RuntimeError("a lease() context manager can be entered only once")
        self._redis = None
        companion = companion_for(redis)
        companion.retain()
        companion.check_eviction_once()
        try:
            grant = await Acquisition(companion, self._options).run()
        except BaseException:
            await _unretain(companion)
            raise
        held = Lease(
            self._options, companion, grant.token, grant.fencing_token, grant.t_send, self._hook
        )
        self._lease = held
        scope = companion.cancel_scope()
        scope.__enter__()
        held._start(scope)
        held._event(LeaseEventKind.ACQUIRED)
        return held

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        held = self._lease
        if held is not None and held._closing:
            raise RuntimeError("this lease() context manager has already exited")
        if held is None or held._scope is None:
            raise RuntimeError("__aexit__ called without a successful __aenter__")
        scope = held._scope
        # A block that ran past its safe deadline, with no await for the deadline's timer
        # to land in (a blocking call, a CPU-bound stretch), did not finish in time.
        overran = held._state_active and held._companion.loop.time() >= held._safe_until
        held._closing = True  # from here on a loss can no longer cancel the block
        if overran:
            held._deadline_passed("the exit")
        # Usually the release runs inside the block's own scope, made a shield (it is the
        # innermost scope now): cheaper than a scope of its own. A scope that cancelled
        # the block (the lease was lost) is left first, since it would cancel the release.
        inside = not scope.cancel_called
        if inside:
            scope.shield = True
            swallowed = False
        else:
            swallowed = bool(scope.__exit__(exc_type, exc, tb))
        body_error = None if swallowed else exc
        contested = False
        try:
            try:
                contested = await self._give_back(held, shielded=inside)
            finally:
                if inside:
                    scope.__exit__(exc_type, exc, tb)  # never cancelled: swallows nothing
        finally:
            held._end()
            held._scope = None
            if contested:
                held._companion.room.wake_with_others(self._options.channel)
            else:
                held._companion.room.wake(self._options.channel)
            await _unretain(held._companion)
        if held.state is not LeaseState.LOST:
            return  # (our scope only cancels the body once the lease is lost)
        if body_error is None:
            cause = held._lost_cause
            raise LockLost(held.name, held.lost_reason or LossReason.DEADLINE) from cause
        if not isinstance(body_error, asyncio.CancelledError):
            body_error.add_note(
                f"asynclock: the lease {held.name!r} was lost ({held.lost_reason}) "
                "while this block ran"
            )
        return None

    async def _give_back(self, held: Lease, *, shielded: bool) -> bool:
        """Stop renewing and release the key (shielded; every exchange ends within
        release_timeout), or hand it to the next waiter of this client's line. Returns
        True when the release let waiters of other clients compete (see
        ``WaitingRoom.wake_with_others``).

        A renewal of this lease may still be in flight in a batch with other leases'; it
        is not waited for: the renew script is owner-checked, so landing after the
        release it changes nothing, and its reply is ignored once the lease is closing.
        """
        if held.lost_reason is LossReason.NOT_OWNER:
            return False  # the key is known not to be ours
        runs = 0
        # The next waiter in this client's line, if any, is handed the key directly.
        successor = held._companion.room.head(self._options.channel)
        if successor is not None and (successor.offered or successor.grant is not None):
            successor = None
        t_offer = held._companion.loop.time()
        channel = self._options.channel
        room = held._companion.room
        if successor is not None:
            successor.offered = True  # from now on the key may hold its token
            room.set_registered(channel, True)  # HANDOFF may register us; replies refine it
        limit = self._options.release_timeout
        deadline = t_offer + limit

        def release() -> Coroutine[Any, Any, _Outcome | None]:
            nonlocal runs
            runs += 1  # a second run (after a native cancellation) is not definitive
            return _release(
                held, first=runs == 1, successor=successor, t_offer=t_offer, deadline=deadline
            )

        try:
            released = await finish_idempotent(release, limit, shield=not shielded)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "asynclock: release of %r did not complete (%r); its key expires by its TTL",
                held.name,
                exc,
            )
            held._event(LeaseEventKind.RELEASE_FAILED, repr(exc))
            return False
        if released is _Outcome.NOT_OURS:
            if held.state in _ACTIVE:
                held._lose(LossReason.NOT_OWNER)  # the key vanished, the watchdog unaware
        elif released is not None:
            held._event(LeaseEventKind.RELEASED)
        if successor is not None and not room.waiting(channel) and room.registered(channel):
            room.in_background(unregister(held._companion, self._options))  # line emptied
        return released is _Outcome.CONTESTED


class _Outcome(enum.Enum):
    """What a release found."""

    RELEASED = "released"  # deleted, waiters notified
    CONTESTED = "contested"  # deleted, waiters notified, waiters of other clients registered
    HANDED = "handed"  # handed to the next waiter of this client
    NOT_OURS = "not ours"  # definitively not our key (see _release)


async def _release(
    held: Lease, *, first: bool, successor: Waiter | None, t_offer: float, deadline: float
) -> _Outcome | None:
    """Release ``held``. Returns NOT_OURS if Redis answered that the key was not ours
    while we still believed we held it (the work may have overlapped another holder); None
    if that answer proves nothing: a retry after a lost reply (the first attempt may have
    released the key), or a reply that arrived at or after the safe deadline. Redis ran
    the script at some moment before its reply arrived, and the key cannot expire by its
    TTL before ``safe_until``; so only a reply received before ``safe_until`` proves the
    key went early. One sent earlier but answered later may have found the key expired
    by its TTL after the block had finished in time, which is no loss.

    With a ``successor`` (the head of this client's line for the lock) the HANDOFF script
    gives it the key in the same round trip unless a waiter of another client is
    registered; the successor's lease counts from ``t_offer``, taken before the first send.
    Every exchange ends by ``deadline`` (loop time) or raises ``TimeoutError``.
    """
    companion = held._companion
    options = held._options
    script: Script
    if successor is None:
        script = RELEASE
        keys = [options.key]
        args: list[Arg] = [held._owner(), options.channel, companion.room.origin]
    else:
        script = HANDOFF
        keys = [
            options.key,
            options.fence_key,
            options.void_key(successor.token),
            options.waiting_key,
        ]
        args = [
            held._owner(),
            successor.token,
            successor.ttl_ms,
            fence_ttl_ms(successor.ttl_ms),
            options.channel,
            companion.room.origin,
            "keep" if companion.room.waiting(options.channel) > 1 else "drop",
            register_ms(successor.ttl_ms),
            HANDOFF_PATIENCE_MS,
        ]
    try:
        reply = await script(companion.lane, keys, args, deadline)
    except MaxConnectionsError:  # the caller's pool is full: nothing was sent
        async with asyncio.timeout_at(deadline):
            reply = await script(companion.overflow(), keys, args)
    except UNKNOWN_OUTCOME as exc:
        log.debug("asynclock: release of %r failed (%r), retrying", held.name, exc)
        first = False
        if successor is not None:  # the first run may have registered us as waiting
            companion.room.set_registered(options.channel, True)
        async with asyncio.timeout_at(deadline):
            reply = await script(companion.overflow(), keys, args)
    if successor is None:
        if reply == 1:
            return _Outcome.RELEASED
    else:
        status, fence = (int(x) for x in reply)  # type: ignore[attr-defined]
        room = companion.room
        if status == 3 and first:
            # The next holder took the key by an attempt of its own: ours was gone before
            # the release (its own reply tells it so; it is only woken here).
            successor.event.set()
            return _Outcome.NOT_OURS if _proves_loss(held, first) else None
        if status in (1, 3):  # (3 on a retry: our first run's handoff had landed)
            successor.grant = (fence, t_offer)  # the script set or renewed its expiry
            successor.event.set()
            room.set_registered(options.channel, args[6] == "keep")
            return _Outcome.HANDED
        successor.offered = False  # a definitive answer: the key was not handed over
        if status == 2:
            room.set_registered(options.channel, True)
            return _Outcome.CONTESTED
        if status == 4:  # the next holder gave up; released as RELEASE does
            room.set_registered(options.channel, args[6] == "keep")
            return _Outcome.RELEASED
    return _Outcome.NOT_OURS if _proves_loss(held, first) else None


def _proves_loss(held: Lease, first: bool) -> bool:
    """Whether a release's answer that the key was not ours, just received, proves the key
    went early: the first attempt's, received before ``safe_until`` (see ``_release``)."""
    return first and held._companion.loop.time() < held.safe_until


async def _unretain(companion: Companion) -> None:
    if companion.unretain():
        try:
            await finish(companion.aclose_if_idle(), _CLOSE_LIMIT)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("asynclock: closing side connections failed: %r", exc)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if value is None else str(value)


def lease(
    redis: Redis,
    name: str,
    *,
    ttl: float = 10.0,
    blocking: bool = True,
    blocking_timeout: float | None = None,
    release_timeout: float = 2.0,
    prefix: str = "asynclock:",
    on_event: EventHook | None = None,
) -> LeaseContext:
    """Hold the lock ``name`` for the duration of an ``async with`` block.

    Args:
        redis: a ``redis.asyncio.Redis`` client (``decode_responses`` either way).
        name: the lock's name; non-empty.
        ttl: seconds the key lives in Redis unless renewed; the watchdog renews it every
            ``ttl / 3``. At least 0.03.
        blocking: wait for the lock (True) or make one attempt (False).
        blocking_timeout: with ``blocking=True``, the most seconds to wait; None waits
            until acquired (the caller's own ``asyncio.timeout`` works too).
        release_timeout: seconds allowed for the release on exit; past it the key is left
            to expire by its TTL.
        prefix: prepended to every key and channel of the lock.
        on_event: called with a :class:`LeaseEvent` at each step of the lease's life.

    Raises (when the block is entered):
        LockBusy: ``blocking=False`` and another owner holds the lock.
        AcquireTimeout: ``blocking_timeout`` passed first (also a ``TimeoutError``).
        redis.exceptions.RedisError: Redis refused or could not be reached.

    Raises (when the block exits):
        LockLost: the lease was lost while the block ran (the block was cancelled). An
            exception raised by the block itself propagates instead, with a note.

    ``TypeError``/``ValueError`` for bad arguments are raised here, before any I/O.
    """
    options = LeaseOptions.cached(
        redis,
        name,
        ttl=ttl,
        blocking=blocking,
        blocking_timeout=blocking_timeout,
        release_timeout=release_timeout,
        prefix=prefix,
    )
    if on_event is not None and not callable(on_event):
        raise TypeError(f"on_event must be callable, not {type(on_event).__name__}")
    return LeaseContext(redis, options, on_event)
