"""The soak: ``python -m chaos --soak MINUTES`` rotates every mode for the time given.

Each run is an ordinary chaos run (:func:`~chaos._run.run_chaos`) of one mode, in turn:
the mutex, the semaphore (2 locks of 2 permits), the shared mode (half the rounds shared),
the fair mode (one lock), the failover mode (``min_replicas=1``), the Redlock mode (three
servers), the jobs mode (``once()``), the cluster mode (``min_replicas=1``) and the job
sub-modes (``chaos._jobs``: fenced effects, ``every()``, ``asynclock run``); every second
pass holds half its rounds with ``acquire()``, ``guard()`` and ``release()`` instead of
``async with`` (``--detached 0.5``), so both lease forms are soaked (the sub-modes hold
no lease of their own: never detached). Run ``i`` has seed ``seed + i``; a run lasts
``MINUTES / len(MODES)`` clamped to 15-60 s, and no run starts that would end past the
time given (the last one is shortened, down to 15 s). One table is printed at the end:
per mode, runs, faults by kind, acquisitions, losses and every must-be-0 figure summed,
then the replay command of every run that failed (whose work directory is kept).

Design note: runs are sequential, each in its own event loop (``asyncio.run``), so a run
that could not be carried out (exit 2 of a single run) is counted and the soak goes on;
Ctrl-C or SIGTERM stops the run in progress cleanly and prints the table of what ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from ._run import ChaosConfig, run_chaos
from ._summary import Summary

__all__ = ["MODES", "ModeTotals", "plan", "render_table", "soak"]

MODES: Final[tuple[tuple[str, Mapping[str, Any]], ...]] = (
    ("mutex", {}),
    ("semaphore", {"locks": 2, "limit": 2}),
    ("shared", {"shared": 0.5}),
    ("fair", {"fair": True, "locks": 1}),
    ("failover", {"failover": True, "min_replicas": 1}),
    ("redlock", {"redlock": 3}),
    ("jobs", {"jobs": True}),
    ("cluster", {"cluster": True, "min_replicas": 1}),
    ("jobs-fenced", {"jobs_mode": "fenced"}),
    ("jobs-every", {"jobs_mode": "every"}),
    ("jobs-run", {"jobs_mode": "run"}),
)
"""The modes a soak rotates, in order, with the options each run of them gets."""

_RUN_SECONDS: Final = (15.0, 60.0)  # shortest and longest run of a soak
_OVERHEAD: Final = 3.0  # seconds a run takes beyond its length (start, stop, checks)

Runner = Callable[[ChaosConfig], "tuple[Summary, Path] | str"]
"""Runs one chaos run: its summary and work directory, or why it could not be carried out."""


def plan(seed: int, minutes: float, base: ChaosConfig | None = None) -> list[ChaosConfig]:
    """The runs of a soak of ``minutes`` from ``seed``, in order (see the module doc).

    ``base`` gives the options every run shares (workers, tasks, ttl, engine, keep).
    """
    total = minutes * 60.0
    length = min(max(total / len(MODES), _RUN_SECONDS[0]), _RUN_SECONDS[1])
    base = ChaosConfig(seed=seed) if base is None else base
    runs: list[ChaosConfig] = []
    used = 0.0
    while used + _RUN_SECONDS[0] + _OVERHEAD <= total + 1e-9:
        index = len(runs)
        _, options = MODES[index % len(MODES)]
        seconds = min(length, total - used - _OVERHEAD)
        detached = 0.5 if (index // len(MODES)) % 2 and "jobs_mode" not in options else 0.0
        runs.append(
            dataclasses.replace(
                base,
                seed=seed + index,
                seconds=math.floor(seconds * 10) / 10,
                detached=detached,
                **options,
            )
        )
        used += seconds + _OVERHEAD
    return runs


_MUST_BE_0: Final = (
    ("overlap", "overlaps not paused"),
    ("stale", "stale fenced writes accepted"),
    ("counters", "counter mismatches"),
    ("fencing", "fencing order violations"),
    ("keys", "keys left"),
    ("died", "workers died or unexpected errors"),
    ("release", "not_owner at release unexplained or late"),
    (
        "own",
        "the mode's own: double grants (failover), starved writers (shared), grants out "
        "of order and slow handovers (fair), overlaps after one server's data loss longer "
        "than a TTL (redlock), job results stored twice (jobs; in jobs-fenced also effects "
        "applied twice and callers given two effects), ticks run twice (jobs-every), leases "
        "lost to a slot migration and double grants across a failover (cluster)",
    ),
)


@dataclasses.dataclass(slots=True)
class ModeTotals:
    """What the runs of one mode added up to."""

    mode: str
    runs: int = 0
    failed: int = 0
    not_carried_out: int = 0
    seconds: float = 0.0
    faults: Counter[str] = dataclasses.field(default_factory=Counter)
    acquisitions: int = 0
    losses: Counter[str] = dataclasses.field(default_factory=Counter)
    must_be_0: Counter[str] = dataclasses.field(default_factory=Counter)
    seeds: list[int] = dataclasses.field(default_factory=list)

    def add(self, config: ChaosConfig, result: tuple[Summary, Path] | str) -> None:
        self.runs += 1
        self.seeds.append(config.seed)
        if isinstance(result, str):
            self.not_carried_out += 1
            self.failed += 1
            return
        data = result[0].data
        self.failed += not result[0].ok
        self.seconds += float(data.get("seconds", 0.0))
        self.faults.update(data.get("faults", {}).get("by_kind", {}))
        self.acquisitions += int(data.get("acquisitions", {}).get("total", 0))
        self.losses.update(data.get("lock_lost", {}).get("by_reason", {}))
        self.must_be_0.update(_must_be_0(data))


def _must_be_0(data: Mapping[str, Any]) -> dict[str, int]:
    at_release = data.get("not_owner_at_release", {})
    own = 0
    if data.get("min_replicas"):
        own += int(data.get("double_grants_across_failover", 0))
    own += int(data.get("shared", {}).get("starved_writers", 0))
    fair = data.get("fair", {})
    own += int(fair.get("out_of_order", 0))
    own += int(fair.get("free_while_waiting", {}).get("over_bound", 0))
    own += int(data.get("redlock_long_overlaps", 0))
    own += int(data.get("jobs", {}).get("stored_twice", 0))
    own += int(data.get("cluster", {}).get("lost_to_migration", 0))
    return {
        "overlap": int(data.get("overlap", {}).get("unpaused", {}).get("count", 0)),
        "stale": int(data.get("fenced_writes", {}).get("stale_accepted", 0)),
        "counters": int(data.get("counter_mismatches", 0)),
        "fencing": int(data.get("fencing_order_violations", 0)),
        "keys": len(data.get("keys_left", ())),
        "died": len(data.get("workers_died", ())) + int(data.get("unexpected_errors", 0)),
        "release": int(at_release.get("answered_late", 0)) + int(at_release.get("unexplained", 0)),
        "own": own,
    }


def _counts(counter: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items()) if v) or "none"


def render_table(totals: Sequence[ModeTotals]) -> list[str]:
    """The soak's table (Markdown), one row per mode, then the legend of its columns."""
    heads = ["mode", "runs (failed)", "s", "faults by kind", "acquisitions", "LockLost"]
    heads += [key for key, _ in _MUST_BE_0]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for t in totals:
        cells = [
            t.mode,
            f"{t.runs} ({t.failed})",
            f"{t.seconds:.0f}",
            f"{sum(t.faults.values())}: {_counts(t.faults)}",
            str(t.acquisitions),
            f"{sum(t.losses.values())}: {_counts(t.losses)}",
        ]
        cells += [str(t.must_be_0.get(key, 0)) for key, _ in _MUST_BE_0]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("must be 0: " + "; ".join(f"{key} = {what}" for key, what in _MUST_BE_0))
    return lines


def _run_one(config: ChaosConfig) -> tuple[Summary, Path] | str:
    async def main() -> tuple[Summary, Path]:
        task = asyncio.current_task()
        assert task is not None
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run_chaos(config, log=io.StringIO())

    try:
        return asyncio.run(main())
    except RuntimeError as exc:
        return str(exc)


def soak(
    seed: int,
    minutes: float,
    base: ChaosConfig | None = None,
    *,
    runner: Runner = _run_one,
    out: TextIO | None = None,
    as_json: bool = False,
) -> int:
    """Run the soak (see the module doc); print a line per run and the table at the end.

    Returns the exit status: 0 when every run passed, 1 when one failed or could not be
    carried out, 130 when interrupted (the table of the runs done is printed first).
    """
    out = sys.stdout if out is None else out
    runs = plan(seed, minutes, base)
    print(
        f"asynclock chaos soak: seed {seed}, {minutes:g} min, {len(runs)} runs rotating "
        f"{', '.join(name for name, _ in MODES)} (replay: python -m chaos --soak {minutes:g} "
        f"--seed {seed})",
        file=out,
        flush=True,
    )
    totals = {name: ModeTotals(name) for name, _ in MODES}
    failed: list[str] = []
    started = time.monotonic()
    status = 0
    for index, config in enumerate(runs):
        mode = MODES[index % len(MODES)][0]
        try:
            result = runner(config)
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("interrupted: the run in progress was stopped", file=out, flush=True)
            status = 130
            break
        totals[mode].add(config, result)
        if isinstance(result, str):
            verdict = f"could not be carried out: {result}"
            failed.append(f"{config.replay()}  # {verdict}")
        elif result[0].ok:
            verdict = "OK"
        else:
            verdict = "FAILED: " + "; ".join(result[0].failures)
            failed.append(f"{config.replay()}  # files kept in {result[1]}")
        print(
            f"  run {index + 1}/{len(runs)} {mode} seed {config.seed} {config.seconds:g} s"
            f"{' detached 0.5' if config.detached else ''}: {verdict}",
            file=out,
            flush=True,
        )
    elapsed = time.monotonic() - started
    print("", *render_table(list(totals.values())), sep="\n", file=out)
    print(f"wall time {elapsed / 60:.1f} min", file=out)
    if failed:
        print("failed runs (replay):", *(f"  {line}" for line in failed), sep="\n", file=out)
    elif status == 0:
        print("OK: every run passed every check", file=out)
    if as_json:
        data = {
            "seed": seed,
            "minutes": minutes,
            "runs": sum(t.runs for t in totals.values()),
            "failed": failed,
            "modes": {
                t.mode: {
                    "runs": t.runs,
                    "failed": t.failed,
                    "seconds": round(t.seconds, 1),
                    "seeds": t.seeds,
                    "faults": dict(t.faults),
                    "acquisitions": t.acquisitions,
                    "lock_lost": dict(t.losses),
                    "must_be_0": dict(t.must_be_0),
                }
                for t in totals.values()
            },
        }
        print(json.dumps(data, separators=(",", ":")), file=out)
    out.flush()
    if status:
        return status
    return 1 if failed else 0
