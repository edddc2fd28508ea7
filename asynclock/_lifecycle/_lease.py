"""The lease: one acquisition of one lock, held (renewed by the watchdog, its deadline
watched) until it is given back.

Design note. A lease is two objects. :class:`Tenure` owns everything about one
acquisition: its state (``LeaseState``) and loss, its safe deadline, its key's value,
its companion (the client's side connections, see ``_session._connections``), the
watchdog's bookkeeping, the block's cancel scope or the open guards' scopes. The
watchdog (``_session._watchdog``, through its ``Watched`` view), the release
(``_release``), the ways in (``_context``, ``_redlock``, ``once()``) and the
replicas' confirmation work on it, through its public members. The holder sees
:class:`Lease`, a handle over it that offers the public API only (and :class:`LeaseGuard`).

A lease is held in one of two forms. ``async with lease(...)`` (see ``_context``) enters
a cancel scope around the body: when the lease is lost the scope is cancelled, which
cancels the body and every task it started in task groups under it. A lease from
``acquire()`` has no body: it is held without a task of the caller's until
``release()``, and work done under it is guarded stretch by stretch with
``async with lease.guard():``, a cancel scope of its own that a loss cancels the same
way. Either way the watchdog runs apart from the guarded code and never raises (its
failures become ``LOST``), so the user never sees an ``ExceptionGroup`` for a single
failure. What the tenure renews and releases (its keys and scripts) is its kind's
``Hold`` (``_kinds._hold``): it never branches on its kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Final, final

import anyio
import anyio.lowlevel
from redis.exceptions import AskError, MovedError

from .._base._events import EventHook, LeaseEventKind, hooks, report
from .._base._exceptions import LockLost, LossReason
from .._base._shield import ExcType, Traceback, cancel_dropped, cancelling
from .._kinds._hold import Hold
from .._redis._cluster import cluster_of, node_at
from .._redis._scripts import (
    SET_IF_EQUAL_HEAD,
    Arg,
    Script,
    run_idempotent,
    unpack_arg,
)
from .._session._connections import Companion, HoldEntry, companion_for
from .._session._watchdog import report_stall
from ._release import Wake, after_release, let_go, release_storing
from ._release import release as release_lease

__all__ = ["Lease", "LeaseGuard", "LeaseState", "Tenure", "report_failed"]

log = logging.getLogger("asynclock")


class LeaseState(enum.StrEnum):
    """Where a lease stands. ``LOST`` and ``RELEASED`` are terminal."""

    HELD = "held"
    """Held, and the last renewal was confirmed."""
    SUSPECT = "suspect"
    """A renewal is failing but the safe deadline has not passed; still held."""
    LOST = "lost"
    """Lost (see ``Lease.lost_reason``): the block, or the open guards, were cancelled."""
    RELEASED = "released"
    """Given back: the block exited, or ``release()`` was called."""


_ACTIVE: Final = (LeaseState.HELD, LeaseState.SUSPECT)


def report_failed(hook: EventHook | None, name: str, why: str, t_call: float) -> None:
    """The ``acquire_failed`` event (``why``: ``busy`` or ``timeout``) of an acquisition
    called at loop time ``t_call``: no lease was made (a Redlock's is the lock's whole)."""
    if hook is not None or hooks():
        now = asyncio.get_running_loop().time()
        report(hook, LeaseEventKind.ACQUIRE_FAILED, name, 0, now, 0.0, why, now - t_call)


@final
class Tenure:
    """One held lease: its state and its machinery (see the design note). Loop times and
    seconds; ``deadline`` is the lease's safe deadline (``Lease.safe_until``)."""

    __slots__ = (
        "_max_hold_timer",
        "acquired_at",
        "asking",
        "backoff",
        "by_command",
        "closing",
        "companion",
        "deadline",
        "due",
        "fencing_token",
        "guards",
        "hold",
        "hook",
        "keep_until",
        "last_send",
        "lost_cause",
        "lost_reason",
        "options",
        "released",
        "scope",
        "state",
        "value",
    )

    def __init__(
        self,
        hold: Hold,
        companion: Companion,
        token: str,
        fencing_token: int,
        t_send: float,
        hook: EventHook | None,
        suffix: str = "",
    ) -> None:
        options = hold.options
        self.options = options
        self.hold = hold  # (its keys and scripts: the lease never branches on its kind)
        self.companion = companion
        self.hook = hook
        self.fencing_token: Final = fencing_token
        """Strictly greater than every fencing token issued before for this name."""
        # The key's value, "<token>:<fencing token>" (the token is kept only in here).
        # Packed into the renew command's arguments at the first renewal (see renew_tail).
        # (``suffix``: a job's fingerprint, ":<digest>", kept in the value while it runs)
        self.value: str | bytes = f"{token}:{fencing_token}{suffix}"
        self.by_command = False  # (value packed for SET ... IFEQ: see renew_tail)
        self.last_send = t_send
        self.acquired_at = t_send  # (for the hold time events report)
        self.deadline = options.safe_until(t_send)
        # With hold_at_least, the loop time before which a release keeps the key.
        least = options.hold_at_least
        self.keep_until = t_send + least if least else None
        self.state = LeaseState.HELD  # (as it stands: what the holder sees is current_state)
        self.lost_reason: LossReason | None = None
        self.lost_cause: BaseException | None = None
        self.scope: anyio.CancelScope | None = None  # the block's, while it runs
        # The open guards' scopes for a lease of acquire() (None for a block's lease).
        self.guards: tuple[anyio.CancelScope, ...] | None = None
        self.due: float | None = None  # when the watchdog renews next (loop time)
        self.backoff: float | None = None  # seconds before the next retry while SUSPECT
        self.closing = False
        self.asking = False  # renewed after ASKING (its slot migrates here: see moved)
        self.released: asyncio.Event | None = None  # set once release() has finished
        self._max_hold_timer: asyncio.TimerHandle | None = None  # (max_hold: see start)

    # -- what the handle (``_lease.Lease``) asks ---------------------------------------

    @property
    def token(self) -> str:
        """The random token (128 bits, hex) identifying this lease in Redis."""
        return self.owner().partition(":")[0]

    def current_state(self) -> LeaseState:
        """``state``, but ``LOST`` as soon as the safe deadline has passed (before a
        stalled loop has run the deadline's timer)."""
        return LeaseState.LOST if self.past_deadline() else self.state

    @property
    def time_left(self) -> float:
        """Seconds left before the safe deadline; 0.0 once lost, released or past it."""
        if self.state not in _ACTIVE:
            return 0.0
        return max(0.0, self.deadline - self.companion.loop.time())

    async def is_held(self, verify: bool) -> bool:
        """``Lease.is_held``."""
        await anyio.lowlevel.checkpoint()
        if not self.held_locally():
            return False
        if not verify:
            return True
        before = cancelling()
        script, keys, args = self.hold.verify, self.hold.keys, [self.owner()]

        def read(companion: Companion) -> Awaitable[object]:
            if self.asking:  # (its slot is migrating to its node: see moved)
                return script(companion.client, keys, args, asking=True)
            return run_idempotent(script, companion.client, companion.overflow, keys, args)

        async with asyncio.timeout(self.time_left):
            ours = await self.on_its_node(read)
        if cancel_dropped(before):
            raise asyncio.CancelledError
        if ours != 1:
            self.found_not_ours()
            return False
        return self.held_locally()

    async def extend(self) -> None:
        """``Lease.extend``."""
        self.check_not_released()
        if not self.held_locally():
            raise self.loss_error()
        before = cancelling()
        try:
            renewed = await self.renew_once(self.time_left)
        except Exception:
            self.check_not_released()  # (the release may have closed its connection)
            raise
        if cancel_dropped(before):
            raise asyncio.CancelledError
        if not renewed:
            self.check_not_released()  # given back while the renewal was in flight
            raise self.loss_error()

    def check_not_released(self) -> None:
        if self.closing and self.state is not LeaseState.LOST:
            raise RuntimeError(f"the lease {self.options.name!r} has been released")

    async def give_back(self, store: tuple[list[str], list[Arg]] | None = None) -> bool | None:
        """``Lease.release()``. With ``store`` (a lease of ``once()``: its job's keys and
        the arguments after the lease's value), the job's result is stored in the same
        step (the STORE script) unless the lease was lost: returns True if stored, None
        if that is unknown (Redis did not answer: logged), False otherwise.

        Raises:
            LockLost: the lease was lost (the key was not ours: nothing was stored).
        """
        in_flight = sys.exc_info()[1]
        guards = self.guards
        if guards is None:
            raise RuntimeError(
                f"the lease {self.options.name!r} belongs to an `async with lease(...)` block, "
                "whose exit releases it"
            )
        if guards:
            raise RuntimeError(f"release() of {self.options.name!r} while a guard() of it is open")
        stored: bool | None = False
        released = self.released
        if released is not None:  # released, or being released, by an earlier call
            await released.wait()  # (bounded: every step of a release is)
        else:
            self.closing = True
            self.released = released = asyncio.Event()
            wake = Wake.OURS
            try:
                self.overran("the release")
                if store is None or self.state is LeaseState.LOST:  # (lost: nothing stored)
                    wake = await release_lease(self)
                else:
                    stored = await release_storing(self, *store)
            finally:
                try:
                    await after_release(self, wake)
                finally:
                    released.set()
        if self.state is LeaseState.LOST:
            self.raise_loss(in_flight, "the code that released it")
        return stored

    def __repr__(self) -> str:
        return f"<Tenure {self.options.name!r} {self.state.name} fence={self.fencing_token}>"

    # -- machinery (the context manager, the release, the watchdog) ---------------------

    @property
    def active(self) -> bool:
        return self.state in _ACTIVE and not self.closing

    def past_deadline(self) -> bool:
        """Still active, but the safe deadline has passed (its timer not run yet)."""
        return self.state in _ACTIVE and self.companion.loop.time() >= self.deadline

    def held_locally(self) -> bool:
        return self.state in _ACTIVE and self.companion.loop.time() < self.deadline

    def owner(self) -> str:
        """The key's value while we own it: ``<token>:<fencing token>``."""
        value = self.value
        if isinstance(value, bytes):  # (packed by renew_tail: after the keys)
            return unpack_arg(value, len(self.hold.keys)).decode("ascii")
        return value

    def loss_error(self) -> LockLost:
        return LockLost(self.options.name, self.lost_reason or LossReason.DEADLINE)

    def raise_loss(self, error: BaseException | None, what: str) -> None:
        """The lease was lost while ``what`` (a block, a guard) ran, and it ended with
        ``error`` (None: it finished, or our cancellation stopped it). Raise ``LockLost``,
        or let the code's own error propagate with a note (never masked)."""
        if error is None:
            raise self.loss_error() from self.lost_cause
        if isinstance(error, asyncio.CancelledError | LockLost):
            return  # (a LockLost in flight: a guard's, for this loss, said it already)
        said = f"asynclock: the lease {self.options.name!r} was lost ({self.lost_reason})"
        if not any(note.startswith(said) for note in getattr(error, "__notes__", ())):
            error.add_note(f"{said} while {what} ran")  # (once: a guard and a release)

    def event(
        self,
        kind: LeaseEventKind,
        detail: str = "",
        *,
        waited: float | None = None,
        latency: float | None = None,
        slack: float | None = None,
    ) -> None:
        if self.hook is not None or hooks():
            now = self.companion.loop.time()
            held = None
            if kind is LeaseEventKind.RELEASED or kind is LeaseEventKind.LOST:
                held = now - self.acquired_at
            report(
                self.hook,
                kind,
                self.options.name,
                self.fencing_token,
                now,
                self.deadline,
                detail,
                waited,
                held,
                latency,
                slack,
            )

    def start(self, scope: anyio.CancelScope | None, waited: float | None = None) -> None:
        """Schedule the first renewal, which also watches the deadline (no await in
        between). ``scope`` is the block's; None for a lease of ``acquire()``. ``waited``:
        the seconds the acquisition took, reported as ``acquired`` (None: a part of a
        Redlock, which reports its own)."""
        self.scope = scope
        if scope is None:
            self.guards = ()
        companion = self.companion
        companion.watchdog.schedule(self, self.last_send + self.options.ttl / 3)
        most = self.options.max_hold
        if most:  # (counted from the acquire's send, as the deadline is)
            at = self.last_send + most
            self._max_hold_timer = companion.loop.call_at(at, self._max_hold_reached)
        if waited is not None:
            self.event(LeaseEventKind.ACQUIRED, waited=waited)

    def _max_hold_reached(self) -> None:
        """``max_hold`` seconds since the acquisition: lost, though renewals succeed."""
        if self.active:
            self.lose(LossReason.MAX_HOLD)

    # -- asked by the watchdog (its view of a lease: ``_watchdog.Watched``) ---------------

    def watch(self, due: float | None) -> None:
        """The watchdog looks at this lease next at loop time ``due``; None while a
        renewal of it is in flight. (The slot is the watchdog's bookkeeping.)"""
        self.due = due

    def note_backoff(self, backoff: float) -> None:
        """The watchdog's pause (seconds) before the retry after next, while SUSPECT."""
        self.backoff = backoff

    def moved(self, error: AskError) -> bool:
        """A renewal was answered ``MOVED`` or ``ASK`` (``error``, a ``MovedError`` or an
        ``AskError``): on a Redis Cluster, the lock's slot is (being) migrated to the
        node the answer names. The lease moves to that node's companion (``follow``),
        and is renewed there at once. Returns False when it cannot move (not a cluster,
        being released, or the same node): the renewal then counts as failed."""
        if not self.active or not self.follow(error):
            return False
        self.companion.watchdog.schedule(self, self.companion.loop.time())
        return True

    def follow(self, error: AskError) -> bool:
        """Move the lease to the companion of the node that ``error`` (``MOVED`` or
        ``ASK``) names, its commands sent after ``ASKING`` while the slot is migrating
        (see ``_redis._cluster``); False if it cannot (not a cluster, or that node is its
        own already). The caller sends again, or schedules the next renewal."""
        old = self.companion
        cluster = cluster_of(old.client)
        if cluster is None:
            return False
        node = node_at(cluster, error.host, int(error.port))
        if node is None:
            return False
        new = companion_for(node)
        if new is old:
            return False
        new.retain()
        new.check_server_once()  # (a node of its own: whether it renews by command)
        token = self.token
        if token in old.room.in_use:  # (see WaitingRoom.in_use; discarded at release)
            old.room.in_use.discard(token)
            new.room.in_use.add(token)
        self.companion = new
        self.asking = not isinstance(error, MovedError)
        old.room.wake(self.options.channel)  # (its waiters here try, and move too)
        let_go(old)
        return True

    async def on_its_node(self, send: Callable[[Companion], Awaitable[object]]) -> object:
        """``send`` through the lease's companion; answered ``MOVED`` or ``ASK`` (its slot
        moved, or is migrating), sent again through the node's the answer names (see
        ``follow``), unless the lease cannot move there."""
        try:
            return await send(self.companion)
        except AskError as moved:  # (MOVED too: a MovedError is an AskError)
            if not self.follow(moved):
                raise
            return await send(self.companion)

    def on_deadline(self, cause: BaseException | None = None) -> None:
        """Called by the watchdog once ``safe_until`` has passed; ``cause``: the failure
        of the renewal that could not be retried in time, if that is how it came."""
        if not self.active:
            return  # ended, or the block finished in time and is being released
        if cause is not None:
            self.lost_cause = cause
        self._deadline_passed("the deadline")

    def _deadline_passed(self, what: str) -> None:
        """``safe_until`` has passed (noticed by ``what``): log a stall, lose the lease."""
        try:
            report_stall(self, self.deadline, self.companion.loop.time(), what)
        finally:
            self.lose(LossReason.DEADLINE, self.lost_cause)

    def overran(self, what: str) -> bool:
        """At an exit (``what``: a block's, a guard's, a release): the lease is lost if its
        deadline has passed without its timer running (the loop was blocked: a blocking
        call, CPU-bound code). Returns whether it was. Never raises, so the exit always
        finishes its cleanup (a log handler that fails is ignored here)."""
        if self.state not in _ACTIVE or self.companion.loop.time() < self.deadline:
            return False
        with contextlib.suppress(Exception):
            self._deadline_passed(what)
        return True

    async def renew_once(self, limit: float) -> bool:
        """One renewal attempt of at most ``limit`` seconds.

        Returns True if renewed, False if the lease is (now) lost. Raises the Redis or
        timeout error when the outcome is unknown.
        """
        t_send = self.companion.loop.time()
        keys = self.hold.keys
        args: list[Arg] = [self.owner(), self.options.ttl_ms]

        def renew(companion: Companion) -> Awaitable[object]:
            return self.renew_script(companion.renewer(), keys, args, asking=self.asking)

        async with asyncio.timeout(limit):
            reply = await self.on_its_node(renew)
        if reply != 1:
            self.found_not_ours()
            return False
        return self.confirm(t_send)

    def confirm(self, t_send: float, safe_until: float | None = None) -> bool:
        """A renewal sent at ``t_send`` was confirmed (``safe_until`` is its new deadline,
        when the caller has computed it). Returns False if the lease is (now) lost."""
        if self.state not in _ACTIVE or self.companion.loop.time() >= self.deadline:
            self.lose(LossReason.DEADLINE, self.lost_cause)  # (once ended, it changes nothing)
            return False
        if safe_until is None:
            safe_until = self.options.safe_until(t_send)
        before = self.deadline
        if safe_until > before:
            self.deadline = safe_until  # (the watchdog reads it when it looks next)
            self.last_send = t_send
        self.state = LeaseState.HELD
        self.lost_cause = None
        self.backoff = None
        if self.hook is not None or hooks():
            now = self.companion.loop.time()
            self.event(LeaseEventKind.RENEWED, latency=now - t_send, slack=before - now)
        return True

    # The renewal. (The watchdog renews any lease through these three; see
    # docs/architecture.md, the seam a kind implements: the kind's ``Hold`` says which
    # keys and which script.)

    @property
    def renew_script(self) -> Script:
        return self.hold.renew

    @property
    def renew_head(self) -> bytes:
        """The start of the renew command whose rest ``renew_tail`` packed last (call
        that first): the script's ``EVALSHA``, or ``SET`` (``SET_IF_EQUAL_HEAD``)."""
        return SET_IF_EQUAL_HEAD if self.by_command else self.hold.renew_head

    def renew_tail(self) -> bytes:
        """The keys and arguments of this lease's renew command in RESP: its hold's
        keys, its value, its ttl in ms; or, for a plain hold on a server that renews by
        command (``Companion.renews_by_command``), ``key value IFEQ value PX ttl``.
        Packed at the first renewal, again only when the server's way changes; from then
        on they are the only copy of the value (see ``owner``: the value follows the
        one key in both), which keeps a held lease small."""
        value = self.value
        by_command = self.hold.plain and self.companion.renews_by_command
        if isinstance(value, bytes):
            if by_command is self.by_command:
                return value
            value = self.owner()
        ttl_ms = self.options.ttl_ms
        if by_command:
            packed = self.companion.pack_args(self.options.key, value, "IFEQ", value, "PX", ttl_ms)
        else:
            packed = self.companion.pack_args(*self.hold.keys, value, ttl_ms)
        self.value, self.by_command = packed, by_command
        return packed

    def renew_by_script(self) -> None:
        """The server refused a renewal sent as ``SET ... IFEQ`` (see
        ``_redis._scripts.refused_as_command``): every lease of the client renews by
        its script from now on (``renew_tail`` packs it anew)."""
        self.companion.renews_by_command = False

    def found_not_ours(self) -> None:
        """A renewal or a read-back of ours found the key not ours: lost, unless the
        block has exited (the release in flight may have deleted it: no proof then)."""
        if not self.closing:
            self.lose(LossReason.NOT_OWNER)

    def fail(self, cause: BaseException) -> None:
        self.lose(LossReason.WATCHDOG_FAILED, cause)  # (first: logging may raise)
        log.error("the watchdog of %r failed", self.options.name, exc_info=cause)

    def suspect(self, cause: BaseException) -> None:
        if self.state in _ACTIVE:
            self.state = LeaseState.SUSPECT
            self.lost_cause = cause  # kept as the cause should the deadline pass
            self.event(LeaseEventKind.RENEW_FAILED, repr(cause))

    def lose(self, reason: LossReason, cause: BaseException | None = None) -> None:
        if self.state not in _ACTIVE:
            return
        self.state = LeaseState.LOST
        self.lost_reason = reason
        self.lost_cause = cause
        if self.scope is not None and not self.closing:
            self.scope.cancel()  # (once the block is exiting, nothing is left to cancel)
        for guard in self.guards or ():
            guard.cancel()
        log.warning("lease %r lost: %s", self.options.name, reason.value)
        self.event(LeaseEventKind.LOST, reason.value)

    def not_confirmed(self) -> None:
        """The acquisition did not count (too few replicas confirmed it): the release
        that follows deletes the key at once, ``hold_at_least`` set aside."""
        self.keep_until = None

    def end(self) -> None:
        """Given back (whatever the outcome): RELEASED unless lost; the block is gone."""
        if self.state in _ACTIVE:
            self.state = LeaseState.RELEASED
        self.scope = None
        if self._max_hold_timer is not None:  # (cancelling one that has run does nothing)
            self._max_hold_timer.cancel()

    def exit_block(self) -> anyio.CancelScope:
        """The ``async with`` block's exit begins: from here on a loss can no longer
        cancel the block. Returns the block's scope.

        Raises:
            RuntimeError: the block has already exited (one never entered has no lease).
        """
        if self.closing:
            raise RuntimeError("this lease() context manager has already exited")
        scope = self.scope
        assert scope is not None  # (a block's lease starts with it; end() follows closing)
        self.closing = True
        return scope


@final
class Lease:
    """One acquisition of one lock, yielded by ``async with lease(...)`` or returned by
    ``await acquire(...)``.

    Sync attributes are local and free; methods that may touch Redis are ``async``.
    Times are seconds; ``safe_until`` is an event-loop (monotonic) time.
    """

    __slots__ = ("_tenure", "fencing_token")

    def __init__(self, tenure: Tenure) -> None:
        self._tenure = tenure
        self.fencing_token: Final = tenure.fencing_token
        """Strictly greater than every fencing token issued before for this name."""

    @property
    def token(self) -> str:
        """The random token (128 bits, hex) identifying this lease in Redis."""
        return self._tenure.token

    @property
    def name(self) -> str:
        """The lock's name as given to :func:`lease`."""
        return self._tenure.options.name

    @property
    def key(self) -> str:
        """The Redis key holding the lease (a shared lease's: the lock's set of readers,
        which holds it as a member ``<token>:<fencing token>`` while others hold too; a
        reader alone is held by the lock's key itself)."""
        return self._tenure.options.key

    @property
    def ttl(self) -> float:
        """The lease's time to live in Redis, seconds; renewed every ttl/3."""
        return self._tenure.options.ttl

    @property
    def state(self) -> LeaseState:
        """Where the lease stands now: ``LOST`` as soon as the safe deadline has passed,
        even if a stalled loop has not yet run the deadline's timer (which then cancels
        the block)."""
        return self._tenure.current_state()

    @property
    def lost_reason(self) -> LossReason | None:
        """Why the lease was lost, or None while it is not ``LOST``."""
        tenure = self._tenure
        return LossReason.DEADLINE if tenure.past_deadline() else tenure.lost_reason

    @property
    def safe_until(self) -> float:
        """Loop time (seconds) until which this process may believe it holds the lease."""
        return self._tenure.deadline

    @property
    def time_left(self) -> float:
        """Seconds left before the safe deadline; 0.0 once lost, released or past it."""
        return self._tenure.time_left

    async def is_held(self, verify: bool = False) -> bool:
        """Whether the lease is still held. Always a checkpoint (cancellation lands here).

        With ``verify=False`` the answer is local and free: False once the lease is lost,
        released, or past its safe deadline. With ``verify=True`` the token is also read
        back from Redis; finding another value there marks the lease ``LOST``
        (``not_owner``), which cancels the block or the open guards (once the lease is
        being released, it only answers False).

        Raises:
            redis.exceptions.RedisError, TimeoutError: ``verify=True`` and Redis could
                not be asked before the safe deadline.
        """
        return await self._tenure.is_held(verify)

    async def extend(self) -> None:
        """Renew the lease now (the watchdog keeps renewing as well).

        Raises:
            LockLost: the lease is lost, or Redis answered that the key is no longer ours.
            RuntimeError: the lease has been (or is being) given back.
            redis.exceptions.RedisError, TimeoutError: the renewal could not be confirmed
                before the safe deadline; the lease is unchanged and the watchdog goes on.
        """
        await self._tenure.extend()

    async def release(self) -> None:
        """Give back a lease taken with :func:`acquire`: stop renewing it and delete its
        key if it is still ours (or hand it to the next waiter of this client). Runs
        shielded from cancellation; every exchange ends within ``release_timeout``
        seconds, past which the key is left to expire by its TTL (logged). Called again,
        it sends nothing: it waits for the first call to finish and answers as it did.

        Raises:
            LockLost: the lease was lost before it was given back: the work done under it
                may have overlapped another holder's (``reason`` says why). Called while
                an exception is handled or propagates (in an ``except`` or ``finally``
                clause), it adds a note to that exception instead, so the loss never
                masks it; check ``lost_reason`` there if the loss matters to you.
            RuntimeError: the lease is an ``async with lease(...)`` block's (its exit
                gives it back), or a ``guard()`` of it is still open.
        """
        await self._tenure.give_back()

    def guard(self) -> LeaseGuard:
        """``async with lease.guard():`` runs a stretch of work that stops when a lease of
        :func:`acquire` is lost: a cancel scope that the loss cancels, with the tasks
        started in task groups under it, before another holder could take the lock (as
        the body of ``async with lease(...)`` is). Several guards may be open at once, in
        different tasks; enter and exit each in one task.

        Raises (on entering):
            LockLost: the lease is already lost (released or not), or past its deadline.
            RuntimeError: the lease was given back, or is an ``async with`` block's.

        Raises (on exiting):
            LockLost: the lease was lost while the guard was open. An exception raised by
                the guarded code itself propagates instead, with a note.
        """
        return LeaseGuard(self)

    def __repr__(self) -> str:
        state, reason = self.state, self.lost_reason
        left = f" {self.time_left:.1f}s left" if state in _ACTIVE else ""
        lost = f" ({reason})" if reason else ""
        return f"<Lease {self.name!r} {state.name}{lost} fence={self.fencing_token}{left}>"


@final
class LeaseGuard:
    """The async context manager returned by :meth:`Lease.guard`; single use."""

    __slots__ = ("_entry", "_lease", "_scope")

    def __init__(self, lease: Lease) -> None:
        self._lease = lease
        self._scope: anyio.CancelScope | None = None
        self._entry: HoldEntry | None = None  # see Companion.holding

    async def __aenter__(self) -> Lease:
        held = self._lease._tenure
        if self._scope is not None:
            raise RuntimeError("a guard() can be entered only once")
        if held.guards is None:
            raise RuntimeError(
                "guard() is for leases of acquire(); the body of `async with lease(...)` "
                "is guarded already"
            )
        await anyio.lowlevel.checkpoint()
        held.check_not_released()
        if not held.held_locally():
            held.overran("a guard")  # (past its deadline, its timer not run yet)
            raise held.loss_error() from held.lost_cause
        self._scope = scope = held.companion.cancel_scope()
        scope.__enter__()  # (a loss cancels it, while it is one of the open guards)
        held.guards = (*held.guards, scope)
        self._entry = held.companion.holding(held.options.base_key)
        return self._lease

    async def __aexit__(self, exc_type: ExcType, exc: BaseException | None, tb: Traceback) -> None:
        held = self._lease._tenure
        scope, guards = self._scope, held.guards or ()
        if scope is None or scope not in guards:
            raise RuntimeError("a guard's __aexit__ without its __aenter__, or twice")
        held.guards = tuple(open_ for open_ in guards if open_ is not scope)
        held.companion.left(self._entry)
        overran = held.overran("a guard's exit")  # (not cancelling this guard's scope)
        lost_here = held.state is LeaseState.LOST and (scope.cancel_called or overran)
        swallowed = bool(scope.__exit__(exc_type, exc, tb))
        if lost_here:
            held.raise_loss(None if swallowed else exc, "a guard of it")
