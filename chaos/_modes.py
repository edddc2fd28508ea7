"""The checks of the shared and the fair modes, from what the run recorded alone.

Pure functions of the workers' round reports (each with the loop time its lease was
asked for, ``asked_at``, and the time its wait ended, ``waited_until``), the history's
intervals and pauses, and what the nemesis did. Times are ``time.monotonic()`` seconds.

**Shared mode.** Shared intervals may overlap one another; an exclusive interval beside
any other is an overlap like any in the ordinary run (``check_no_overlap`` leaves shared
pairs out). The bound for an exclusive waiter: a shared acquire waits while an exclusive
waiter is registered, so shared holders drain and the exclusive waiter gets in, within
its ``blocking_timeout`` (3 TTLs, twice the longest body a shared holder runs). An
exclusive round that timed out is *starved* when, during its whole wait, no other
exclusive lease held that lock (no exclusive interval, nor the TTL after one, overlapped
it) and no fault was in force (no injection overlapped the wait or ended less than two
TTLs before it began): only shared holders stood in its way. That must never happen.

**Fair mode.** A waiter's place in the queue is the server's time of its first attempt,
which the client does not see: it lies between ``asked_at`` and, by assumption, ``asked_at +
ARRIVAL_MARGIN``, unless a fault that cuts or delays connections overlapped that (the
attempt may then have failed, and the waiter arrives at its next unprompted try: by
``ARRIVAL_MARGIN`` after ``FAIR_PATIENCE / 2`` past the fault's end). A waiter is *live*
from then until it sends its granting attempt (``lease_from``) or gives up (as seen:
``waited_until - ARRIVAL_MARGIN``, and no later than ``asked_at + blocking_timeout``),
unless its process was stopped (a ``Pause``). A grant *out of arrival order* is a round
``later`` granted (its body began) while a round ``earlier`` of the same lock was live and
had certainly arrived first (by then, ``later`` had not asked yet), with no pause of
``earlier``'s holder and no data loss (which empties the queue) between ``earlier``'s ask
and ``later``'s grant. A dead waiter (stopped, or gone
without leaving) keeps its place until ``FAIR_PATIENCE`` has passed since its last attempt,
and the next one tries at least every ``FAIR_PATIENCE / 2``: so a stretch in which the lock
was free while a live waiter waited (from the end of one holder's ``async with`` to the next
grant) may last at most :func:`fair_bound` (that plus a TTL, for a key whose release did not
get through, plus 0.25 s); a longer one is a *slow handover*.

**Jobs mode.** Callers of ``once()`` for one key must all get one result: each job returns
a value of its own (``holder#run``), so two values returned for one key mean the result
was stored twice, unless a data loss (``FLUSHALL``, restart) came between the first value
being stored (by the end of its job) and the second being returned: a lost result is
forgotten by design, and what ran again after one is counted apart. Two runs of one key's
job at once (their guarded intervals, recorded under the key) are overlaps like any.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Protocol

from asynclock._kinds._fair import FAIR_PATIENCE
from asynclock.testing import Interval, Pause

from ._nemesis import FaultKind, Injection

__all__ = [
    "ARRIVAL_MARGIN",
    "JobConflict",
    "OutOfOrder",
    "RoundLike",
    "SlowHandover",
    "exclusive_waits",
    "fair_bound",
    "free_while_waiting",
    "job_results",
    "out_of_order",
    "starved_writers",
]

ARRIVAL_MARGIN: Final = 0.25
"""Seconds from asking for a lease to its first attempt having reached the server, at
most (an assumption of the fair check: a loaded machine may break it, never the library)."""

_FAULT_AFTERMATH: Final = 2.0  # TTLs after a fault during which its effects may linger


def fair_bound(ttl: float) -> float:
    """The longest the lock may stay free while a live waiter waits (seconds)."""
    return FAIR_PATIENCE * 1.5 + ttl + 0.25


class RoundLike(Protocol):
    """What these checks read of a round report (``chaos._summary.RoundReport``)."""

    @property
    def lock(self) -> str: ...
    @property
    def who(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def outcome(self) -> str: ...
    @property
    def asked_at(self) -> float | None: ...
    @property
    def waited_until(self) -> float | None: ...
    @property
    def blocking_timeout(self) -> float | None: ...
    @property
    def body_start(self) -> float | None: ...
    @property
    def body_end(self) -> float | None: ...
    @property
    def lease_from(self) -> float | None: ...
    @property
    def exit_end(self) -> float | None: ...
    @property
    def result(self) -> str | None: ...
    @property
    def ran(self) -> str | None: ...


def _paused(holder: str, start: float, end: float, pauses: Mapping[str, Sequence[Pause]]) -> bool:
    return any(p.start < end and p.end > start for p in pauses.get(holder, ()))


def _by_holder(pauses: Iterable[Pause]) -> dict[str, list[Pause]]:
    found: dict[str, list[Pause]] = defaultdict(list)
    for pause in pauses:
        found[pause.holder].append(pause)
    return found


# --------------------------------------------------------------------------------------
# Shared
# --------------------------------------------------------------------------------------


def exclusive_waits(rounds: Iterable[RoundLike]) -> list[float]:
    """Seconds each exclusive round of the shared mode waited for its lease (granted
    ones only)."""
    return [
        r.body_start - r.asked_at
        for r in rounds
        if r.kind == "exclusive" and r.body_start is not None and r.asked_at is not None
    ]


def starved_writers(
    rounds: Iterable[RoundLike],
    intervals: Iterable[Interval],
    injections: Iterable[Injection],
    ttl: float,
) -> list[RoundLike]:
    """The exclusive rounds that timed out with only shared holders in their way (see the
    module documentation)."""
    exclusive: dict[str, list[Interval]] = defaultdict(list)
    for interval in intervals:
        if not interval.shared:
            exclusive[interval.lock].append(interval)
    faults = _fault_windows(injections, _FAULT_AFTERMATH * ttl)
    found = []
    for report in rounds:
        if report.kind != "exclusive" or report.outcome != "timeout":
            continue
        if report.asked_at is None or report.waited_until is None:
            continue
        start, end = report.asked_at, report.waited_until
        if any(i.start < end and i.end + ttl > start for i in exclusive.get(report.lock, ())):
            continue
        if any(f_start < end and f_end > start for f_start, f_end in faults):
            continue
        found.append(report)
    return found


# --------------------------------------------------------------------------------------
# Fair
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class OutOfOrder:
    """``later`` was granted ``lock`` while ``earlier``, which had arrived first, waited."""

    lock: str
    earlier: RoundLike
    later: RoundLike

    def __str__(self) -> str:
        e, lt = self.earlier, self.later
        return (
            f"lock {self.lock!r}: {lt.who} ({lt.kind}, asked at t={lt.asked_at:.6f}) was "
            f"granted at t<={lt.body_start:.6f} before {e.who} (asked at "
            f"t={e.asked_at:.6f}, waited until t={e.waited_until:.6f}, {e.outcome})"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class SlowHandover:
    """``lock`` stayed free from ``start`` to ``end`` while ``waiter`` waited, live."""

    lock: str
    start: float
    end: float
    waiter: str

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def __str__(self) -> str:
        return (
            f"lock {self.lock!r} stayed free for {self.seconds:.3f} s (t={self.start:.6f} to "
            f"t={self.end:.6f}) while {self.waiter} waited"
        )


def _fault_windows(
    injections: Iterable[Injection], aftermath: float, kinds: frozenset[FaultKind] | None = None
) -> list[tuple[float, float]]:
    """``(start, end + aftermath)`` of every fault injected (of ``kinds``, if given)."""
    return [
        (i.start, i.end + aftermath)
        for i in injections
        if not i.outcome.startswith("skipped") and (kinds is None or i.fault.kind in kinds)
    ]


_CUTS: Final = frozenset(
    {
        FaultKind.RESET,
        FaultKind.CLIENT_KILL,
        FaultKind.RESTART,
        FaultKind.BLACKHOLE,
        FaultKind.DELAY,
        FaultKind.STALL,
    }
)
"""The faults that cut or delay connections: an attempt made meanwhile may not arrive."""


def _arrived_by(report: RoundLike, cuts: Sequence[tuple[float, float]]) -> float:
    """When a fair round's first attempt had certainly reached the server (see the module
    doc)."""
    assert report.asked_at is not None
    arrived = report.asked_at + ARRIVAL_MARGIN
    for start, end in cuts:
        if start < arrived and end >= report.asked_at:
            arrived = max(arrived, end + FAIR_PATIENCE / 2 + ARRIVAL_MARGIN)
    return arrived


def _live_until(report: RoundLike) -> float | None:
    """Until when a fair round was certainly a live waiter (see the module doc)."""
    if report.asked_at is None or report.waited_until is None:
        return None
    if report.lease_from is not None:  # granted: it waited until its granting attempt
        return report.lease_from
    until = report.waited_until - ARRIVAL_MARGIN
    if report.blocking_timeout is not None:
        until = min(until, report.asked_at + report.blocking_timeout)
    return until


def out_of_order(
    rounds: Sequence[RoundLike],
    pauses: Iterable[Pause],
    data_losses: Sequence[tuple[float, float]],
    ttl: float,
    injections: Iterable[Injection] = (),
) -> list[OutOfOrder]:
    """Every grant out of arrival order among live waiters (see the module doc)."""
    cuts = _fault_windows(injections, 0.0, _CUTS)
    by_holder = _by_holder(pauses)
    granted: dict[str, list[RoundLike]] = defaultdict(list)
    for report in rounds:
        if report.body_start is not None and report.asked_at is not None:
            granted[report.lock].append(report)
    starts: dict[str, list[float]] = {}
    for lock, ordered in granted.items():
        ordered.sort(key=lambda r: r.body_start or 0.0)
        starts[lock] = [r.body_start or 0.0 for r in ordered]
    found = []
    for earlier in rounds:
        if earlier.kind != "fair" or earlier.asked_at is None:
            continue
        live = _live_until(earlier)
        group = granted.get(earlier.lock)
        if live is None or not group:
            continue
        arrived = _arrived_by(earlier, cuts)
        first = bisect.bisect_right(starts[earlier.lock], arrived)
        last = bisect.bisect_left(starts[earlier.lock], live)
        for later in group[first:last]:
            assert later.asked_at is not None
            assert later.body_start is not None
            if later is earlier or later.asked_at < arrived:
                continue
            if _paused(earlier.who, earlier.asked_at - ttl, later.body_start, by_holder):
                continue
            if any(s < later.body_start and e > earlier.asked_at for s, e in data_losses):
                continue
            found.append(OutOfOrder(earlier.lock, earlier, later))
    return found


def free_while_waiting(
    rounds: Sequence[RoundLike], pauses: Iterable[Pause], ttl: float
) -> list[SlowHandover]:
    """Per lock, every stretch in which the lock was free (from one holder's ``async
    with`` having ended to the next grant's send) while a live fair waiter waited from
    before it began to after it ended; longest first."""
    by_holder = _by_holder(pauses)
    busy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    waiting: dict[str, list[RoundLike]] = defaultdict(list)
    for report in rounds:
        if report.body_start is not None:
            start = report.lease_from if report.lease_from is not None else report.body_start
            end = report.exit_end if report.exit_end is not None else report.body_end
            busy[report.lock].append((start, max(start, end or start)))
        if report.kind == "fair" and report.asked_at is not None:
            waiting[report.lock].append(report)
    found = []
    for lock, segments in busy.items():
        segments.sort()
        reach = segments[0][1]
        for start, end in segments[1:]:
            if start > reach:
                waiter = _waited_through(waiting[lock], reach, start, by_holder, ttl)
                if waiter is not None:
                    found.append(SlowHandover(lock, reach, start, waiter))
            reach = max(reach, end)
    return sorted(found, key=lambda g: -g.seconds)


def _waited_through(
    waiters: Sequence[RoundLike],
    start: float,
    end: float,
    pauses: Mapping[str, Sequence[Pause]],
    ttl: float,
) -> str | None:
    for report in waiters:
        live = _live_until(report)
        if report.asked_at is None or live is None:
            continue
        if (
            report.asked_at + ARRIVAL_MARGIN <= start
            and live >= end
            and not _paused(report.who, start - ttl, end, pauses)
        ):
            return report.who
    return None


# --------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class JobConflict:
    """``second`` got another result for ``key`` than ``first`` did."""

    key: str
    first: RoundLike
    second: RoundLike
    after_data_loss: bool

    def __str__(self) -> str:
        return (
            f"job {self.key!r}: {self.first.who} got {self.first.result!r} at "
            f"t={self.first.waited_until:.6f}, {self.second.who} got {self.second.result!r} "
            f"at t={self.second.waited_until:.6f}"
        )


def job_results(
    rounds: Sequence[RoundLike], data_losses: Sequence[tuple[float, float]]
) -> list[JobConflict]:
    """Every change of the result returned for a key, in the order the results were
    returned (see the module documentation), marked ``after_data_loss`` where a data loss
    began before the later result was returned and ended after the job of the earlier
    one had ended (so after its result could have been stored)."""
    ended = {r.ran: r.body_end for r in rounds if r.ran is not None and r.body_end is not None}
    by_key: dict[str, list[RoundLike]] = defaultdict(list)
    for report in rounds:
        if report.result is not None and report.waited_until is not None:
            by_key[report.lock].append(report)
    found = []
    for key, group in sorted(by_key.items()):
        group.sort(key=lambda r: r.waited_until or 0.0)
        current = group[0]
        for report in group[1:]:
            if report.result == current.result:
                continue
            assert report.waited_until is not None
            stored_after = ended.get(current.result or "", current.waited_until or 0.0)
            after_loss = any(
                start < report.waited_until and end > stored_after for start, end in data_losses
            )
            found.append(JobConflict(key, current, report, after_loss))
            current = report
    return found
