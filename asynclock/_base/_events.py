"""Lease lifecycle events for instrumentation (logging, metrics, a demo's timeline).

A hook is any callable taking one :class:`LeaseEvent`. It runs synchronously on the event
loop, so it must be quick; an exception from it is logged and never breaks locking. A
lease's own hook (``on_event``) runs first, then the process's hooks
(``asynclock.instrumentation.set_hooks``), each guarded alone.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EventHook", "LeaseEvent", "LeaseEventKind", "emit", "hooks", "set_hooks"]

log = logging.getLogger("asynclock")


class LeaseEventKind(enum.StrEnum):
    ACQUIRED = "acquired"
    ACQUIRE_FAILED = "acquire_failed"
    """Not acquired: ``detail`` is ``busy`` (``blocking=False``) or ``timeout``."""
    RENEWED = "renewed"
    RENEW_FAILED = "renew_failed"
    LOST = "lost"
    RELEASED = "released"
    RELEASE_FAILED = "release_failed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    """One thing that happened to a lease.

    ``at`` and ``safe_until`` are event-loop (monotonic) times in seconds. ``detail`` is a
    short human-readable note (the loss reason, the renewal error; ``busy`` or
    ``timeout`` for ``acquire_failed``). The figures metrics need, in seconds, where
    they apply (else None): ``waited`` for ``acquired`` and ``acquire_failed`` (from the
    call to the grant, or to giving up); ``held`` for ``released`` and ``lost`` (from the
    acquisition); ``latency`` (the renewal's round trip) and ``slack`` (the time that was
    left before the safe deadline when it was confirmed) for ``renewed``.
    """

    kind: LeaseEventKind
    name: str
    fencing_token: int
    at: float
    safe_until: float
    detail: str = ""
    waited: float | None = None
    held: float | None = None
    latency: float | None = None
    slack: float | None = None


EventHook = Callable[[LeaseEvent], object]


_HOOKS: list[tuple[EventHook, ...]] = [()]  # the process's hooks (one cell: swapped whole)


def hooks() -> tuple[EventHook, ...]:
    """The process's hooks, as set by :func:`set_hooks`."""
    return _HOOKS[0]


def set_hooks(new: tuple[EventHook, ...]) -> None:
    _HOOKS[0] = new


def emit(hook: EventHook | None, event: LeaseEvent) -> None:
    """Call ``hook``, then each of the process's hooks, with ``event``; log and swallow
    anything one raises (the others still run)."""
    if hook is not None:
        _call(hook, event)
    for each in _HOOKS[0]:
        _call(each, event)


def _call(hook: EventHook, event: LeaseEvent) -> None:
    try:
        hook(event)
    except Exception:
        log.exception("asynclock: event hook %r failed on %s", hook, event.kind)
