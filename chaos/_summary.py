"""Checking a chaos run and printing its one summary.

Everything here is a pure function of what the run recorded: the schedule and what the
nemesis did, the workers' reports, the shared history (intervals and pauses), the fenced
store's log and counters, and the keys left on the server. Times are ``time.monotonic()``
seconds unless a name ends in ``_wall`` (``time.time()`` seconds); the summary shows
milliseconds.

Definitions (also in ``docs/chaos.md``):

* An interval is *paused* if a :class:`~asynclock.testing.Pause` of its holder overlaps
  ``[start - ttl, end]``: the holder was stopped while it held the lease, or while its
  acquire was in flight (a grant is only handed out with a third of the TTL left, so an
  acquire sent more than a TTL before the guard started cannot be affected).
* An overlap of two intervals (``first`` started first) is *after data loss* if neither
  is paused and there is a data-loss fault (``flush``, ``restart``) during which
  ``first``'s lease existed on the server and before whose end ``second``'s was not
  granted: ``first`` was granted (its fencing token, which is the server's clock in
  microseconds, read as a wall-clock time) before the fault ended and was still guarding
  when it began, and ``second`` was granted after the fault began. When a token does not
  look like a timestamp, the guard's start minus a TTL stands in for the grant time.
* In the failover mode, an overlap of two intervals that are not paused is a *double
  grant across a failover* if there is a failover such that ``first`` was granted before
  the workers could reach the promoted replica and was still guarding when the primary
  was killed, and ``second`` was granted after that kill (the same test as for a data
  loss, on the window from the ``SIGKILL`` to the proxies' repointing). With
  ``min_replicas`` 1 or more every such pair fails the run; with 0 they are counted and
  reported, as what ``min_replicas`` exists to prevent (and a failover then also
  explains a ``not_owner`` loss, as a data loss does).
* Every other overlap is among holders that were not paused and must not happen.
* Detection latency, ``deadline``: for ``LockLost(deadline)`` of an interval that was not
  paused, from the lease's safe deadline to the guarded body having stopped (the guard's
  exit). ``not_owner``: for ``LockLost(not_owner)`` of a lease that a data-loss fault took
  away, from the end of that fault (``FLUSHALL`` answered, or the restarted server
  answering again: the first moment a renewal could find the key missing) to the body
  having stopped. ``after SIGCONT``: for a holder stopped while its body ran, from
  ``SIGCONT`` to its body having stopped. Losses noticed only after the body had ended
  (e.g. during the release) have no latency.
* A ``LockLost(not_owner)`` found only by the release must be explained by a data-loss
  fault that began after the lease was granted and before the loss was noticed; one noticed
  after the lease's safe deadline (the key may have expired by its TTL, which proves no
  loss) or explained by nothing fails the run.
* Holders are the contenders (``worker-N/tK``), several per worker process; a pause
  (``SIGSTOP`` of the process) is recorded for each of them.
* An acquisition came *by local handoff* when its lease counts from a moment within the
  release of the same lock by another contender of the same process (from that one's
  guard exit to the end of its ``async with``): a handoff's lease counts from just
  before the releaser sends its HANDOFF script. An attempt of the contender's own sent
  during that release and answered with the lock would count too; it is an informational
  figure, not a check.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

from asynclock.testing import (
    Attempt,
    FencedWriteViolation,
    FencingViolation,
    Interval,
    Overlap,
    Pause,
    check_counter,
    check_fencing,
    measure_overlap,
)

from ._cluster import CLUSTER_KINDS, cluster_checks, cluster_line
from ._modes import (
    ARRIVAL_MARGIN,
    exclusive_waits,
    fair_bound,
    free_while_waiting,
    job_results,
    out_of_order,
    starved_writers,
)
from ._nemesis import FAIR_KINDS, ORDINARY, REDLOCK_KINDS, Fault, FaultKind, Injection

__all__ = [
    "DataLoss",
    "OverlapClasses",
    "RoundReport",
    "RunRecord",
    "Summary",
    "WorkerOutcome",
    "classify_overlaps",
    "failover_windows",
    "local_handoffs",
    "percentile",
    "summarize",
]

_SLACK: Final = 0.002  # seconds of tolerance when comparing a token's time with a window
_SHOWN: Final = 5  # violations of each kind printed in full
_REDLOCK_SLACK: Final = 0.05  # seconds: an overlap after one server's data loss, past a TTL
_EPSILON: Final = 1e-6  # seconds: rounding of a lease's start recovered from its deadline


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------


def _opt_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class RoundReport:
    """How one worker round ended (a worker's ``round`` message)."""

    worker: str
    lock: str
    fence: int | None
    outcome: str
    """``released``, ``lost``, ``timeout``, ``unconfirmed`` (``ReplicationTimeout``: too
    few replicas confirmed the acquisition), ``error``, ``unexpected`` or ``cancelled``."""
    reason: str | None
    error: str | None
    body_start: float | None
    body_end: float | None
    safe_until: float | None
    lost_at: float | None
    left_at_end: float | None = None
    """Seconds of the lease left when the body returned normally; None if it did not."""
    increments: int = 0
    refused: int = 0
    holder: str | None = None
    """The contender (holder id of its intervals); None: the worker's name."""
    lease_from: float | None = None
    """Loop time the lease counts from (its grant's send), when acquired."""
    exit_end: float | None = None
    """When the ``async with`` had finished, when the body was entered."""
    form: str = "block"
    """``block`` (``async with lease``) or ``detached`` (``acquire``/``guard``/``release``)."""
    kind: str = "exclusive"
    """``exclusive``, ``shared``, ``fair``, or ``plain`` (a sabotaged fair mode's jumper)."""
    asked_at: float | None = None
    """Loop time just before the lease was asked for."""
    waited_until: float | None = None
    """Loop time the wait ended (lease in hand, or the acquire's exception caught)."""
    blocking_timeout: float | None = None
    result: str | None = None
    """The jobs mode: the result ``once()`` returned."""
    ran: str | None = None
    """The jobs mode: the value this round's job returned, if it ran to its end."""

    @property
    def who(self) -> str:
        """The holder id of this round's interval."""
        return self.holder if self.holder is not None else self.worker

    @property
    def lost_after_finishing(self) -> bool:
        """LockLost came out although the body had returned with time left (and so was
        never cancelled): the loss was only found by the release."""
        return self.outcome == "lost" and self.left_at_end is not None and self.left_at_end > 0

    @classmethod
    def from_message(cls, worker: str, message: Mapping[str, Any]) -> RoundReport:
        fence = message.get("fence")
        return cls(
            worker=worker,
            lock=str(message["lock"]),
            fence=None if fence is None else int(fence),
            outcome=str(message["outcome"]),
            reason=None if message.get("reason") is None else str(message["reason"]),
            error=None if message.get("error") is None else str(message["error"]),
            body_start=_opt_float(message.get("body_start")),
            body_end=_opt_float(message.get("body_end")),
            safe_until=_opt_float(message.get("safe_until")),
            lost_at=_opt_float(message.get("lost_at")),
            left_at_end=_opt_float(message.get("left_at_end")),
            increments=int(message.get("increments", 0)),
            refused=int(message.get("refused", 0)),
            holder=None if message.get("holder") is None else str(message["holder"]),
            lease_from=_opt_float(message.get("lease_from")),
            exit_end=_opt_float(message.get("exit_end")),
            form=str(message.get("form", "block")),
            kind=str(message.get("kind", "exclusive")),
            asked_at=_opt_float(message.get("asked_at")),
            waited_until=_opt_float(message.get("waited_until")),
            blocking_timeout=_opt_float(message.get("blocking_timeout")),
            result=None if message.get("result") is None else str(message["result"]),
            ran=None if message.get("ran") is None else str(message["ran"]),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerOutcome:
    """How one worker process ended. ``died`` says how it failed, or is None."""

    name: str
    exit_code: int | None
    died: str | None
    stats: Mapping[str, Any]
    stderr_tail: tuple[str, ...] = ()


class _Mode(Protocol):
    """What :func:`mode_text` reads: a ``RunRecord`` or a ``ChaosConfig``."""

    @property
    def failover(self) -> bool: ...
    @property
    def min_replicas(self) -> int: ...
    @property
    def shared(self) -> float: ...
    @property
    def fair(self) -> bool: ...
    @property
    def redlock(self) -> int: ...
    @property
    def jobs(self) -> bool: ...
    @property
    def cluster(self) -> bool: ...


def mode_text(run: _Mode, jobs_mode: str = "") -> str:
    """The run's mode, as its headers say it (", shared mode (...)"; "" for the
    ordinary run): the schedule's and the summary's."""
    if run.failover:
        return f", failover mode (primary + replica, min_replicas {run.min_replicas})"
    if run.shared:
        return f", shared mode ({run.shared:.0%} of rounds shared)"
    if run.fair:
        return ", fair mode"
    if run.redlock:
        return f", Redlock mode over {run.redlock} servers"
    if run.jobs:
        return ", jobs mode (once())"
    if run.cluster:
        return f", cluster mode (3 primaries + replicas, min_replicas {run.min_replicas})"
    return f", jobs mode ({jobs_mode})" if jobs_mode else ""


@dataclasses.dataclass(frozen=True, slots=True)
class RunRecord:
    """Everything a chaos run recorded, as the checks need it."""

    seed: int
    workers: int
    seconds: float
    locks: tuple[str, ...]
    ttl: float
    engine: str
    schedule: tuple[Fault, ...]
    injections: tuple[Injection, ...]
    rounds: tuple[RoundReport, ...]
    outcomes: tuple[WorkerOutcome, ...]
    intervals: tuple[Interval, ...]
    pauses: tuple[Pause, ...]
    attempts: tuple[Attempt, ...]
    fenced_violations: tuple[FencedWriteViolation, ...]
    counters: Mapping[str, int]
    """The fenced counter's final value, per lock."""
    keys_left: tuple[str, ...]
    wall_seconds: float
    replay: str
    """The command line that replays this run."""
    tasks: int = 1
    """Contenders per worker process."""
    limit: int = 1
    """Permits per lock (the semaphore mode above 1); ``locks`` then lists the permits'
    slots (``lock-0#2``)."""
    failover: bool = False
    """The failover mode: a primary and its replica, and failovers as the only fault."""
    min_replicas: int = 0
    """The leases' ``min_replicas``."""
    replicas_started: int = 0
    """Replicas started in the failover mode (the first one, then one after each
    failover)."""
    shared: float = 0.0
    """The shared mode, above 0: the share of rounds that held a shared lease."""
    fair: bool = False
    """The fair mode: every lease was ``fair=True``."""
    redlock: int = 0
    """The Redlock mode: that many independent servers, each lease held on a majority."""
    jobs: bool = False
    """The jobs mode: rounds call ``once()`` (see ``chaos._modes``)."""
    cluster: bool = False
    """The cluster mode: a Redis Cluster whose slots migrate and whose primaries die
    (see ``chaos._cluster``)."""
    keys_expired: int = 0
    """The Redlock mode: keys found when the workers had exited that expired by their TTL
    before a second look (late attempts are given back in the background: a worker that
    exits meanwhile leaves them to their TTL, as Redlock's design note says)."""

    @property
    def mode(self) -> str:
        """``failover``, ``shared``, ``fair`` or ``faults`` (the ordinary run)."""
        if self.failover:
            return "failover"
        if self.cluster:
            return "cluster"
        if self.shared:
            return "shared"
        if self.redlock:
            return "redlock"
        if self.jobs:
            return "jobs"
        return "fair" if self.fair else "faults"


# --------------------------------------------------------------------------------------
# Classifying overlaps
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DataLoss:
    """A window in which the server lost its keys (monotonic and wall-clock seconds)."""

    start: float
    end: float
    start_wall: float
    end_wall: float

    @classmethod
    def of(cls, injection: Injection) -> DataLoss:
        return cls(injection.start, injection.end, injection.start_wall, injection.end_wall)


def failover_windows(injections: Iterable[Injection]) -> list[DataLoss]:
    """For each failover carried out as far as the promotion, the window from just
    before the primary's ``SIGKILL`` to the workers' proxies leading to the promoted
    replica (monotonic and wall-clock seconds), in time order."""
    windows = [
        DataLoss(i.killed, i.promoted, i.killed_wall, i.promoted_wall)
        for i in injections
        if i.fault.kind is FaultKind.FAILOVER
        and i.killed is not None
        and i.promoted is not None
        and i.killed_wall is not None
        and i.promoted_wall is not None
    ]
    return sorted(windows, key=lambda w: w.start)


def token_time(fencing_token: int, now_wall: float | None = None) -> float | None:
    """The wall-clock time (s) a fencing token was minted at, if it looks like one.

    asynclock mints ``max(last + 1, server TIME in microseconds)``; a token within a day
    of ``now_wall`` is read as that time, anything else gives None.
    """
    seconds = fencing_token / 1e6
    now = time.time() if now_wall is None else now_wall
    return seconds if abs(seconds - now) < 86_400 else None


def _pauses_by_holder(pauses: Iterable[Pause]) -> dict[str, list[Pause]]:
    found: dict[str, list[Pause]] = defaultdict(list)
    for pause in pauses:
        found[pause.holder].append(pause)
    return found


def pause_of(interval: Interval, pauses: Mapping[str, Sequence[Pause]], ttl: float) -> Pause | None:
    """The first pause of the interval's holder overlapping ``[start - ttl, end]``."""
    for pause in pauses.get(interval.holder, ()):
        if pause.start < interval.end and pause.end > interval.start - ttl:
            return pause
    return None


def _granted_at(interval: Interval, ttl: float, now_wall: float, offset: float) -> float:
    """Wall-clock time the interval's lease was granted, as well as can be told."""
    minted = token_time(interval.fencing_token, now_wall)
    return minted if minted is not None else interval.start - ttl + offset


def _excused_by(
    first: Interval, second: Interval, windows: Sequence[DataLoss], ttl: float, now_wall: float
) -> DataLoss | None:
    for window in windows:
        offset = window.start_wall - window.start  # wall minus monotonic, near the window
        first_granted = _granted_at(first, ttl, now_wall, offset)
        second_granted = _granted_at(second, ttl, now_wall, offset)
        if (
            first_granted <= window.end_wall + _SLACK
            and first.end >= window.start
            and second_granted >= window.start_wall - _SLACK
        ):
            return window
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class OverlapClasses:
    """The overlapping pairs of a run, by what explains them."""

    unpaused: tuple[Overlap, ...]
    """Not explained: must be empty."""
    after_data_loss: tuple[Overlap, ...]
    paused: tuple[Overlap, ...]
    across_failover: tuple[Overlap, ...] = ()
    """Double grants across a failover (see the module documentation)."""


def classify_overlaps(
    intervals: Iterable[Interval],
    pauses: Iterable[Pause],
    data_losses: Sequence[DataLoss],
    ttl: float,
    now_wall: float | None = None,
    failovers: Sequence[DataLoss] = (),
) -> OverlapClasses:
    """Split every overlapping pair of intervals into paused / after data loss / across
    a failover (windows from :func:`failover_windows`) / none of these.

    See the module documentation for the definitions; ``now_wall`` (default: now) is only
    used to tell whether fencing tokens look like timestamps.
    """
    now = time.time() if now_wall is None else now_wall
    by_holder = _pauses_by_holder(pauses)
    unpaused: list[Overlap] = []
    after_loss: list[Overlap] = []
    paused: list[Overlap] = []
    across: list[Overlap] = []
    for overlap in measure_overlap(intervals, include_paused=True).overlaps:
        first, second = overlap.first, overlap.second
        if pause_of(first, by_holder, ttl) or pause_of(second, by_holder, ttl):
            paused.append(overlap)
        elif _excused_by(first, second, data_losses, ttl, now):
            after_loss.append(overlap)
        elif _excused_by(first, second, failovers, ttl, now):
            across.append(overlap)
        else:
            unpaused.append(overlap)
    return OverlapClasses(tuple(unpaused), tuple(after_loss), tuple(paused), tuple(across))


def of_limit(limit: int) -> str:
    """`` of 3 permits`` in the semaphore mode, else nothing (for headlines)."""
    return f" of {limit} permits" if limit > 1 else ""


def lock_of(slot: str) -> str:
    """The lock a slot belongs to: ``lock-0`` for ``lock-0#2`` (and for ``lock-0``)."""
    return slot.partition("#")[0]


def most_at_once(intervals: Iterable[Interval]) -> dict[str, int]:
    """The most intervals that ran at the same moment, per lock (slots merged).

    Intervals that only touch do not count as running together."""
    edges: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for interval in intervals:
        edges[lock_of(interval.lock)] += [(interval.start, 1), (interval.end, -1)]
    most: dict[str, int] = {}
    for lock, points in sorted(edges.items()):
        points.sort()  # at a tie an end (-1) sorts before a start (+1)
        now = best = 0
        for _, step in points:
            now += step
            best = max(best, now)
        most[lock] = best
    return most


# --------------------------------------------------------------------------------------
# Latency
# --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile (0 < p <= 100) of ``values``; nan if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def _stats_ms(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "n": len(values),
        "p50_ms": round(percentile(values, 50) * 1000, 3),
        "p99_ms": round(percentile(values, 99) * 1000, 3),
        "max_ms": round(max(values) * 1000, 3),
    }


def _latencies(
    record: RunRecord, windows: Sequence[DataLoss], now_wall: float
) -> dict[str, list[float]]:
    """Detection latencies in seconds, by ``deadline``, ``not_owner``, ``after_sigcont``.

    ``not_owner_unexplained`` lists the ``not_owner`` losses (noticed while the body ran)
    that no data-loss fault explains, as the seconds from the body's start to the loss.
    """
    by_holder = _pauses_by_holder(record.pauses)
    resumed: dict[str, list[float]] = defaultdict(list)  # holder -> SIGCONT times
    for injection in record.injections:
        if injection.resumed is not None:
            resumed[injection.target].append(injection.resumed)
    found: dict[str, list[float]] = {"deadline": [], "not_owner": [], "after_sigcont": []}
    unexplained = found["not_owner_unexplained"] = []  # lost_at - body_start, for the record
    for report in record.rounds:
        if report.reason is None or report.body_end is None or report.body_start is None:
            continue
        if report.fence is None:
            continue
        interval = Interval(
            report.lock, report.who, report.fence, report.body_start, report.body_end
        )
        pause = pause_of(interval, by_holder, record.ttl)
        if pause is not None:
            # Only a body that was running when its holder was resumed, and whose loss was
            # noticed while it ran (a body that began after the SIGCONT is not measured).
            sent = [t for t in resumed[report.worker] if pause.start <= t <= pause.end]
            noticed = report.lost_at is not None and report.lost_at <= report.body_end + _SLACK
            if sent and noticed and report.body_start <= sent[0] <= report.body_end:
                found["after_sigcont"].append(report.body_end - sent[0])
            continue
        if report.reason == "deadline" and report.safe_until is not None:
            if report.body_end >= report.safe_until:
                found["deadline"].append(report.body_end - report.safe_until)
        elif report.reason == "not_owner" and report.lost_at is not None:
            if report.lost_at > report.body_end + _SLACK:
                continue  # noticed after the body had ended
            latest = _data_loss_before(report, report.lost_at, windows, record.ttl, now_wall)
            if latest is None:
                unexplained.append(report.lost_at - report.body_start)
            elif report.body_end >= latest.end:
                found["not_owner"].append(report.body_end - latest.end)
    return found


def _data_loss_before(
    report: RoundReport,
    when: float,
    windows: Sequence[DataLoss],
    ttl: float,
    now_wall: float,
) -> DataLoss | None:
    """The last data-loss fault that began by ``when`` (loop time) and could have taken
    away the round's lease: one that ended after the lease was granted."""
    if report.fence is None or report.body_start is None:
        return None
    granted = token_time(report.fence, now_wall)
    latest: DataLoss | None = None
    for window in windows:  # in time order
        granted_before = (
            granted <= window.end_wall + _SLACK
            if granted is not None
            else report.body_start - ttl <= window.end
        )
        if granted_before and window.start <= when:
            latest = window
    return latest


def _release_losses(
    record: RunRecord, windows: Sequence[DataLoss], now_wall: float
) -> dict[str, int]:
    """What explains each ``LockLost(not_owner)`` found only by the release (the body had
    returned with time left): a data-loss fault that could have taken the key
    (``after_data_loss``); else a release answered only after the lease's safe deadline
    (``answered_late``), which proves nothing and must not be raised; else nothing
    (``unexplained``: the key went early, or was taken, while no fault touched it). A stop
    of the holder explains none: the loop's clock runs on through ``SIGSTOP``, and the key
    cannot expire by its TTL before the safe deadline whatever the holder does."""
    counts = dict.fromkeys(("after_data_loss", "answered_late", "unexplained"), 0)
    for report in record.rounds:
        if not report.lost_after_finishing or report.reason != "not_owner":
            continue
        when = report.lost_at if report.lost_at is not None else report.exit_end
        if when is None:
            continue
        if _data_loss_before(report, when, windows, record.ttl, now_wall) is not None:
            counts["after_data_loss"] += 1
        elif report.safe_until is not None and when > report.safe_until + _SLACK:
            counts["answered_late"] += 1
        else:
            counts["unexplained"] += 1
    return counts


def local_handoffs(rounds: Iterable[RoundReport]) -> list[RoundReport]:
    """The rounds whose lock came by local handoff (see the module documentation)."""
    releases: dict[tuple[str, str], list[tuple[float, float, str]]] = defaultdict(list)
    for report in rounds:
        if report.body_end is not None and report.exit_end is not None:
            releases[report.worker, report.lock].append(
                (report.body_end, report.exit_end, report.who)
            )
    found = []
    for report in rounds:
        start = report.lease_from
        if start is None or report.body_start is None:
            continue
        for begin, end, who in releases.get((report.worker, report.lock), ()):
            if who != report.who and begin - _EPSILON <= start <= end + _EPSILON:
                found.append(report)
                break
    return found


# --------------------------------------------------------------------------------------
# The summary
# --------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def _pairs(overlaps: Sequence[Overlap]) -> dict[str, Any]:
    longest = max((o.seconds for o in overlaps), default=0.0)
    return {"count": len(overlaps), "max_ms": round(longest * 1000, 3)}


def _counts(counter: Mapping[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(counter.items())) or "none"


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    """The result of a chaos run: ``ok``, ``failures`` (why not), the figures and text."""

    ok: bool
    failures: tuple[str, ...]
    data: Mapping[str, Any]
    """The figures, JSON-able (``--json`` prints this)."""
    lines: tuple[str, ...]
    """The summary for humans."""
    details: tuple[str, ...]
    """What each failure was, in full (the first few of each kind)."""


def summarize(record: RunRecord) -> Summary:
    """Run every check over ``record`` and build the summary."""
    now_wall = time.time()
    ttl = record.ttl
    failures: list[str] = []
    details: list[str] = []

    # -- faults ------------------------------------------------------------------------
    by_kind: Counter[str] = Counter()
    by_variant: Counter[str] = Counter()
    on_holder: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    errors = []
    for injection in record.injections:
        kind = str(injection.fault.kind)
        if injection.done:
            by_kind[kind] += 1
            if injection.fault.variant:
                by_variant[f"{kind}/{injection.fault.variant}"] += 1
            if injection.fault.scope == "holder":
                on_holder[kind] += 1
        elif injection.outcome.startswith("skipped"):
            skipped[kind] += 1
        else:
            errors.append(f"{injection.fault.describe()}: {injection.outcome}")
    if errors:
        failures.append(f"the nemesis failed to inject {len(errors)} fault(s)")
        details.extend(errors[:_SHOWN])
    windows = [DataLoss.of(i) for i in record.injections if i.data_loss]
    windows.sort(key=lambda w: w.start)
    failovers = failover_windows(record.injections)
    # What may explain a not_owner loss: a data loss, and, without min_replicas, a
    # failover (the promoted replica may have missed the grant or a renewal); with
    # min_replicas, a failover must not take a confirmed lease away.
    explaining = sorted(windows + (failovers if not record.min_replicas else []), key=_start)

    # -- acquisitions and errors -------------------------------------------------------
    acquired = [r for r in record.rounds if r.body_start is not None]
    per_lock = Counter(r.lock for r in acquired)
    handed = local_handoffs(record.rounds)
    outcomes = Counter(r.outcome for r in record.rounds)
    lost = Counter(str(r.reason) for r in record.rounds if r.outcome == "lost")
    hidden = Counter(str(r.reason) for r in record.rounds if r.outcome != "lost" and r.reason)
    late = Counter(str(r.reason) for r in record.rounds if r.lost_after_finishing)
    round_errors = Counter(str(r.error) for r in record.rounds if r.outcome == "error")
    unexpected = [r for r in record.rounds if r.outcome == "unexpected"]
    if unexpected:
        failures.append(f"{len(unexpected)} round(s) ended with an unexpected exception")
        details.extend(f"{r.worker} on {r.lock!r}: {r.error}" for r in unexpected[:_SHOWN])
    if not acquired:
        failures.append("no worker ever acquired a lock")

    # -- overlap -------------------------------------------------------------------------
    classes = classify_overlaps(
        record.intervals, record.pauses, windows, ttl, now_wall, failovers=failovers
    )
    if classes.unpaused:
        failures.append(
            f"{len(classes.unpaused)} overlapping pair(s) of holders that were not paused"
        )
        details.extend(str(o) for o in classes.unpaused[:_SHOWN])
    if classes.across_failover and record.min_replicas:
        failures.append(
            f"{len(classes.across_failover)} double grant(s) across a failover with "
            f"min_replicas={record.min_replicas}"
        )
        details.extend(str(o) for o in classes.across_failover[:_SHOWN])
    long: list[Overlap] = []
    if record.redlock:
        # One server's data loss leaves a lease held on the others; one held on a bare
        # majority with that server is lost by its first renewal there, or at the latest
        # by its deadline on that server, a TTL after the keys went: no longer.
        long = [o for o in classes.after_data_loss if o.seconds > ttl + _REDLOCK_SLACK]
        if long:
            failures.append(
                f"{len(long)} overlap(s) after one server's data loss longer than a TTL"
            )
            details.extend(str(o) for o in long[:_SHOWN])
    by_holder = _pauses_by_holder(record.pauses)
    steady = [i for i in record.intervals if pause_of(i, by_holder, ttl) is None]
    # (the jobs mode's tokens are times taken by the jobs, once() showing none)
    fencing: list[FencingViolation] = [] if record.jobs else check_fencing(steady)
    if fencing:
        failures.append(f"{len(fencing)} fencing token(s) out of order")
        details.extend(str(v) for v in fencing[:_SHOWN])
    # How many held each lock at once, by the intervals alone (slots merged): a check of
    # the limit that does not rely on the permits' slots, leaving out the paused holders
    # and the later holder of each overlap a data loss explains.
    excused = {id(o.second) for o in classes.after_data_loss}
    if not record.min_replicas:  # (reported as double grants across a failover)
        excused |= {id(o.second) for o in classes.across_failover}
    # (shared holders are counted apart: the limit is the exclusive holders', and an
    # exclusive one beside a shared one is an overlap above)
    at_once = most_at_once(i for i in steady if id(i) not in excused and not i.shared)
    shared_at_once = most_at_once(i for i in steady if i.shared)
    over = {lock: n for lock, n in at_once.items() if n > record.limit}
    if over:
        failures.append(
            "more unpaused holders at once than the limit: "
            + ", ".join(f"{lock} {n} > {record.limit}" for lock, n in over.items())
        )

    # -- the fenced store ------------------------------------------------------------------
    writes = [a for a in record.attempts if a.op == "write"]
    accepted_writes = Counter(a.key for a in writes if a.accepted)
    refused = sum(1 for a in record.attempts if not a.accepted)
    if record.fenced_violations:
        failures.append(f"{len(record.fenced_violations)} stale fenced write(s) accepted")
        details.extend(str(v) for v in record.fenced_violations[:_SHOWN])
    counters: dict[str, Any] = {}
    mismatches = 0
    for lock in record.locks:
        key = f"counter:{lock}"
        value = record.counters.get(lock, 0)
        expected = accepted_writes.get(key, 0)
        counters[lock] = {"value": value, "accepted_increments": expected}
        for mismatch in check_counter(expected, value):
            mismatches += 1
            failures.append(f"counter of {lock!r}: {mismatch}")

    # -- keys and workers -----------------------------------------------------------------
    if record.keys_left:
        failures.append(f"{len(record.keys_left)} lease key(s) left behind")
        details.append("keys left: " + ", ".join(record.keys_left))
    died = [o for o in record.outcomes if o.died is not None]
    for outcome in died:
        failures.append(f"{outcome.name} {outcome.died}")
        details.extend(f"{outcome.name} stderr: {line}" for line in outcome.stderr_tail[-10:])
    warnings: Counter[str] = Counter()
    for outcome in record.outcomes:
        warnings.update(outcome.stats.get("warnings", {}))

    # -- latency --------------------------------------------------------------------------
    latency = _latencies(record, explaining, now_wall)
    at_release = _release_losses(record, explaining, now_wall)
    for what, why in (
        ("answered_late", "answered after the safe deadline (proves no loss)"),
        ("unexplained", "with no data-loss fault to explain it"),
    ):
        if at_release[what]:
            failures.append(f"{at_release[what]} LockLost(not_owner) at release {why}")

    modes = _mode_checks(record, windows)
    failures.extend(modes.pop("failures"))
    details.extend(modes.pop("details"))

    data: dict[str, Any] = {
        "ok": not failures,
        "seed": record.seed,
        "workers": record.workers,
        "tasks": record.tasks,
        "seconds": record.seconds,
        "locks": len({lock_of(slot) for slot in record.locks}),
        "limit": record.limit,
        "mode": record.mode,
        "min_replicas": record.min_replicas,
        "most_holders_at_once": at_once,
        "most_shared_holders_at_once": shared_at_once,
        "redlock_long_overlaps": len(long),
        **modes,
        "ttl": ttl,
        "engine": record.engine,
        "faults": {
            "scheduled": len(record.schedule),
            "injected": sum(by_kind.values()),
            "by_kind": dict(sorted(by_kind.items())),
            "by_variant": dict(sorted(by_variant.items())),
            "on_one_holder": dict(sorted(on_holder.items())),
            "skipped": dict(sorted(skipped.items())),
            "errors": len(errors),
        },
        "failovers": {
            "scheduled": sum(1 for f in record.schedule if f.kind is FaultKind.FAILOVER),
            "done": by_kind.get(str(FaultKind.FAILOVER), 0),
            "after_grant": sum(
                1
                for i in record.injections
                if i.done and i.after_grant and i.fault.kind is FaultKind.FAILOVER
            ),
            "replicas_started": record.replicas_started,
        },
        "replication_timeouts": outcomes.get("unconfirmed", 0),
        "double_grants_across_failover": len(classes.across_failover),
        "double_grants_by_failover": _by_failover(
            classes.across_failover, record.injections, ttl, now_wall
        ),
        "acquisitions": {
            "total": len(acquired),
            "by_lock": dict(sorted(per_lock.items())),
            "by_local_handoff": len(handed),
        },
        "rounds": {
            "total": len(record.rounds),
            "by_outcome": dict(sorted(outcomes.items())),
            "by_form": dict(sorted(Counter(r.form for r in record.rounds).items())),
        },
        "errors": dict(sorted(round_errors.items())),
        "unexpected_errors": len(unexpected),
        "lock_lost": {"total": sum(lost.values()), "by_reason": dict(sorted(lost.items()))},
        "lost_behind_body_error": dict(sorted(hidden.items())),
        "lost_after_body_finished": dict(sorted(late.items())),
        "not_owner_at_release": at_release,
        "overlap": {
            "unpaused": _pairs(classes.unpaused),
            "after_data_loss": _pairs(classes.after_data_loss),
            "paused": _pairs(classes.paused),
            "across_failover": _pairs(classes.across_failover),
        },
        "fencing_order_violations": len(fencing),
        "fenced_writes": {
            "accepted": sum(accepted_writes.values()),
            "refused": refused,
            "stale_accepted": len(record.fenced_violations),
        },
        "counters": counters,
        "counter_mismatches": mismatches,
        "keys_left": list(record.keys_left),
        "keys_expired": record.keys_expired,
        "workers_died": [o.name for o in died],
        "warnings": dict(sorted(warnings.items())),
        "detection_latency": {kind: _stats_ms(values) for kind, values in latency.items()},
        "wall_seconds": round(record.wall_seconds, 3),
        "failures": list(failures),
    }
    lines = _render(record, data, by_kind, by_variant, on_holder, skipped)
    return Summary(not failures, tuple(failures), data, tuple(lines), tuple(details))


def _mode_checks(record: RunRecord, windows: Sequence[DataLoss]) -> dict[str, Any]:
    """The shared and fair modes' own checks (``chaos._modes``): their figures under
    ``shared`` / ``fair``, and ``failures`` and ``details`` to add to the run's."""
    failures: list[str] = []
    details: list[str] = []
    found: dict[str, Any] = {"failures": failures, "details": details}
    ttl = record.ttl
    if record.shared:
        kinds = Counter(r.kind for r in record.rounds if r.body_start is not None)
        starved = starved_writers(record.rounds, record.intervals, record.injections, ttl)
        if starved:
            failures.append(
                f"{len(starved)} exclusive waiter(s) timed out with only shared holders "
                "in the way and no fault"
            )
            details.extend(
                f"{r.who} on {r.lock!r} waited from t={r.asked_at:.6f} to "
                f"t={r.waited_until:.6f} and timed out"
                for r in starved[:_SHOWN]
            )
        exclusive_timeouts = sum(
            1 for r in record.rounds if r.kind == "exclusive" and r.outcome == "timeout"
        )
        found["shared"] = {
            "acquisitions": {"shared": kinds.get("shared", 0), "exclusive": kinds["exclusive"]},
            "exclusive_wait": _stats_ms(exclusive_waits(record.rounds)),
            "exclusive_timeouts": exclusive_timeouts,
            "starved_writers": len(starved),
        }
    if record.jobs:
        conflicts = job_results(record.rounds, [(w.start, w.end) for w in windows])
        bad = [c for c in conflicts if not c.after_data_loss]
        if bad:
            failures.append(f"{len(bad)} job result(s) stored twice (callers got two results)")
            details.extend(str(c) for c in bad[:_SHOWN])
        runs = Counter(r.lock for r in record.rounds if r.ran is not None)
        found["jobs"] = {
            "calls": sum(1 for r in record.rounds if r.kind == "job"),
            "results": sum(1 for r in record.rounds if r.result is not None),
            "keys": len({r.lock for r in record.rounds if r.result is not None}),
            "runs_completed": sum(runs.values()),
            "keys_run_again": sum(1 for n in runs.values() if n > 1),
            "stored_twice": len(bad),
            "stored_again_after_data_loss": len(conflicts) - len(bad),
        }
    if record.cluster:
        found["cluster"] = cluster_checks(record.rounds, record.injections, ttl, failures, details)
    if record.fair:
        losses = [(w.start, w.end) for w in windows]
        disorder = out_of_order(record.rounds, record.pauses, losses, ttl, record.injections)
        gaps = free_while_waiting(record.rounds, record.pauses, ttl)
        bound = fair_bound(ttl)
        slow = [g for g in gaps if g.seconds > bound]
        if disorder:
            failures.append(f"{len(disorder)} grant(s) out of arrival order among live waiters")
            details.extend(str(v) for v in disorder[:_SHOWN])
        if slow:
            failures.append(
                f"{len(slow)} time(s) the lock stayed free longer than {bound:.2f} s "
                "while a live waiter waited"
            )
            details.extend(str(g) for g in slow[:_SHOWN])
        kinds = Counter(r.kind for r in record.rounds if r.body_start is not None)
        found["fair"] = {
            "acquisitions": dict(sorted(kinds.items())),
            "gave_up": sum(1 for r in record.rounds if r.outcome == "timeout"),
            "out_of_order": len(disorder),
            "arrival_margin_ms": round(ARRIVAL_MARGIN * 1000),
            "free_while_waiting": {
                "count": len(gaps),
                "max_ms": round(gaps[0].seconds * 1000, 3) if gaps else 0.0,
                "bound_ms": round(bound * 1000, 3),
                "over_bound": len(slow),
            },
        }
    return found


def _by_failover(
    overlaps: Sequence[Overlap], injections: Sequence[Injection], ttl: float, now_wall: float
) -> dict[str, int]:
    """Double grants across a failover, by the failover's ``variant/scope``."""
    found: Counter[str] = Counter()
    for overlap in overlaps:
        for injection in injections:
            windows = failover_windows([injection])
            if _excused_by(overlap.first, overlap.second, windows, ttl, now_wall):
                found[f"{injection.fault.variant}/{injection.fault.scope}"] += 1
                break
    return dict(sorted(found.items()))


def _start(window: DataLoss) -> float:
    return window.start


def _expired_text(expired: int) -> str:
    """What the keys-left line adds for keys that expired by their TTL after the exit."""
    return f" ({expired} more expired by their TTL after the workers exited)" if expired else ""


def _latency_text(stats: Mapping[str, Any]) -> str:
    if not stats["n"]:
        return "n=0"
    return (
        f"n={stats['n']} p50 {stats['p50_ms']:.1f} ms, p99 {stats['p99_ms']:.1f} ms, "
        f"max {stats['max_ms']:.1f} ms"
    )


def _kinds_shown(record: RunRecord) -> Sequence[FaultKind]:
    """The kinds of fault the run's mode draws from, in the summary's order."""
    if record.failover:
        return (FaultKind.FAILOVER,)
    if record.cluster:
        return CLUSTER_KINDS
    if record.redlock:
        return REDLOCK_KINDS
    return FAIR_KINDS if record.fair else ORDINARY


def _render(
    record: RunRecord,
    data: Mapping[str, Any],
    by_kind: Counter[str],
    by_variant: Counter[str],
    on_holder: Counter[str],
    skipped: Counter[str],
) -> list[str]:
    faults = data["faults"]
    kinds = []
    for kind in _kinds_shown(record):
        count = by_kind.get(str(kind), 0)
        variants = [
            f"{variant.split('/', 1)[1]} {n}"
            for variant, n in sorted(by_variant.items())
            if variant.startswith(f"{kind}/")
        ]
        if on_holder.get(str(kind)):
            scope = "with the grantee cut off" if kind is FaultKind.FAILOVER else "on one holder"
            variants.append(f"{on_holder[str(kind)]} {scope}")
        text = f"{kind} {count}"
        if variants and count:
            text += f" ({', '.join(variants)})"
        if skipped.get(str(kind)):
            text += f" [{skipped[str(kind)]} skipped]"
        kinds.append(text)
    acq = data["acquisitions"]
    overlap = data["overlap"]
    fenced = data["fenced_writes"]
    counters = data["counters"]
    latency = data["detection_latency"]
    lost = data["lock_lost"]
    mark = "  <- must be 0"

    def must(value: int) -> str:
        return mark if value else ""

    counter_text = "; ".join(
        f"{lock} {c['value']} = {c['accepted_increments']}" for lock, c in counters.items()
    )
    mode = mode_text(record)
    lines = [
        f"asynclock chaos: seed {record.seed}, {record.workers} workers x {record.tasks} tasks, "
        f"{data['locks']} locks{of_limit(record.limit)}, ttl {record.ttl:g} s, "
        f"{record.seconds:g} s on {record.engine}{mode}",
        f"  faults injected      {faults['injected']} of {faults['scheduled']} scheduled: "
        + ", ".join(kinds),
    ]
    if record.cluster:
        lines.append(cluster_line(data["cluster"], must))
    if record.failover or record.cluster:
        failover = data["failovers"]
        across = overlap["across_failover"]
        expected = " (what min_replicas prevents)" if across["count"] else ""
        lines += [
            f"  failovers            {failover['done']} of {failover['scheduled']} scheduled, "
            f"{failover['after_grant']} right after a grant; "
            f"{failover['replicas_started']} replicas started",
            f"  ReplicationTimeout   {data['replication_timeouts']} acquisitions refused "
            "(too few replicas confirmed them; given back)",
            f"  double grants across a failover: {across['count']} pairs, "
            f"max {across['max_ms']:.0f} ms"
            + (f" ({_counts(data['double_grants_by_failover'])})" if across["count"] else "")
            + (must(across["count"]) if record.min_replicas else expected),
        ]
    if record.shared:
        shared = data["shared"]
        lines += [
            f"  shared mode          {shared['acquisitions']['shared']} shared and "
            f"{shared['acquisitions']['exclusive']} exclusive acquisitions; most shared "
            f"holders at once {_counts(data['most_shared_holders_at_once'])}",
            f"  exclusive waits      {_latency_text(shared['exclusive_wait'])}; "
            f"{shared['exclusive_timeouts']} timed out",
            f"  exclusive waiters starved by shared holders (no fault, no other exclusive "
            f"holder): {shared['starved_writers']}" + must(shared["starved_writers"]),
        ]
    if record.jobs:
        jobs = data["jobs"]
        lines += [
            f"  jobs mode            {jobs['calls']} once() calls, {jobs['results']} returned "
            f"a result, for {jobs['keys']} keys; {jobs['runs_completed']} jobs ran to their "
            f"end ({jobs['keys_run_again']} keys ran again: a runner lost its lease or the "
            "result)",
            f"  job results stored twice (two results for a key): {jobs['stored_twice']}"
            + must(jobs["stored_twice"])
            + f"; again after a data loss (forgotten by design): "
            f"{jobs['stored_again_after_data_loss']}",
        ]
    if record.fair:
        fair = data["fair"]
        free = fair["free_while_waiting"]
        lines += [
            f"  fair mode            acquisitions {_counts(fair['acquisitions'])}; "
            f"{fair['gave_up']} waiters gave up",
            f"  grants out of arrival order (live waiters, arrival margin "
            f"{fair['arrival_margin_ms']} ms): {fair['out_of_order']}" + must(fair["out_of_order"]),
            f"  lock free while a live waiter waited: {free['count']} times, longest "
            f"{free['max_ms']:.0f} ms (bound {free['bound_ms']:.0f} ms), "
            f"{free['over_bound']} over the bound" + must(free["over_bound"]),
        ]
    lines += [
        f"  acquisitions         {acq['total']}: "
        + ", ".join(f"{lock} {n}" for lock, n in acq["by_lock"].items())
        + f"; {acq['by_local_handoff']} by local handoff",
        f"  rounds               {data['rounds']['total']}: "
        + _counts(data["rounds"]["by_outcome"])
        + f" ({_counts(data['rounds']['by_form'])})",
        f"  errors (handled)     {_counts(data['errors'])}",
        f"  LockLost             {lost['total']}: {_counts(lost['by_reason'])}",
    ]
    if data["lost_behind_body_error"]:
        lines.append(
            f"  lost, body error out {_counts(data['lost_behind_body_error'])}"
            " (the body's own error propagated instead of LockLost)"
        )
    if data["lost_after_body_finished"]:
        lines.append(
            f"  LockLost after the body had finished in time: "
            f"{_counts(data['lost_after_body_finished'])} (found only by the release)"
        )
        why = data["not_owner_at_release"]
        lines.append(
            f"    not_owner at release: {why['after_data_loss']} after data loss, "
            f"{why['answered_late']} answered after the deadline, "
            f"{why['unexplained']} unexplained" + must(why["answered_late"] + why["unexplained"])
        )
    lines += [
        f"  overlap, not paused  {overlap['unpaused']['count']} pairs"
        + must(overlap["unpaused"]["count"]),
        f"  most holders at once {_counts(data['most_holders_at_once'])} "
        f"(limit {record.limit}, unpaused)",
        f"  allowed overlap after data loss: {overlap['after_data_loss']['count']} pairs, "
        f"max {overlap['after_data_loss']['max_ms']:.0f} ms",
        f"  overlap of paused holders (excused): {overlap['paused']['count']} pairs, "
        f"max {overlap['paused']['max_ms']:.0f} ms",
        f"  fencing order        {data['fencing_order_violations']} violations"
        + must(data["fencing_order_violations"]),
        f"  fenced writes        {fenced['accepted']} accepted, {fenced['refused']} stale "
        f"refused, {fenced['stale_accepted']} stale accepted" + must(fenced["stale_accepted"]),
        f"  counters exact       {counter_text}; {data['counter_mismatches']} mismatches"
        + must(data["counter_mismatches"]),
        f"  keys left behind     {len(data['keys_left'])}"
        + must(len(data["keys_left"]))
        + _expired_text(data.get("keys_expired", 0)),
        f"  workers died         {len(data['workers_died'])}" + must(len(data["workers_died"])),
        f"  unexpected errors    {data['unexpected_errors']}" + must(data["unexpected_errors"]),
        f"  detection latency    deadline -> body stopped: {_latency_text(latency['deadline'])}",
        f"                       key lost -> body stopped (not_owner): "
        f"{_latency_text(latency['not_owner'])}",
        f"                       SIGCONT -> body stopped (stopped holder): "
        f"{_latency_text(latency['after_sigcont'])}",
        f"  not_owner without data loss  {latency['not_owner_unexplained']['n']}"
        " (the key expired or was taken while the holder was not stopped and nothing was lost)",
        f"  asynclock warnings   {_counts(data['warnings'])}",
        f"  wall time            {data['wall_seconds']:.1f} s",
    ]
    return lines
