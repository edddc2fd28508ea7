"""``results.md`` (targets, then every figure) and ``results.png`` from a ``Results``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .results import Results
from .server import server_section

__all__ = ["TARGETS", "Target", "write_report"]

SELF = "asynclock"
ACQUIRE = "asynclock-acquire"  # asynclock's detached form, measured where it differs
KINDS = (("asynclock-semaphore", "semaphore"), ("asynclock-shared", "shared lease"))
"""asynclock's other kinds in the hand-over scenarios (``peers/asynclock_kinds_peer.py``)."""

#: The two forms of asynclock, one sentence each (above the targets table).
FORMS = (
    "**asynclock** is `async with asynclock.lease(...)`: the lease is held inside the "
    "caller's task, in the block it guards, and the block is cancelled if the lease is lost.",
    "**asynclock acquire()** is `lease = await asynclock.acquire(...)`: the library's "
    "watchdog holds and renews the lease with no task of the caller's until "
    "`await lease.release()`, the shape of aioredlock's `await lock(name)` handle, so the "
    "memory target compares this form with aioredlock.",
)


# -- formatting ----------------------------------------------------------------------------


def _num(value: float, digits: int = 0) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def us(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value >= 10_000:
        return f"{value / 1000:,.1f} ms"
    return f"{value:,.0f} µs" if value >= 100 else f"{value:,.1f} µs"


def rate(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return _num(value, 0 if value >= 100 else 1) + "/s"


def pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 100:.1f}%"


def pct_direct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.1f}%"


def plain(value: float) -> str:
    return _num(value, 0)


def two(value: float) -> str:
    return _num(value, 2)


def three(value: float) -> str:
    return _num(value, 3)


def kib(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.2f} KiB"


def ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.0f} ms"


def secs(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.2f} s"


def ratio(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:,.2f}x" if value < 100 else f"{value:,.0f}x"


# -- targets -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One line of the issue's target table."""

    scenario: str
    what: str
    metric: str
    fmt: Callable[[float], str]
    op: str  # "<=", ">=" or "<"; "report": shown for comparison, not judged
    threshold: float
    target: str
    reference: str | None = None  # peer key: the target is on the in-run ratio to it
    worst: bool = False  # judge the worst run, not the median (counts that must be 0)
    context: str | None = None  # peer key shown beside an absolute target, for comparison
    peer: str = SELF  # the asynclock form measured: SELF (`async with`) or ACQUIRE
    aside: tuple[str, str] | None = None  # (metric, words): a second figure of that form

    def met(self, value: float) -> bool | None:
        if self.op == "report" or math.isnan(value):
            return None
        if self.op == "<=":
            return value <= self.threshold
        if self.op == ">=":
            return value >= self.threshold
        return value < self.threshold


#: The hold targets are judged for both forms of asynclock (see FORMS).
_HOLD_FORMS = ((SELF, "`async with`"), (ACQUIRE, "`acquire()`"))

TARGETS: tuple[Target, ...] = (
    Target("cycle-1", "p50 per cycle", "p50_us", us, "<=", 1.10, "≤ 1.10x raw", "raw"),
    Target("cycle-many", "cycles/s", "cycles_per_s", rate, ">=", 0.9, "≥ 0.9x raw", "raw"),
    Target(
        "handoff-1p",
        "handoffs/s",
        "handoffs_per_s",
        rate,
        ">=",
        1.0,
        "≥ 1.0x python-redis-lock",
        "python-redis-lock",
    ),
    Target(
        "handoff-1p",
        "handoffs/s",
        "handoffs_per_s",
        rate,
        ">=",
        30.0,
        "≥ 30x redis-py default",
        "redispy",
    ),
    Target(
        "handoff-np",
        "release → next holder, p50",
        "latency_p50_us",
        us,
        "<=",
        400,
        "≤ 400 µs",
        context="python-redis-lock",
    ),
    Target(
        "handoff-np",
        "release → next holder, p99",
        "latency_p99_us",
        us,
        "<=",
        1000,
        "≤ 1 ms",
        context="python-redis-lock",
    ),
    Target(
        "handoff-np",
        "cross-process handoffs only, release → next holder p50",
        "cross_p50_us",
        us,
        "report",
        math.nan,
        "report (the targets above count every handoff)",
        context="python-redis-lock",
    ),
    *(
        Target(
            "handoff-1p",
            f"{form} hand-overs/s",
            "handoffs_per_s",
            rate,
            "report",
            math.nan,
            "report (beside python-redis-lock's mutex)",
            "python-redis-lock",
            peer=peer,
        )
        for peer, form in KINDS
    ),
    *(
        Target(
            "handoff-np",
            f"{form}, release → next holder, {what}",
            metric,
            us,
            "report",
            math.nan,
            "report (beside python-redis-lock's mutex)",
            context="python-redis-lock",
            peer=peer,
        )
        for peer, form in KINDS
        for metric, what in (("latency_p50_us", "p50"), ("cross_p50_us", "cross-process p50"))
    ),
    Target("handoff-1p", "releaser retakes", "retake", pct, "<=", 0.10, "≤ 10%", context="redispy"),
    Target("handoff-1p", "Jain index", "jain", three, ">=", 0.99, "≥ 0.99", context="redispy"),
    Target("handoff-np", "releaser retakes", "retake", pct, "<=", 0.10, "≤ 10%", context="redispy"),
    Target("handoff-np", "Jain index", "jain", three, ">=", 0.99, "≥ 0.99", context="redispy"),
    *(
        Target(
            "hold",
            f"leases lost (worst run), {form}",
            "lost",
            plain,
            "<=",
            0,
            "0",
            worst=True,
            context="aioredlock",
            peer=peer,
        )
        for peer, form in _HOLD_FORMS
    ),
    *(
        Target(
            "hold",
            f"CPU, % of one core, {form}",
            "cpu_pct",
            pct_direct,
            "<=",
            10,
            "≤ 10%",
            context="aioredlock",
            peer=peer,
        )
        for peer, form in _HOLD_FORMS
    ),
    *(
        Target(
            "hold",
            f"CPU per renewal, {form}",
            "us_per_renewal",
            us,
            "<=",
            2.0,
            "≤ 2x pipelined renewer",
            "pipelined",
            peer=peer,
        )
        for peer, form in _HOLD_FORMS
    ),
    Target(
        "hold",
        "RSS per held lease, `acquire()`",
        "kib_per_lease",
        kib,
        "<",
        1.0,
        "< aioredlock",
        "aioredlock",
        peer=ACQUIRE,
    ),
    Target(
        "hold",
        "RSS per held lease, `async with` (the caller's task included)",
        "kib_per_lease",
        kib,
        "report",
        math.nan,
        "report (the target above is on `acquire()`)",
        "aioredlock",
        aside=("kib_beyond_tasks", "beyond the caller's task"),
    ),
    Target("burst", "errors (worst run)", "errors", plain, "<=", 0, "none", worst=True),
    Target("burst-pool", "errors (worst run)", "errors", plain, "<=", 0, "none", worst=True),
)


def _value(results: Results, scenario: str, peer: str, metric: str, worst: bool) -> float:
    if not worst:
        return results.median(scenario, peer, metric)
    values = results.values(scenario, peer, metric)
    return max(values) if values else math.nan


def _mark(met: bool | None) -> str:
    return {True: "✅ met", False: "❌ not met", None: "n/a"}[met]


# -- the details tables --------------------------------------------------------------------

Column = tuple[str, str, Callable[[float], str]]  # metric, header, formatter

COLUMNS: dict[str, list[Column]] = {
    "cycle-1": [
        ("p50_us", "p50", us),
        ("p99_us", "p99", us),
        ("cycles_per_s", "cycles/s", rate),
    ],
    "cycle-many": [
        ("cycles_per_s", "cycles/s", rate),
        ("p50_us", "p50", us),
        ("p99_us", "p99", us),
    ],
    "handoff-1p": [
        ("handoffs_per_s", "handoffs/s", rate),
        ("acquisitions_per_s", "acquisitions/s", rate),
        ("latency_p50_us", "release → next p50", us),
        ("latency_p99_us", "p99", us),
        ("retake", "releaser retakes", pct),
        ("jain", "Jain", three),
        ("overlaps", "overlaps", plain),
    ],
    "handoff-np": [
        ("latency_p50_us", "release → next p50", us),
        ("latency_p99_us", "p99", us),
        ("cross_p50_us", "cross-process p50", us),
        ("cross_p99_us", "cross-process p99", us),
        ("local_p50_us", "same-process p50", us),
        ("handoffs_per_s", "handoffs/s", rate),
        ("retake", "releaser retakes", pct),
        ("jain", "Jain", three),
        ("cross_process", "cross-process handoffs", pct),
        ("overlaps", "overlaps", plain),
    ],
    "hold": [
        ("cpu_pct", "CPU % of a core", pct_direct),
        ("us_per_renewal", "CPU per renewal", us),
        ("renewals_per_s", "renewals/s", rate),
        ("kib_per_lease", "RSS per lease", kib),
        ("kib_beyond_tasks", "RSS per lease beyond the caller's task", kib),
        ("lost", "lost", plain),
        ("acquire_s", "time to acquire all", secs),
        ("clients", "server connections", plain),
    ],
    "burst": [
        ("acquire_ms", "all settled after", ms),
        ("held", "held", plain),
        ("errors", "errors", plain),
        ("total_ms", "all released after", ms),
        ("clients", "server connections", plain),
    ],
}
COLUMNS["burst-pool"] = COLUMNS["burst"]

EXPLAIN: dict[str, str] = {
    "cycle-1": (
        "One task enters and leaves the lock in a loop (no other traffic); latency of each "
        "`acquire + release` cycle. asynclock runs with its watchdog on (started and "
        "stopped in every cycle). The peers of a run are measured together: all their "
        "sessions open, they take turns in short blocks (the window cut in `cycle_blocks`, "
        "the order reversed every other block), so that the machine's drift within a run "
        "falls on all of them alike."
    ),
    "cycle-many": (
        "Every task loops on its own lock name, all sharing one client (threads and one "
        "sync client for python-redis-lock); total cycles per second."
    ),
    "handoff-1p": (
        "Contenders share one client and loop on one lock, going straight back after each "
        "release (empty body). A handoff is a turn taken by a different contender than the "
        "previous one; *releaser retakes* is the share of turns where the releaser got the "
        "lock again at once; Jain's index is over the turns of each contender; *overlaps* "
        "counts turns that began before the previous holder's release call (must be 0)."
    ),
    "handoff-np": (
        "The same loop with the contenders split over separate processes (one client each). "
        "Latency runs from the `time.monotonic()` stamp just before the holder's release call "
        "to the stamp right after the next (different) holder's acquire returned. "
        "*Cross-process p50/p99* count only the handoffs to a holder in another process, "
        "*same-process p50* only those within one process: a lock that hands over within "
        "its own client first has a lower overall p50 without being faster across "
        "processes, so compare the cross-process figures too."
    ),
    "hold": (
        "A fresh child process takes the leases (64 acquisitions in flight) and holds them; "
        "over the window it measures its own CPU time (`time.process_time()`) and the "
        "renewals the server ran (`INFO commandstats`, EVALSHA + EVAL). CPU per renewal = "
        "CPU seconds / renewals. RSS per lease = (RSS after acquiring all - RSS before) / N, "
        "from /proc/self/statm. Lost = max(leases the peer reported lost, keys gone at the end). "
        "Renewal periods differ: asynclock (both forms) and the pipelined renewer renew every "
        "ttl/3, aioredlock every 0.6 x ttl, so its CPU share covers fewer renewals; compare the "
        "CPU per renewal. asynclock is measured in both its forms (see the targets): its "
        "`async with` form holds each lease inside a task of the caller's, so its RSS per "
        "lease includes that task, which any worker doing the guarded work would have anyway; "
        "*RSS per lease beyond the caller's task* subtracts the RSS per task of the same "
        "holder tasks without a lease, measured in another fresh child. The other peers "
        "(asynclock acquire(), aioredlock, the pipelined renewer) hold leases without a task "
        "of the caller's, so for them it is their RSS per lease. The lost count of asynclock "
        "acquire() is its leases in state `LOST`."
    ),
    "burst": (
        "All leases (distinct names) are requested at once from one client built with the "
        "library defaults (one thread each for python-redis-lock, sharing one sync client); "
        "held until every request has settled (held or failed), then released. redis-py 8's "
        "default pool has 100 connections and raises `MaxConnectionsError` beyond them "
        "(aioredis 1.x, under aioredlock, queues instead). *Server connections* is "
        "`connected_clients` while all are held."
    ),
    "burst-pool": (
        "The same burst with `max_connections` set so that every request can have a "
        "connection (aioredlock keeps its own pool of 100, which queues)."
    ),
}


def write_report(results: Results, folder: Path) -> list[Path]:
    """Write ``results.md`` and ``results.png`` into ``folder``; returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    png = folder / "results.png"
    chart_note = ""
    try:
        from .chart import plot

        plot(results, png)
        written.append(png)
    except ImportError as exc:
        chart_note = f"(no chart: {exc}; `pip install -e '.[bench]'`)"
    md = folder / "results.md"
    md.write_text(markdown(results, png.name if not chart_note else None, chart_note))
    written.append(md)
    return written


def markdown(results: Results, chart: str | None, chart_note: str = "") -> str:
    p = results.profile
    env = results.environment
    runs = p["runs"]
    fewer = [
        f"{p[key]} for the {what}"
        for key, what in (("hold_runs", "held leases"), ("burst_runs", "bursts"))
        if p.get(key, runs) != runs
    ]
    lines = [
        "# asynclock benchmarks",
        "",
        f"Generated by `python -m benchmarks{' --quick' if results.mode == 'quick' else ''}` "
        f"on {results.started}; the whole run took **{_duration(results.duration_s)}**.",
        "",
        f"Mode **{results.mode}**: figures are medians of {runs} run(s)"
        + (f" ({', '.join(fewer)})" if fewer else "")
        + ". Every ratio is *asynclock ÷ peer* taken within one run, against the same "
        "server, and the median of those in-run ratios is shown.",
    ]
    if results.interrupted:
        lines += ["", "> **Interrupted** (Ctrl-C): only the measurements made before are shown."]
    if results.mode == "quick":
        lines += [
            "",
            f"> Quick mode: shorter windows (cycles {p['cycle']:g} s, contention "
            f"{p['contend']:g} s) and **{p['hold_leases']:,} leases held for "
            f"{p['hold_window']:g} s** instead of 10,000 for 30 s, bursts run once; run "
            "`python -m benchmarks` for the full figures.",
        ]
    lines += [
        "",
        "## Setup",
        "",
        "| | |",
        "|---|---|",
        f"| machine | {env['cpu']}, {env['cpu_count']} CPUs, Linux {env['kernel']} |",
        f"| CPU pinning | {results.pinning} |",
        f"| machine load | {env.get('load', 'not recorded')} (other work on the machine skews "
        "the figures) |",
        f"| server | {env['server']}, private, loopback, no persistence |",
        f"| asynclock source | {env.get('source', 'not recorded')} |",
        f"| client side | Python {env['python']}, redis-py {env['redis-py']}, "
        f"hiredis {env['hiredis']}, anyio {env['anyio']} |",
        "",
        "| peer | version | configured as |",
        "|---|---|---|",
    ]
    for entry in results.peers:
        config = entry.config if not entry.skipped else f"**skipped**: {entry.skipped}"
        lines.append(f"| {entry.label} | {entry.version} | {config} |")

    lines += ["", "## Targets", ""]
    if chart:
        lines += [f"![benchmark chart]({chart})", ""]
    elif chart_note:
        lines += [chart_note, ""]
    if "hold" in results.scenarios:
        lines += ["Two forms of asynclock are measured holding many leases. " + " ".join(FORMS), ""]
    lines += [
        "| scenario | figure | asynclock | reference | asynclock ÷ reference | target | |",
        "|---|---|---|---|---|---|---|",
    ]
    for target in TARGETS:
        if target.scenario not in results.scenarios:
            continue
        if target.peer in dict(KINDS) and target.peer not in results.measured(target.scenario):
            continue  # (a run without asynclock's other kinds)
        mine = _value(results, target.scenario, target.peer, target.metric, target.worst)
        shown = target.fmt(mine)
        if target.aside is not None:
            metric, words = target.aside
            aside = _value(results, target.scenario, target.peer, metric, target.worst)
            shown += f" ({words}: {target.fmt(aside)})"
        if target.reference is None:
            reference, shown_ratio, judged = "", "", mine
            # A peer measured without this figure (results.json from before it was
            # added) shows n/a; a peer not measured at all shows nothing.
            if target.context is not None and target.context in results.measured(target.scenario):
                theirs = _value(
                    results, target.scenario, target.context, target.metric, target.worst
                )
                reference = f"{results.label(target.context)}: {target.fmt(theirs)}"
        else:
            theirs = _value(results, target.scenario, target.reference, target.metric, False)
            in_run = results.ratio(target.scenario, target.peer, target.reference, target.metric)
            reference = f"{results.label(target.reference)}: {target.fmt(theirs)}"
            shown_ratio, judged = ratio(in_run), in_run
        title = results.titles[target.scenario]
        mark = "—" if target.op == "report" else _mark(target.met(judged))
        lines.append(
            f"| {title} | {target.what} | {shown} | {reference} | {shown_ratio} "
            f"| {target.target} | {mark} |"
        )

    if results.server_us:
        section = server_section(
            results.server_us, results.server_commands, results.server_thread, results.server_rounds
        )
        lines += ["", "## Server time per cycle", "", *section]

    lines += ["", "## All figures", ""]
    for scenario in results.scenarios:
        lines += _details(results, scenario)

    problems = _problems(results)
    if problems:
        lines += ["## Skipped and failed", "", *problems, ""]
    return "\n".join(lines).rstrip() + "\n"


def _details(results: Results, scenario: str) -> list[str]:
    from .scenarios import get_scenario

    columns = COLUMNS[scenario]
    headline = get_scenario(scenario).headline
    head_label = next(h for m, h, _ in columns if m == headline)
    lines = [f"### {results.titles[scenario]}", "", EXPLAIN[scenario], ""]
    header = ["peer", *(h for _, h, _ in columns), f"asynclock ÷ peer ({head_label})"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for peer in results.measured(scenario):
        cells = [results.label(peer)]
        for metric, _, fmt in columns:
            cells.append(fmt(results.median(scenario, peer, metric)))
        cells.append("—" if peer == SELF else ratio(results.ratio(scenario, SELF, peer, headline)))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"{results.label(r.peer)}, run {r.run + 1}: {r.note}"
        for r in results.records
        if r.scenario == scenario and r.note
    ]
    family = results.families[scenario]
    for entry in results.peers:
        if not entry.skipped and family in entry.unsupported:
            notes.append(f"{entry.label}: not run ({entry.unsupported[family]})")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    lines.append("")
    return lines


def _problems(results: Results) -> list[str]:
    lines = [f"- **{e.label}** skipped: {e.skipped}" for e in results.peers if e.skipped]
    for record in results.errors():
        lines.append(
            f"- **{results.label(record.peer)}**, {record.scenario}, run {record.run + 1} "
            f"failed: `{record.error[:300]}`"
        )
    return lines


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{rest} s"
