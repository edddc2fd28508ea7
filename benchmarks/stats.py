"""Percentiles, medians, Jain's index, and the analysis of a contention event log."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

__all__ = ["Hold", "contention_metrics", "jain", "median", "percentile", "process_handoff_metrics"]


class Hold(NamedTuple):
    """One turn of one contender: stamped when it got in and just before it released."""

    t_in: float  # time.monotonic() right after the acquire returned
    t_release: float  # time.monotonic() just before the release call
    contender: int


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolating linearly; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Iterable[float]) -> float:
    """The median of the finite values, NaN when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    return percentile(finite, 0.5)


def jain(counts: Sequence[float]) -> float:
    """Jain's fairness index: 1.0 when all equal, 1/n when one contender had everything."""
    total = sum(counts)
    squares = sum(c * c for c in counts)
    if not counts or squares == 0:
        return math.nan
    return total * total / (len(counts) * squares)


def _handoffs(
    turns: Sequence[Hold], reader: Callable[[int], bool] | None
) -> list[tuple[Hold, Hold]]:
    """(previous holder, next holder) of each hand-over among ``turns`` (sorted by entry):
    consecutive turns of different contenders; with readers (``reader``), the previous
    holder is the earlier turn released last, and a reader after a reader is no
    hand-over (they may hold together)."""
    if reader is None:
        return [(a, b) for a, b in itertools.pairwise(turns) if a.contender != b.contender]
    pairs: list[tuple[Hold, Hold]] = []
    last: Hold | None = None
    for turn in turns:
        shared = last is not None and reader(last.contender) and reader(turn.contender)
        if last is not None and last.contender != turn.contender and not shared:
            pairs.append((last, turn))
        if last is None or turn.t_release > last.t_release:
            last = turn
    return pairs


def _overlaps(turns: Sequence[Hold], reader: Callable[[int], bool] | None) -> int:
    """Turns that began while another was held (with readers: while a writer was held,
    or a writer that began while anyone was held)."""
    if reader is None:
        return sum(1 for a, b in itertools.pairwise(turns) if b.t_in < a.t_release)
    count, held_until, writer_until = 0, -math.inf, -math.inf
    for turn in turns:
        writer = not reader(turn.contender)
        if turn.t_in < writer_until or (writer and turn.t_in < held_until):
            count += 1
        held_until = max(held_until, turn.t_release)
        if writer:
            writer_until = max(writer_until, turn.t_release)
    return count


def contention_metrics(
    holds: Iterable[Hold],
    start: float,
    end: float,
    contenders: int,
    reader: Callable[[int], bool] | None = None,
) -> dict[str, float]:
    """Figures of a contention run from the turns whose entry fell in ``[start, end]``.

    - ``acquisitions_per_s``: turns per second.
    - ``handoffs_per_s``: turns taken by a contender other than the previous holder.
    - ``retake``: fraction of consecutive turns where the releaser took the lock again.
    - ``jain``: Jain's index over the turns of each of the ``contenders``.
    - ``latency_p50_us`` / ``latency_p99_us``: from the previous holder's release call to
      the next (different) holder's entry, in microseconds.
    - ``overlaps``: turns that began before the previous one released (must be 0).

    ``reader``: which contenders hold shared leases (a shared lease's run): readers may
    hold together, so a reader after a reader is no hand-over and no overlap (see
    ``_handoffs`` and ``_overlaps``).
    """
    turns = sorted(h for h in holds if start <= h.t_in <= end)
    window = end - start
    pairs = list(itertools.pairwise(turns))
    latencies = [(nxt.t_in - prev.t_release) * 1e6 for prev, nxt in _handoffs(turns, reader)]
    retakes = sum(1 for prev, nxt in pairs if nxt.contender == prev.contender)
    per_contender = [0] * contenders
    for turn in turns:
        per_contender[turn.contender] += 1
    return {
        "acquisitions": float(len(turns)),
        "acquisitions_per_s": len(turns) / window,
        "handoffs_per_s": len(latencies) / window,
        "retake": retakes / len(pairs) if pairs else math.nan,
        "jain": jain(per_contender),
        "latency_p50_us": percentile(latencies, 0.50),
        "latency_p99_us": percentile(latencies, 0.99),
        "overlaps": float(_overlaps(turns, reader)),
    }


def process_handoff_metrics(
    holds: Iterable[Hold],
    start: float,
    end: float,
    process_of: Mapping[int, int],
    reader: Callable[[int], bool] | None = None,
) -> dict[str, float]:
    """The handoffs of ``contention_metrics``, told apart by the process of each holder.

    ``process_of`` maps a contender to its process. Latencies as in ``contention_metrics``
    (microseconds, NaN when there is no such handoff):

    - ``cross_process``: share of handoffs whose previous and next holder are in different
      processes.
    - ``cross_p50_us`` / ``cross_p99_us``: release → next holder over those handoffs only.
    - ``local_p50_us``: the same over the handoffs within one process.
    """
    turns = sorted(h for h in holds if start <= h.t_in <= end)
    cross: list[float] = []
    local: list[float] = []
    for prev, nxt in _handoffs(turns, reader):
        latency = (nxt.t_in - prev.t_release) * 1e6
        if process_of[prev.contender] != process_of[nxt.contender]:
            cross.append(latency)
        else:
            local.append(latency)
    handoffs = len(cross) + len(local)
    return {
        "cross_process": len(cross) / handoffs if handoffs else math.nan,
        "cross_p50_us": percentile(cross, 0.50),
        "cross_p99_us": percentile(cross, 0.99),
        "local_p50_us": percentile(local, 0.50),
    }
