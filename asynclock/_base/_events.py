"""Lease lifecycle events for instrumentation (logging, metrics, a demo's timeline).

A hook is any callable taking one :class:`LeaseEvent`. It runs synchronously on the event
loop, so it must be quick; an exception from it is logged and never breaks locking. A
lease's own hook (``on_event``) runs first, then the process's hooks
(``asynclock.instrumentation.set_hooks``), each guarded alone.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "EventHook",
    "LeaseEvent",
    "LeaseEventKind",
    "Sink",
    "Tallied",
    "alone",
    "drain",
    "hooks",
    "report",
    "set_hooks",
    "tallied",
]

log = logging.getLogger("asynclock")


class LeaseEventKind(enum.StrEnum):
    """What happened to a lease: the ``kind`` of a :class:`LeaseEvent` (a ``str``)."""

    ACQUIRED = "acquired"
    ACQUIRE_FAILED = "acquire_failed"
    """Not acquired: ``detail`` is ``busy`` (``blocking=False``) or ``timeout``."""
    RENEWED = "renewed"
    RENEW_FAILED = "renew_failed"
    LOST = "lost"
    RELEASED = "released"
    RELEASE_FAILED = "release_failed"


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
"""A function called with each :class:`LeaseEvent` (``on_event=``, ``set_hooks()``)."""

Tallied = tuple[LeaseEventKind, str, str, "float | None"]
"""An event as a metrics hook tallies it: (kind, lock name, detail, the event's figure:
``waited`` for ``acquired`` and ``acquire_failed``, ``slack`` for ``renewed``, ``held``
for ``released`` and ``lost``, else None)."""

Sink = Callable[[list[Tallied]], object]
"""A hook's batch form: it tallies a batch of events (see :func:`report`). asynclock's
own metrics hooks have one."""

_SINK = "_asynclock_sink"  # a hook's attribute: its Sink
_BATCH = 256  # events queued for the sinks before the loop hands them over itself


_HOOKS: list[tuple[EventHook, ...]] = [()]  # the process's hooks (one cell: swapped whole)
_PLAIN: list[tuple[EventHook, ...]] = [()]  # those of them called with a LeaseEvent
_SINKS: list[tuple[Sink, ...]] = [()]  # the fast forms of the others


def hooks() -> tuple[EventHook, ...]:
    """The process's hooks, as set by :func:`set_hooks`."""
    return _HOOKS[0]


def set_hooks(new: tuple[EventHook, ...]) -> None:
    drain()  # (what is queued goes to the sinks it was reported to)
    sinks = [getattr(hook, _SINK, None) for hook in new]
    _SINKS[0] = tuple(sink for sink in sinks if callable(sink))
    _PLAIN[0] = tuple(hook for hook, sink in zip(new, sinks, strict=True) if not callable(sink))
    _HOOKS[0] = new


@dataclass(frozen=True, slots=True)
class _Alone:
    """A lease's own hook that alone hears its events (see :func:`alone`)."""

    hook: EventHook

    def __call__(self, event: LeaseEvent) -> object:
        return self.hook(event)


def alone(hook: EventHook) -> EventHook:
    """``hook`` as a lease's own hook that the process's hooks do not share: for the
    parts of a lock that report as a whole (a Redlock's lease on each server), so
    metrics count the lock once."""
    return _Alone(hook)


def report(
    hook: EventHook | None,
    kind: LeaseEventKind,
    name: str,
    fencing_token: int,
    at: float,
    safe_until: float,
    detail: str = "",
    waited: float | None = None,
    held: float | None = None,
    latency: float | None = None,
    slack: float | None = None,
) -> None:
    """Report an event (the fields of a :class:`LeaseEvent`) to ``hook``, then to each of
    the process's hooks; log and swallow anything one raises (the others still run).

    Design note. With metrics hooks set, this runs at every acquisition and release, on
    the loop, where a cold path of a few microseconds is a few percent of an uncontended
    cycle (about 130 µs on loopback). So a hook with a batch form (:data:`Sink`, as
    asynclock's metrics hooks have) is not called here: the event's figures are queued
    once, for all of them, and handed over in batches (:func:`drain`), when 256 are
    queued or when the metrics are collected (the hooks drain first); a batch runs hot
    in the caches, several times faster per event than a call per event on the loop.
    No event object is made unless a hook that takes one is set. Sinks are called under
    a lock, so a hook's tallies change in one thread at a time, whichever loop or
    collecting thread drains."""
    if hook is not None or _PLAIN[0]:
        event = LeaseEvent(
            kind, name, fencing_token, at, safe_until, detail, waited, held, latency, slack
        )
        if hook is not None:
            _call(hook, event)
            if type(hook) is _Alone:
                return
        for each in _PLAIN[0]:
            _call(each, event)
    if _SINKS[0]:
        _PENDING.append((kind, name, detail, _figure(kind, waited, held, slack)))
        if len(_PENDING) >= _BATCH:
            drain()


def tallied(event: LeaseEvent) -> Tallied:
    """``event`` as a metrics hook tallies it (see :data:`Tallied`)."""
    kind = event.kind
    return (kind, event.name, event.detail, _figure(kind, event.waited, event.held, event.slack))


def _figure(
    kind: LeaseEventKind, waited: float | None, held: float | None, slack: float | None
) -> float | None:
    if kind is _ACQUIRED or kind is _ACQUIRE_FAILED:
        return waited
    return slack if kind is _RENEWED else held


_PENDING: deque[Tallied] = deque()  # events reported to the sinks, not handed over yet
_DRAINING = threading.Lock()


def drain() -> None:
    """Hand every queued event to the process's sinks (see :func:`report`); from any
    thread. A sink that raises is logged; the others still get the batch."""
    with _DRAINING:
        batch: list[Tallied] = []
        while _PENDING:  # (only drain takes from it, and under this lock)
            batch.append(_PENDING.popleft())
        if not batch:
            return
        for sink in _SINKS[0]:
            try:
                sink(batch)
            except Exception:
                log.exception("event hook %r failed on a batch of events", sink)


def _call(hook: EventHook, event: LeaseEvent) -> None:
    try:
        hook(event)
    except Exception:
        log.exception("event hook %r failed on %s", hook, event.kind)


_ACQUIRED = LeaseEventKind.ACQUIRED
_ACQUIRE_FAILED = LeaseEventKind.ACQUIRE_FAILED
_RENEWED = LeaseEventKind.RENEWED
