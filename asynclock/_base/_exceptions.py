"""The exception tree of asynclock.

Every error asynclock raises on purpose derives from :class:`LockError`, split by cause::

    LockError
    ├── LockLost               the lease was taken away while held (see ``reason``)
    ├── LockBusy               blocking=False and another holder has the lock
    ├── AcquireTimeout         blocking_timeout ran out (also a builtin ``TimeoutError``)
    ├── ReplicationTimeout     min_replicas: too few replicas confirmed the acquisition in
    │                          time; the lock was given back (also a ``TimeoutError``)
    ├── IdempotencyConflict    once(): the key's job runs, or ran, with another
    │                          fingerprint (also a builtin ``ValueError``)
    └── ResultNotStored        once(): the key's job ran, but its result could not be
                               stored; it is not run again (also a ``TypeError``)

Misuse of the API (bad arguments) raises the builtin ``TypeError`` / ``ValueError`` before
any I/O. Errors from Redis itself (``redis.exceptions.RedisError``) pass through unchanged
where they are the whole story, and are chained as ``__cause__`` where asynclock turns them
into one of its own.
"""

from __future__ import annotations

import enum

__all__ = [
    "AcquireTimeout",
    "IdempotencyConflict",
    "LimitConflict",
    "LockBusy",
    "LockError",
    "LockLost",
    "LossReason",
    "ReplicationTimeout",
    "ResultNotStored",
]


class LossReason(enum.StrEnum):
    """Why a lease was lost."""

    NOT_OWNER = "not_owner"
    """Redis answered that the key no longer holds this lease's token (deleted, expired,
    overwritten, flushed)."""

    DEADLINE = "deadline"
    """No renewal was confirmed before the lease's safe deadline; Redis may still hold the
    key, but this process can no longer prove it owns it."""

    WATCHDOG_FAILED = "watchdog_failed"
    """The renewal task died of an unexpected error; treated as a loss, never as silence."""

    FENCED = "fenced"
    """A fence (``asynclock.postgres.fence``) found a newer holder's fencing token
    recorded: this holder's effects must not be committed."""

    MAX_HOLD = "max_hold"
    """The lease was held for its ``max_hold`` seconds: taken away from a holder that is
    alive and renewing, so that no holder keeps the lock longer than that."""


class LockError(Exception):
    """Base class of every error asynclock raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        # Unpickled without ``__init__`` (whose arguments differ per class): the message
        # as it was, and the attributes, every one of them in ``__dict__``.
        return (_unpickled, (type(self), self.args), self.__dict__)


def _unpickled(cls: type[LockError], args: tuple[object, ...]) -> LockError:
    error = cls.__new__(cls, *args)
    # (set here: OSError.__new__, a TimeoutError's, leaves args to an __init__ of the
    # subclass's own, which unpickling does not call)
    error.args = args
    return error


class LockLost(LockError):
    """The lease was lost while it was held.

    Raised out of the ``async with lease(...)`` block, or out of ``lease.guard()``, after
    the code under it (and every task it started there) has been cancelled; by
    ``release()`` of a lease from ``acquire()`` lost before it was given back; and by
    ``extend()``. ``reason`` says why; the underlying error, if any, is chained as
    ``__cause__``.
    """

    def __init__(self, name: str, reason: LossReason, detail: str = "") -> None:
        self.name = name
        self.reason = reason
        self.detail = detail
        message = f"lease {name!r} lost: {reason.value}"
        if detail:
            message += f" ({detail})"
        super().__init__(message)


class LockBusy(LockError):
    """A non-blocking acquire found the lock held by another lease (of another process,
    or of this one: a lease of ``acquire()`` is held by no task)."""

    def __init__(self, name: str, pttl: float | None = None) -> None:
        self.name = name
        self.retry_after = pttl
        """Seconds until the current holder's key expires unless renewed, if known."""
        message = f"lock {name!r} is held by another lease"
        if pttl is not None:
            message += f" (its key expires in {pttl:.3f}s unless renewed)"
        super().__init__(message)


class AcquireTimeout(LockError, TimeoutError):
    """A blocking acquire did not get the lock within ``blocking_timeout`` seconds."""

    def __init__(self, name: str, timeout: float, detail: str = "") -> None:
        self.name = name
        self.timeout = timeout
        self.detail = detail
        message = f"could not acquire lock {name!r} within {timeout:g}s"
        if detail:
            message += f": {detail}"
        super().__init__(message)


class IdempotencyConflict(LockError, ValueError):
    """``once()`` was called for a key whose job runs, or ran, with another fingerprint:
    the same key for a different payload. ``func`` was not called."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(
            f"the job {key!r} runs, or ran, with another fingerprint: the same key was "
            "given for a different payload"
        )


class ResultNotStored(LockError, TypeError):
    """``once()``: the job ``key`` ran, but its result could not be stored (``cause``: the
    serializer refused it, could not read its own output back, or wrote bytes that a
    ``decode_responses=True`` client cannot decode). A marker that the job ran is kept
    instead of the result, for ``result_ttl`` seconds: the caller that ran the job and
    every later call for ``key`` raise this error, and ``func`` is not run again, until
    the marker expires or ``forget()`` deletes it (to run the job again on purpose)."""

    def __init__(self, key: str, cause: str) -> None:
        self.key = key
        self.cause = cause
        super().__init__(
            f"the job {key!r} ran, but its result could not be stored ({cause}); it is not "
            "run again: calls for this key raise this error until result_ttl expires or "
            "forget() deletes the marker"
        )


class LimitConflict(LockError, ValueError):
    """``lease(redis, name, limit=N)`` found the semaphore ``name`` held with another
    ``limit`` (or as a plain lock), or a plain, fair or shared lease found permits of
    ``name`` held: one name, one limit, or the limits would mix."""

    def __init__(self, name: str, detail: str) -> None:
        self.name = name
        self.detail = detail
        super().__init__(f"the semaphore {name!r} is {detail}")


class ReplicationTimeout(LockError, TimeoutError):
    """A lease asked for ``min_replicas`` was granted by the primary, but fewer replicas
    than that confirmed it (``WAIT``; ``WAITAOF`` with ``wait_aof``) within ``timeout``
    seconds: it was given back, and counts as not acquired. Retry later, or with fewer
    replicas; ``confirmed`` says how many did confirm (-1: the confirmation got no
    answer)."""

    def __init__(self, name: str, wanted: int, confirmed: int, timeout: float) -> None:
        self.name = name
        self.wanted = wanted
        self.confirmed = confirmed
        self.timeout = timeout
        got = "no answer" if confirmed < 0 else f"{confirmed} confirmed"
        super().__init__(
            f"lock {name!r}: {wanted} replica(s) must confirm the lease within {timeout:g}s, {got}"
        )
