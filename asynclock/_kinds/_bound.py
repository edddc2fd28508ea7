"""How long an acquisition may take, and what its timeout says: one rule for every kind.

Design note. ``blocking_timeout`` becomes a deadline (loop time) when the acquisition
starts. Every kind applies it the same way:

- ``blocking_timeout=0`` is one attempt, as ``blocking=False`` is (no wait, no place in
  any line, no subscription): a free lock is taken, a held one raises ``AcquireTimeout``
  at once (``one_attempt``).
- An attempt is started only before the deadline, and its round trip ends at the
  deadline or ``ROUND_TRIP_FLOOR`` seconds after it was sent, whichever is later
  (``round_trip_end``): the last attempt before the deadline gets the time a round trip
  needs, so a busy lock is never reported as a silent server.
- Past the deadline the wait ends with an ``AcquireTimeout`` that says what the last
  reply said (``held``): the lock held and for how much longer its holder's lease runs;
  or, when the last round trip found no answer in time, that Redis did not answer
  (``no_answer``). Undoing an attempt still in flight may take ``TIMEOUT_GRACE`` more.
"""

from __future__ import annotations

from typing import Final

from .._base._exceptions import AcquireTimeout
from .._base._options import LeaseOptions

__all__ = [
    "ROUND_TRIP_FLOOR",
    "TIMEOUT_GRACE",
    "held",
    "no_answer",
    "one_attempt",
    "round_trip_end",
]

TIMEOUT_GRACE: Final = 0.5
"""Seconds past the end of an acquisition that undoing an attempt still in flight may take
(at most ``release_timeout``); past it, a key the attempt set expires by its TTL."""

ROUND_TRIP_FLOOR: Final = 0.25
"""The least time (seconds) an attempt's round trip is given, even when the deadline is
nearer: an attempt that cannot get it is not worth sending."""


def one_attempt(options: LeaseOptions) -> bool:
    """Whether the acquisition is a single attempt: ``blocking=False``, or
    ``blocking_timeout=0``."""
    return not options.blocking or options.blocking_timeout == 0


def round_trip_end(deadline: float | None, now: float) -> float | None:
    """The loop time by which an attempt sent at ``now`` must be answered (None: no bound
    but the client's own socket timeout)."""
    if deadline is None:
        return None
    return max(deadline, now + ROUND_TRIP_FLOOR)


def held(options: LeaseOptions, pttl_ms: int | None) -> AcquireTimeout:
    """The timeout of an acquisition whose last attempt found the lock taken;
    ``pttl_ms``: what that attempt said of the holder's time left (ms; -1 no expiry,
    None or 0 unknown)."""
    if options.limit > 1:
        what = f"all {options.limit} permits are held"
        whose = "the first of them ends"
    elif options.fair:
        what = "the lock is held, or others wait ahead in its queue"
        whose = "its holder's lease ends"
    else:
        what = "the lock is held" if not options.shared else "the lock is held exclusively"
        whose = "its holder's lease ends"
    if pttl_ms is not None and pttl_ms > 0:
        detail = f"{what} ({whose} in {pttl_ms / 1000:.3g}s unless renewed)"
    elif pttl_ms == -1:
        detail = f"{what} by a key without expiry (not written by asynclock?)"
    else:
        detail = what
    return AcquireTimeout(options.name, options.blocking_timeout or 0.0, detail)


def no_answer(options: LeaseOptions) -> AcquireTimeout:
    """The timeout of an acquisition whose last round trip got no answer in time."""
    return AcquireTimeout(options.name, options.blocking_timeout or 0.0, "Redis did not answer")


def slow(options: LeaseOptions) -> AcquireTimeout:
    """The timeout of an acquisition whose last grant came too late to use, past the
    deadline."""
    detail = "Redis is slow: the last grant came too late to use"
    return AcquireTimeout(options.name, options.blocking_timeout or 0.0, detail)
