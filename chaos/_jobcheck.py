"""The checks of the job sub-modes, from what the run recorded alone.

Pure functions of the shared records (JSON lines the workers and the commands wrote,
``t`` in ``time.monotonic()`` seconds), the fenced store's log, and what the nemesis did
(:class:`Hit`: its faults with their windows, the processes it stopped and killed).

**Runs** (:class:`Run`) are what must not overlap: a fenced job's run (from its
``start`` record to its ``end``, or the ``stop`` of an error or cancellation, or else to
its caller's ``round`` record, or to its process's ``SIGKILL``), a tick's job, a
command's life (from its ``cmd-start`` to the last line it wrote: a heartbeat every 40
ms, so a command killed by a signal ended within 40 ms of it). Two runs of one key
overlap unless excused, and counted apart: *paused*, when a ``SIGSTOP`` of the process
of either overlapped ``[start - ttl, end]`` (a lease cannot stop a stopped process;
fencing is the answer to that); *after data loss*, when a ``FLUSHALL`` or restart window
began before the later run started and the earlier one had started before the window
ended (or its lease granted, for a command) and was still running when it began (the
lease's key was forgotten: documented).

**Fenced** (``--jobs fenced``): every accepted write of a job's effect key is one
application of its effect: more than one for a key is an *effect applied twice*, whatever
happened to Redis (the fence and the look at the effect's key live in the store, which
no fault of Redis touches). A job's result is ``<the run whose effect was applied>@<the
run that stores it>``: every caller of a key must be given the same effect, whatever
happened (the first part); and two results for one key are two stores, a *result stored
twice*, unless a data loss came between, by the jobs mode's rule
(:func:`chaos._modes.job_results`: the stored result was forgotten by design, counted
apart, as is every run of a key after a data loss).

**Every** (``--jobs every``): each tick (the claim's time in ms) runs at most once; a
second run of a tick after a data loss that may have erased its claim (the window began
before the second run, and ended after the first's claim was sent: its ``granted``; a
period before the first run when not known) is counted apart.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from asynclock.testing import Attempt

from ._modes import JobConflict, job_results
from ._summary import RoundReport

__all__ = [
    "Hit",
    "Run",
    "command_runs",
    "effect_of",
    "effects_applied_twice",
    "effects_differ",
    "fenced_runs",
    "overlaps",
    "stored_results",
    "tick_runs",
    "ticks_run_twice",
]

Record = Mapping[str, Any]
Window = tuple[float, float]


@dataclasses.dataclass(frozen=True, slots=True)
class Hit:
    """One fault as injected: ``kind``, its window (monotonic seconds), its target (a
    process name, for ``runner_stop`` and ``runner_kill``) and whether the server lost
    its keys."""

    kind: str
    start: float
    end: float
    target: str = ""
    outcome: str = "done"
    data_loss: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """Something that must not overlap another of its ``key``: ``who`` (a process name)
    ran it from ``start`` to ``end`` (seconds); ``label`` names it. ``granted``: the
    earliest its lease may have been granted, when that may be well before ``start``
    (an ``asynclock run`` command starts after its supervisor got the lease: from the
    supervisor's launch); None: ``start``."""

    key: str
    who: str
    start: float
    end: float
    label: str
    granted: float | None = None

    def __str__(self) -> str:
        return f"{self.label} ({self.who}) t={self.start:.3f}-{self.end:.3f}"


def process_of(who: str) -> str:
    """The process of a caller id (``w0.1/t1`` -> ``w0.1``) or a command id."""
    return who.partition("/")[0].partition("#")[0]


def pauses(hits: Iterable[Hit]) -> dict[str, list[Window]]:
    """The windows each process was stopped in."""
    found: dict[str, list[Window]] = defaultdict(list)
    for hit in hits:
        if hit.kind == "runner_stop" and hit.outcome == "done":
            found[hit.target].append((hit.start, hit.end))
    return found


def losses(hits: Iterable[Hit]) -> list[Window]:
    """The windows in which the server lost its keys."""
    return [(h.start, h.end) for h in hits if h.data_loss]


def _paused(run: Run, stopped: Mapping[str, Sequence[Window]], ttl: float) -> bool:
    return any(s < run.end and e > run.start - ttl for s, e in stopped.get(run.who, ()))


def _lost_between(first: Run, second: Run, lost: Sequence[Window]) -> bool:
    granted = first.start if first.granted is None else first.granted
    return any(s < second.start and granted < e and first.end > s for s, e in lost)


@dataclasses.dataclass(frozen=True, slots=True)
class Overlaps:
    """Pairs of runs of one key that overlapped: ``unexcused`` (must be none),
    ``paused`` and ``after_loss`` (excused, counted)."""

    unexcused: tuple[tuple[Run, Run], ...]
    paused: tuple[tuple[Run, Run], ...]
    after_loss: tuple[tuple[Run, Run], ...]


def overlaps(runs: Iterable[Run], hits: Sequence[Hit], ttl: float) -> Overlaps:
    """Every pair of runs of one key that overlapped, sorted into the three kinds."""
    stopped, lost = pauses(hits), losses(hits)
    by_key: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_key[run.key].append(run)
    found: dict[str, list[tuple[Run, Run]]] = defaultdict(list)
    for group in by_key.values():
        group.sort(key=lambda r: r.start)
        for i, first in enumerate(group):
            for second in group[i + 1 :]:
                if second.start >= first.end:
                    break
                if _paused(first, stopped, ttl) or _paused(second, stopped, ttl):
                    found["paused"].append((first, second))
                elif _lost_between(first, second, lost):
                    found["after_loss"].append((first, second))
                else:
                    found["unexcused"].append((first, second))
    return Overlaps(tuple(found["unexcused"]), tuple(found["paused"]), tuple(found["after_loss"]))


def longest(pairs: Iterable[tuple[Run, Run]]) -> float:
    """The longest overlap of ``pairs``, in seconds (0 for none)."""
    return max((min(a.end, b.end) - b.start for a, b in pairs), default=0.0)


# --------------------------------------------------------------------------------------
# Fenced
# --------------------------------------------------------------------------------------


def fenced_runs(records: Sequence[Record], hits: Sequence[Hit], until: float) -> list[Run]:
    """The fenced jobs' runs (see the module doc); ``until``: the end of the run."""
    killed = {h.target: h.start for h in hits if h.kind == "runner_kill" and h.outcome == "done"}
    ends: dict[str, float] = {}
    for record in records:
        if record["e"] in ("end", "stop") or (record["e"] == "round" and record.get("run")):
            ends.setdefault(record["run"], record["t"])
    runs = []
    for record in records:
        if record["e"] == "start":
            who = process_of(record["who"])
            end = ends.get(record["run"], killed.get(who, until))
            runs.append(Run(record["key"], who, record["t"], end, record["run"]))
    return runs


def effects_applied_twice(attempts: Iterable[Attempt]) -> dict[str, list[Attempt]]:
    """Effect keys written (accepted) more than once, with those writes."""
    applied: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        if attempt.accepted and attempt.op in ("write", "unfenced"):
            applied[attempt.key].append(attempt)
    return {key: writes for key, writes in applied.items() if len(writes) > 1}


def effect_of(result: str) -> str:
    """The effect part of a fenced job's result, ``<effect's run id>@<storing run id>``:
    the run whose effect was applied."""
    return result.partition("@")[0]


def effects_differ(records: Sequence[Record]) -> list[tuple[Record, Record]]:
    """Pairs of rounds of one key whose results name two different effects (in the
    order they returned): the effect is applied once, whatever Redis forgot, so never."""
    by_key: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        if record["e"] == "round" and record.get("result") is not None:
            by_key[record["key"]].append(record)
    found = []
    for group in by_key.values():
        group.sort(key=lambda r: r["t"])
        effect = effect_of(group[0]["result"])
        found += [(group[0], r) for r in group[1:] if effect_of(r["result"]) != effect]
    return found


def stored_results(records: Sequence[Record], hits: Sequence[Hit]) -> list[JobConflict]:
    """Every change of the result returned for a key, by the jobs mode's rule
    (:func:`chaos._modes.job_results`): each run's result names the run that stored it,
    so two results for a key are two stores, unless a data loss came between (marked
    ``after_data_loss``)."""
    ended = {r["run"]: r["t"] for r in records if r["e"] == "end"}
    rounds = [
        RoundReport(
            worker=r["who"],
            lock=r["key"],
            fence=None,
            outcome="error" if r.get("error") else "released",
            reason=None,
            error=r.get("error"),
            body_start=None,
            body_end=ended.get(r.get("run") or ""),
            safe_until=None,
            lost_at=None,
            waited_until=r["t"],
            result=r.get("result"),
            ran=r.get("ran"),
        )
        for r in records
        if r["e"] == "round"
    ]
    return job_results(rounds, losses(hits))


def runs_again(runs: Sequence[Run], hits: Sequence[Hit]) -> Counter[str]:
    """Runs of a key after its first, by what explains them: ``after data loss`` (a loss
    began after the first run started), else ``after kill/stop/loss`` (the first's
    process was killed or stopped, or its lease was lost)."""
    lost = losses(hits)
    first: dict[str, Run] = {}
    counts: Counter[str] = Counter()
    for run in sorted(runs, key=lambda r: r.start):
        earlier = first.setdefault(run.key, run)
        if earlier is run:
            continue
        if any(earlier.start < s < run.start for s, _ in lost):
            counts["after data loss"] += 1
        else:
            counts["after kill/stop/loss"] += 1
    return counts


# --------------------------------------------------------------------------------------
# Every
# --------------------------------------------------------------------------------------


def tick_runs(records: Sequence[Record], until: float) -> list[Run]:
    """Every tick's run, keyed by its job (whose runs never overlap), labelled by the job
    and the tick (ms of the claim): ``tick-job-0@1795821928800``, ``granted`` when its
    claim was sent."""
    ends = {(r["who"], r["job"], r["tick"]): r["t"] for r in records if r["e"] == "tick-end"}
    return [
        Run(
            r["job"],
            r["who"],
            r["t"],
            ends.get((r["who"], r["job"], r["tick"]), until),
            f"{r['job']}@{r['tick']}",
            r.get("claim"),
        )
        for r in records
        if r["e"] == "tick"
    ]


def ticks_run_twice(
    runs: Sequence[Run], hits: Sequence[Hit], period: float
) -> tuple[list[tuple[Run, Run]], list[tuple[Run, Run]]]:
    """Pairs of runs of one tick: those no data loss explains (must be none), and those
    after a data loss that may have erased the tick's claim."""
    lost = losses(hits)
    by_tick: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_tick[run.label].append(run)
    twice, after_loss = [], []
    for group in by_tick.values():
        group.sort(key=lambda r: r.start)
        for second in group[1:]:
            first = group[0]
            claimed = first.start - period if first.granted is None else first.granted
            if any(s < second.start and e > claimed for s, e in lost):
                after_loss.append((first, second))
            else:
                twice.append((first, second))
    return twice, after_loss


# --------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------


def command_runs(records: Sequence[Record]) -> list[Run]:
    """Every command's life, from its first line to its last (see the module doc), its
    lease granted at the earliest when its ``asynclock run`` was launched."""
    span: dict[str, list[float]] = {}
    launched: dict[str, float] = {}
    for record in records:
        if record["e"].startswith("cmd-"):
            times = span.setdefault(record["id"], [record["t"], record["t"]])
            times[0], times[1] = min(times[0], record["t"]), max(times[1], record["t"])
        elif record["e"] == "exit":
            launched[record["id"]] = record["launched"]
    return [
        Run("cron-job", process_of(cid), s, e, cid, launched.get(cid))
        for cid, (s, e) in span.items()
    ]
