"""Recording who held which lock when, and checking the record for violations.

Part of the public :mod:`asynclock.testing` kit (import from there, not from here).

Recording::

    history = History("history.jsonl")          # or History() to keep it in memory only
    async with asynclock.lease(redis, "orders", on_event=history.on_event) as lock:
        with history.guard_lease(lock, holder="worker-1"):
            ...                                  # the work the lock protects

Checking (the checkers never raise; each returns a list of violations)::

    intervals = History.load("history.jsonl").intervals
    assert not check_no_overlap(intervals)
    assert not check_fencing(intervals)
    print(measure_overlap(intervals))           # report an overlap a test allows

Design notes:

* Times are ``time.monotonic()`` seconds.  On Linux that is ``CLOCK_MONOTONIC``, one clock
  for the whole machine, so intervals recorded by several processes compare directly (and
  it is also the asyncio event loop's clock, so ``Lease.safe_until`` compares too).  It is
  not comparable across machines.
* A guard's interval starts when the guard is entered and ends when it exits, whatever
  the exit (return, exception, cancellation).  Entered inside ``async with lease(...)`` it
  lies within the time the lease was held, so an overlap of two guards is a real overlap
  of the guarded work.  A process killed with ``SIGKILL`` records nothing for the interval
  it was in.
* Three kinds of records are kept, in the order they were made: :class:`Interval` (a
  guarded interval), :class:`Pause` (a holder deliberately stopped, e.g. with ``SIGSTOP``
  by the test, recorded by whoever paused it) and :class:`Loss` (a lease reported lost,
  e.g. by the ``on_event`` hook, possibly after the guard exited).  :attr:`History.intervals`
  merges them: an interval is ``paused`` if a pause of its holder overlaps it, and ``lost``
  if a loss was recorded for its lock and fencing token.  Records made in different
  processes therefore need no coordination.
* With a path, every record is also appended to a JSON-lines file as one ``os.write`` of a
  complete line on a descriptor opened with ``O_APPEND``: on a local Linux filesystem
  appends of whole lines by several processes never interleave, so any number of worker
  processes may share one file, and a parent reads it back with :meth:`History.load`.
  (Network filesystems such as NFS do not guarantee this.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from redis.asyncio import Redis

from .. import Lease, LeaseEvent, LeaseEventKind, LockLost, LossReason

__all__ = [
    "CounterMismatch",
    "FencingViolation",
    "Guard",
    "History",
    "Interval",
    "Loss",
    "Overlap",
    "OverlapStats",
    "Pause",
    "Violation",
    "check_counter",
    "check_fencing",
    "check_no_overlap",
    "keys_left",
    "measure_overlap",
]

_FILE_MODE: Final = 0o644


def _reason(value: str) -> str:
    """``value`` as a :class:`LossReason` when it is one, else the string unchanged."""
    try:
        return LossReason(value)
    except ValueError:
        return value


# --------------------------------------------------------------------------- #
# Records
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    """One holder's guarded use of one lock.

    Attributes:
        lock: the lock's name.
        holder: who held it (any id the test chooses, e.g. ``"worker-2"``).
        fencing_token: the token the lease was granted with.
        start: ``time.monotonic()`` seconds when the guarded work began.
        end: ``time.monotonic()`` seconds when it ended; not before ``start``.
        paused: the holder was deliberately paused (``SIGSTOP``) during the interval.
        lost: why the lease was lost (a :class:`~asynclock.LossReason` such as
            ``"not_owner"``, or a string of the test's own), or ``None`` if it was not.
        shared: held with a shared lease (``lease(..., shared=True)``): two shared
            intervals on one lock may overlap; an exclusive one may overlap none.

    Raises:
        ValueError: ``end`` is before ``start``, or a time is not finite.
    """

    lock: str
    holder: str
    fencing_token: int
    start: float
    end: float
    paused: bool = False
    lost: str | None = None
    shared: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise ValueError(f"interval times must be finite, got {self.start!r}..{self.end!r}")
        if self.end < self.start:
            raise ValueError(f"interval ends ({self.end!r}) before it starts ({self.start!r})")

    @property
    def duration(self) -> float:
        """``end - start``, in seconds."""
        return self.end - self.start

    def __str__(self) -> str:
        notes = " paused" if self.paused else ""
        if self.lost is not None:
            notes += f" lost:{self.lost}"
        if self.shared:
            notes += " shared"
        return (
            f"{self.holder} held {self.lock!r} with fence {self.fencing_token} "
            f"from t={self.start:.6f} to t={self.end:.6f} ({self.duration:.6f} s){notes}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Pause:
    """A holder deliberately paused from ``start`` to ``end`` (``time.monotonic()`` s)."""

    holder: str
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"pause ends ({self.end!r}) before it starts ({self.start!r})")


@dataclasses.dataclass(frozen=True, slots=True)
class Loss:
    """The lease on ``lock`` with ``fencing_token`` was lost at ``at`` (monotonic s)."""

    lock: str
    fencing_token: int
    reason: str
    at: float


Record = Interval | Pause | Loss


def _to_json(record: Record) -> dict[str, Any]:
    if isinstance(record, Interval):
        data: dict[str, Any] = {
            "kind": "interval",
            "lock": record.lock,
            "holder": record.holder,
            "fencing_token": record.fencing_token,
            "start": record.start,
            "end": record.end,
            "paused": record.paused,
            "lost": None if record.lost is None else str(record.lost),
        }
        if record.shared:  # (only then: files of exclusive leases read as before)
            data["shared"] = True
        return data
    if isinstance(record, Pause):
        return {"kind": "pause", "holder": record.holder, "start": record.start, "end": record.end}
    return {
        "kind": "loss",
        "lock": record.lock,
        "fencing_token": record.fencing_token,
        "reason": str(record.reason),
        "at": record.at,
    }


def _from_json(data: Any) -> Record:
    """Rebuild a record; raises KeyError, TypeError or ValueError for malformed data."""
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    kind = data["kind"]
    if kind == "interval":
        lost = data.get("lost")
        return Interval(
            lock=str(data["lock"]),
            holder=str(data["holder"]),
            fencing_token=int(data["fencing_token"]),
            start=float(data["start"]),
            end=float(data["end"]),
            paused=bool(data.get("paused", False)),
            lost=None if lost is None else _reason(str(lost)),
            shared=bool(data.get("shared", False)),
        )
    if kind == "pause":
        return Pause(str(data["holder"]), float(data["start"]), float(data["end"]))
    if kind == "loss":
        return Loss(
            str(data["lock"]),
            int(data["fencing_token"]),
            _reason(str(data["reason"])),
            float(data["at"]),
        )
    raise ValueError(f"unknown record kind {kind!r}")


def _loss_in(exc: BaseException | None) -> LockLost | None:
    """The ``LockLost`` that ``exc`` is or (in an exception group) contains, if any."""
    if isinstance(exc, LockLost):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _loss_in(inner)
            if found is not None:
                return found
    return None


# --------------------------------------------------------------------------- #
# Recording
# --------------------------------------------------------------------------- #


class Guard:
    """A guarded interval being recorded; returned by :meth:`History.guard`.

    A synchronous context manager, so it works in sync code and inside ``async with
    lease(...)`` alike.  On exit (normal, exception or cancellation) it records an
    :class:`Interval` from entry to exit; the interval is then available as
    :attr:`interval`.  The loss reason recorded is, first found: one given to
    :meth:`mark_lost`, the reason of a :class:`~asynclock.LockLost` leaving the block
    (e.g. from ``await lock.extend()``), or the ``lost_reason`` of the lease given to
    :meth:`History.guard_lease`.  A guard is single use.  ``shared=True`` records the
    interval as a shared lease's (:attr:`Interval.shared`).
    """

    __slots__ = (
        "_history",
        "_lease",
        "fencing_token",
        "holder",
        "interval",
        "lock",
        "lost",
        "paused",
        "shared",
        "start",
    )

    def __init__(
        self,
        history: History,
        lock: str,
        holder: str,
        fencing_token: int,
        lease: Lease | None = None,
        *,
        shared: bool = False,
    ) -> None:
        self._history = history
        self._lease = lease
        self.shared = shared
        self.lock = lock
        self.holder = holder
        self.fencing_token = fencing_token
        self.start: float | None = None
        """``time.monotonic()`` at entry, or None before the guard is entered."""
        self.paused = False
        self.lost: str | None = None
        self.interval: Interval | None = None
        """The recorded interval, once the guard has exited."""

    def mark_paused(self) -> None:
        """Record the interval as paused (the holder knows it was stopped on purpose)."""
        self.paused = True

    def mark_lost(self, reason: str) -> None:
        """Record the interval as lost, e.g. ``guard.mark_lost(lost.reason)``."""
        self.lost = _reason(str(reason))

    def __enter__(self) -> Self:
        if self.start is not None:
            raise RuntimeError("a History.guard() can be entered only once")
        self.start = time.monotonic()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = time.monotonic()
        assert self.start is not None
        if self.lost is None:
            raised = _loss_in(exc)
            if raised is not None:
                self.lost = raised.reason
            elif self._lease is not None and self._lease.lost_reason is not None:
                self.lost = self._lease.lost_reason
        self.interval = Interval(
            self.lock,
            self.holder,
            self.fencing_token,
            self.start,
            end,
            self.paused,
            self.lost,
            self.shared,
        )
        self._history.record(self.interval)


class History:
    """A record of guarded intervals, kept in memory and optionally in a JSON-lines file.

    Args:
        path: a file to append every record to (created if missing, never truncated).
            Several processes may append to one file at once; read it back with
            :meth:`load`.  ``None`` keeps the records in memory only.

    Thread-safe.  Pickling a History (e.g. to hand it to a spawned worker process) carries
    only its path: the copy appends to the same file and starts with no records in memory.
    Close it (or use it as a context manager) to close the file; a later record reopens it.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._path = None if path is None else Path(path)
        self._records: list[Record] = []
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._fd_pid = 0

    @property
    def path(self) -> Path | None:
        """The JSON-lines file records are appended to, or ``None``."""
        return self._path

    # -- recording ------------------------------------------------------------------------

    def guard(self, lock: str, holder: str, fencing_token: int, *, shared: bool = False) -> Guard:
        """A context manager recording the interval it encloses for ``lock``.

        ::

            async with asynclock.lease(redis, "orders") as lock:
                with history.guard(lock.name, "worker-1", lock.fencing_token) as guard:
                    ...

        The interval is recorded on exit even when the block raises or is cancelled.
        ``shared=True``: the work of a shared lease (see :attr:`Interval.shared`).
        """
        return Guard(self, lock, holder, fencing_token, shared=shared)

    def guard_lease(self, lease: Lease, holder: str, *, shared: bool = False) -> Guard:
        """:meth:`guard` for an asynclock lease: name and fencing token come from ``lease``.

        On exit the lease's ``lost_reason`` is recorded as well, so a block cancelled
        because the lease was lost records why.  A loss found only after the block
        (e.g. by the release) is not seen here: pass ``on_event=history.on_event`` to
        :func:`asynclock.lease` for that.  Pass ``shared=True`` for a shared lease.
        """
        return Guard(self, lease.name, holder, lease.fencing_token, lease, shared=shared)

    def record(self, item: Interval | Pause | Loss) -> None:
        """Add one record (and append it to the file, if any).

        Raises:
            TypeError: ``item`` is not an Interval, Pause or Loss.
            OSError: the file could not be opened or written.
        """
        if not isinstance(item, (Interval, Pause, Loss)):
            raise TypeError(f"expected an Interval, Pause or Loss, not {type(item).__name__}")
        if self._path is not None:
            line = json.dumps(_to_json(item), separators=(",", ":")) + "\n"
            self._append(line.encode())
        with self._lock:
            self._records.append(item)

    def mark_lost(self, lock: str, fencing_token: int, reason: str) -> None:
        """Record that the lease on ``lock`` with ``fencing_token`` was lost, now.

        The matching interval (same lock and fencing token) is reported ``lost`` by
        :attr:`intervals`, whether it was recorded before or after this.
        """
        self.record(Loss(lock, fencing_token, _reason(str(reason)), time.monotonic()))

    def on_event(self, event: LeaseEvent) -> None:
        """An ``on_event`` hook for :func:`asynclock.lease` that records losses.

        ``asynclock.lease(redis, name, on_event=history.on_event)``; every other kind of
        event is ignored.  Chain it from a hook of your own to keep both.
        """
        if event.kind is LeaseEventKind.LOST:
            reason = _reason(event.detail) if event.detail else "lost"
            self.record(Loss(event.name, event.fencing_token, reason, time.monotonic()))

    @contextmanager
    def paused(self, *holders: str) -> Iterator[None]:
        """Record that ``holders`` were paused on purpose for the duration of the block.

        Used by whoever pauses them, around the ``SIGSTOP`` ... ``SIGCONT``::

            with history.paused("worker-2"):
                os.kill(pid, signal.SIGSTOP)
                ...
                os.kill(pid, signal.SIGCONT)

        The pause is recorded on exit, even on an exception.
        """
        start = time.monotonic()
        try:
            yield
        finally:
            end = time.monotonic()
            for holder in holders:
                self.record(Pause(holder, start, end))

    # -- reading --------------------------------------------------------------------------

    @property
    def records(self) -> list[Record]:
        """Every record of this History, in the order recorded (a copy)."""
        with self._lock:
            return list(self._records)

    @property
    def pauses(self) -> list[Pause]:
        """The recorded pauses, in order."""
        return [r for r in self.records if isinstance(r, Pause)]

    @property
    def losses(self) -> list[Loss]:
        """The recorded losses, in order."""
        return [r for r in self.records if isinstance(r, Loss)]

    @property
    def intervals(self) -> list[Interval]:
        """The recorded intervals, in order, with pauses and losses merged in.

        An interval is ``paused`` if it was recorded so or a :class:`Pause` of its holder
        overlaps it; it is ``lost`` if it was recorded so or a :class:`Loss` names its lock
        and fencing token.
        """
        records = self.records
        pauses: dict[str, list[Pause]] = defaultdict(list)
        losses: dict[tuple[str, int], str] = {}
        for item in records:
            if isinstance(item, Pause):
                pauses[item.holder].append(item)
            elif isinstance(item, Loss):
                losses.setdefault((item.lock, item.fencing_token), item.reason)
        merged = []
        for item in records:
            if not isinstance(item, Interval):
                continue
            paused = item.paused or any(
                p.start < item.end and p.end > item.start for p in pauses.get(item.holder, ())
            )
            lost = (
                item.lost if item.lost is not None else losses.get((item.lock, item.fencing_token))
            )
            if paused != item.paused or lost != item.lost:
                item = dataclasses.replace(item, paused=paused, lost=lost)
            merged.append(item)
        return merged

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> History:
        """Read every record from a JSON-lines file written by ``History(path)``.

        Returns an in-memory History (``path`` is None) holding the records in file
        order.  Blank lines are skipped.

        Raises:
            OSError: the file cannot be read (``FileNotFoundError`` if it does not exist).
            ValueError: a line is not a complete, well-formed record; the message names
                the file and line number.
        """
        history = cls()
        with open(path, "rb") as file:
            for number, raw in enumerate(file, 1):
                if not raw.strip():
                    continue
                if not raw.endswith(b"\n"):
                    raise ValueError(f"{os.fspath(path)}:{number}: truncated record {raw!r}")
                try:
                    history._records.append(_from_json(json.loads(raw)))
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{os.fspath(path)}:{number}: bad record: {exc!r}") from exc
        return history

    # -- the file -------------------------------------------------------------------------

    def _append(self, line: bytes) -> None:
        assert self._path is not None
        with self._lock:
            pid = os.getpid()
            if self._fd is None or self._fd_pid != pid:  # not yet opened, or forked since
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                self._fd = os.open(self._path, flags, _FILE_MODE)
                self._fd_pid = pid
            written = os.write(self._fd, line)
        if written != len(line):  # a disk-full or similar: the file now ends mid-line
            raise OSError(f"short write to {self._path}: {written} of {len(line)} bytes")

    def close(self) -> None:
        """Close the file, if open (a later record reopens it).  Idempotent."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None and self._fd_pid == os.getpid():
                os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._path,))

    def __repr__(self) -> str:
        where = f" {str(self._path)!r}" if self._path is not None else ""
        return f"<History{where} {len(self._records)} records>"


# --------------------------------------------------------------------------- #
# Checkers
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    """Base class of what the checkers return; ``str(violation)`` explains it."""

    def __str__(self) -> str:  # pragma: no cover - every subclass has its own
        return repr(self)


def _who(interval: Interval) -> str:
    notes = ", paused" if interval.paused else ""
    if interval.shared:
        notes += ", shared"
    if interval.lost is not None:
        notes += f", lost: {interval.lost}"
    return f"{interval.holder} (fence {interval.fencing_token}{notes})"


@dataclasses.dataclass(frozen=True, slots=True)
class Overlap(Violation):
    """Two intervals on one lock overlapped for ``seconds``; ``first`` started first."""

    lock: str
    first: Interval
    second: Interval
    seconds: float

    def __str__(self) -> str:
        return (
            f"lock {self.lock!r} had two holders for {self.seconds:.6f} s: {_who(self.first)} "
            f"held it from t={self.first.start:.6f} to t={self.first.end:.6f}, and "
            f"{_who(self.second)} from t={self.second.start:.6f} to t={self.second.end:.6f}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class OverlapStats:
    """How much the intervals overlapped; returned by :func:`measure_overlap`.

    ``count`` is the number of overlapping pairs; ``total_seconds`` the sum of their
    overlaps and ``max_seconds`` the longest (seconds, 0.0 when there is none).
    """

    count: int
    total_seconds: float
    max_seconds: float
    overlaps: tuple[Overlap, ...]

    def __str__(self) -> str:
        if not self.count:
            return "no overlap"
        return (
            f"{self.count} overlapping pair(s), {self.total_seconds:.6f} s overlapped in "
            f"total, the longest {self.max_seconds:.6f} s"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class FencingViolation(Violation):
    """``later`` started after ``earlier`` on one lock but its fencing token is not higher."""

    lock: str
    earlier: Interval
    later: Interval

    def __str__(self) -> str:
        return (
            f"lock {self.lock!r}: {self.later.holder} started at t={self.later.start:.6f} "
            f"with fence {self.later.fencing_token}, not above fence "
            f"{self.earlier.fencing_token} of {self.earlier.holder} that started at "
            f"t={self.earlier.start:.6f} (fencing tokens must strictly increase)"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class CounterMismatch(Violation):
    """A counter guarded by the lock ended at ``actual`` instead of ``expected``."""

    expected: int
    actual: int

    @property
    def lost(self) -> int:
        """Updates lost (negative when more updates landed than were made)."""
        return self.expected - self.actual

    def __str__(self) -> str:
        if self.actual < self.expected:
            return f"counter is {self.actual}, expected {self.expected}: {self.lost} update(s) lost"
        return (
            f"counter is {self.actual}, expected {self.expected}: "
            f"{-self.lost} more update(s) than were made"
        )


def _by_lock(intervals: Iterable[Interval], include_paused: bool) -> dict[str, list[Interval]]:
    groups: dict[str, list[Interval]] = defaultdict(list)
    for interval in intervals:
        if include_paused or not interval.paused:
            groups[interval.lock].append(interval)
    for group in groups.values():
        group.sort(key=lambda i: (i.start, i.end, i.fencing_token))
    return dict(sorted(groups.items()))


def _overlaps(intervals: Iterable[Interval], include_paused: bool) -> list[Overlap]:
    found = []
    for lock, group in _by_lock(intervals, include_paused).items():
        for index, first in enumerate(group):
            for second in group[index + 1 :]:
                if second.start >= first.end:
                    break  # sorted by start: no later interval overlaps `first` either
                if second.holder == first.holder and second.fencing_token == first.fencing_token:
                    continue  # two records of one lease, not two holders
                if first.shared and second.shared:
                    continue  # shared holders may hold together
                seconds = min(first.end, second.end) - second.start
                found.append(Overlap(lock, first, second, seconds))
    return found


def check_no_overlap(
    intervals: Iterable[Interval], *, include_paused: bool = False
) -> list[Overlap]:
    """Every pair of intervals on one lock that overlapped in time (empty when none did).

    Intervals that only touch (one ends exactly when the other starts) do not overlap.
    Two records with the same holder and fencing token are one lease and are not
    compared, nor are two shared intervals (:attr:`Interval.shared`): an exclusive
    interval beside any other is an overlap.  Paused intervals (see
    :attr:`Interval.paused`) are left out unless ``include_paused``: a holder stopped
    longer than its TTL is expected to lose the lock while it believes it holds it,
    which is what fencing tokens are for.
    """
    return _overlaps(intervals, include_paused)


def measure_overlap(intervals: Iterable[Interval], *, include_paused: bool = True) -> OverlapStats:
    """Count and measure the overlaps :func:`check_no_overlap` would report.

    Meant for tests that allow some overlap (e.g. a paused holder's) and want to report
    how much there was.  Paused intervals are included by default.
    """
    overlaps = _overlaps(intervals, include_paused)
    seconds = [o.seconds for o in overlaps]
    return OverlapStats(len(overlaps), sum(seconds), max(seconds, default=0.0), tuple(overlaps))


def check_fencing(intervals: Iterable[Interval]) -> list[FencingViolation]:
    """Intervals whose fencing token is not above every token of an earlier-started one.

    Per lock, in order of start time, each token must be strictly greater than all
    before it; each violation names the offending interval and the earlier one holding
    the highest token so far.  Paused intervals are included.  Record one interval per
    lease: two records of one lease have equal tokens and are reported.

    Shared intervals (:attr:`Interval.shared`) are not compared with one another (shared
    holders granted close together may start their work in either order): each one must
    be above every exclusive interval that started before it, and an exclusive one above
    every interval that started before it.
    """
    found = []
    for lock, group in _by_lock(intervals, include_paused=True).items():
        best: Interval | None = None  # the highest token so far, of any interval
        best_exclusive: Interval | None = None  # ... of an exclusive one
        for interval in group:
            bar = best_exclusive if interval.shared else best
            if bar is not None and interval.fencing_token <= bar.fencing_token:
                found.append(FencingViolation(lock, bar, interval))
            if best is None or interval.fencing_token > best.fencing_token:
                best = interval
            if not interval.shared and (
                best_exclusive is None or interval.fencing_token > best_exclusive.fencing_token
            ):
                best_exclusive = interval
    return found


def check_counter(expected: int, actual: int) -> list[CounterMismatch]:
    """``[CounterMismatch]`` unless ``actual == expected``, else ``[]``.

    For a counter incremented under the lock by read, pause, write back: each increment
    lost to a concurrent holder makes ``actual`` fall short of the number made.
    """
    return [] if actual == expected else [CounterMismatch(expected, actual)]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


async def keys_left(redis: Redis, prefix: str = "asynclock:") -> list[str]:
    """The lease keys (``<prefix>{<name>}``) that exist under ``prefix``, sorted.

    Uses ``SCAN`` (never ``KEYS``), so it is safe on a shared server, but a key created or
    deleted while it runs may or may not be listed.  A lock's ``:fence`` counter and the
    ``:void:`` tombstones of abandoned acquires are not listed: they expire on their own.
    After every holder has exited its ``async with``, nothing should be left.

    Raises:
        redis.exceptions.RedisError: the server could not be asked.
    """
    found: set[str] = set()
    async for raw in redis.scan_iter(match=_glob_escape(prefix) + "{*}", count=1000):
        key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if key.startswith(prefix + "{") and key.endswith("}"):
            found.add(key)
    return sorted(found)
