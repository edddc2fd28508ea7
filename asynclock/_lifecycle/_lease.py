"""The holder's handle of a lease: ``Lease``, and its ``guard()``.

Design note. ``Lease`` is what ``async with lease(...)`` yields and ``acquire()``
returns: the public API over the lease's tenure (``_tenure.Tenure``), which owns the
lease's state and the machinery that keeps and ends it. The handle holds nothing else,
so the library's modules work on the tenure and the holder sees only what is promised.
"""

from __future__ import annotations

from typing import Final, final

import anyio
import anyio.lowlevel

from .._base._exceptions import LossReason
from .._base._shield import ExcType, Traceback
from .._session._connections import HoldEntry
from ._tenure import ACTIVE, LeaseState, Tenure

__all__ = ["Lease", "LeaseGuard", "LeaseState"]


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
        """The Redis key holding the lease."""
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
        tenure = self._tenure
        left = f" {self.time_left:.1f}s left" if tenure.state in ACTIVE else ""
        lost = f" ({tenure.lost_reason})" if tenure.lost_reason else ""
        return f"<Lease {self.name!r} {tenure.state.name}{lost} fence={self.fencing_token}{left}>"


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
        scope = held.open_guard()
        self._scope = scope
        self._entry = held.companion.holding(held.options.base_key)
        return self._lease

    async def __aexit__(self, exc_type: ExcType, exc: BaseException | None, tb: Traceback) -> None:
        held = self._lease._tenure
        scope = self._scope
        if scope is None or not held.close_guard(scope):
            raise RuntimeError("a guard's __aexit__ without its __aenter__, or twice")
        held.companion.left(self._entry)
        overran = held.overran("a guard's exit")  # (not cancelling this guard's scope)
        lost_here = held.state is LeaseState.LOST and (scope.cancel_called or overran)
        swallowed = bool(scope.__exit__(exc_type, exc, tb))
        if lost_here:
            held.raise_loss(None if swallowed else exc, "a guard of it")
