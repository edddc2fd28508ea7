"""Lease lifecycle events for instrumentation (logging, metrics, a demo's timeline).

A hook is any callable taking one :class:`LeaseEvent`. It runs synchronously on the event
loop, so it must be quick; an exception from it is logged and never breaks locking.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EventHook", "LeaseEvent", "LeaseEventKind", "emit"]

log = logging.getLogger("asynclock")


class LeaseEventKind(enum.StrEnum):
    ACQUIRED = "acquired"
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
    short human-readable note (the loss reason, the renewal error).
    """

    kind: LeaseEventKind
    name: str
    fencing_token: int
    at: float
    safe_until: float
    detail: str = ""


EventHook = Callable[[LeaseEvent], object]


def emit(hook: EventHook | None, event: LeaseEvent) -> None:
    """Call ``hook`` with ``event``; log and swallow anything it raises."""
    if hook is None:
        return
    try:
        hook(event)
    except Exception:
        log.exception("asynclock: event hook %r failed on %s", hook, event.kind)
