"""``results.png``: one panel per figure, asynclock highlighted, targets as dashed lines.

asynclock's two forms are both highlighted; the memory panel's target line (aioredlock) is
the target of its ``acquire()`` form (see ``report.FORMS``).

Needs matplotlib (the ``bench`` extra); importing this module raises ImportError without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import NullFormatter, ScalarFormatter

from .results import Results

__all__ = ["plot"]

SELF = "asynclock"
SELF_COLOR = "#d62728"
#: asynclock's forms, each highlighted: `async with` in red, `acquire()` in orange.
SELF_COLORS = {
    SELF: SELF_COLOR,
    "asynclock-acquire": "#ff7f0e",
    "asynclock-semaphore": "#e377c2",
    "asynclock-shared": "#bcbd22",
}
PEER_COLOR = "#7f93b2"
SECOND_ALPHA = 0.45


@dataclass(frozen=True)
class Panel:
    scenario: str
    metrics: tuple[str, ...]  # one bar per metric per peer (the first is solid)
    legend: tuple[str, ...]
    title: str
    unit: str
    scale: float = 1.0  # value shown = value * scale
    log: bool = False
    lower_is_better: bool = True
    worst: bool = False  # show the worst run (max) instead of the median


PANELS: tuple[Panel, ...] = (
    Panel("cycle-1", ("p50_us",), (), "Uncontended cycle, 1 task: p50", "µs"),
    Panel(
        "cycle-many",
        ("cycles_per_s",),
        (),
        "Uncontended cycles, many tasks",
        "cycles/s",
        lower_is_better=False,
    ),
    Panel(
        "handoff-1p",
        ("handoffs_per_s",),
        (),
        "Handoffs between holders, 1 process",
        "handoffs/s (log)",
        log=True,
        lower_is_better=False,
    ),
    Panel(
        "handoff-np",
        ("latency_p50_us", "latency_p99_us"),
        ("p50", "p99"),
        "Release → next holder, processes",
        "µs (log)",
        log=True,
    ),
    Panel(
        "handoff-1p",
        ("retake",),
        (),
        "Releaser retakes the lock, 1 process",
        "% of turns",
        scale=100,
    ),
    Panel(
        "handoff-np",
        ("retake",),
        (),
        "Releaser retakes the lock, processes",
        "% of turns",
        scale=100,
    ),
    Panel("hold", ("cpu_pct",), (), "Holding many leases: CPU", "% of one core"),
    Panel("hold", ("us_per_renewal",), (), "Holding many leases: CPU per renewal", "µs"),
    Panel(
        "hold",
        ("kib_per_lease",),
        (),
        "Holding many leases: RSS per lease (target: acquire() < aioredlock)",
        "KiB",
    ),
    Panel(
        "hold", ("lost",), (), "Holding many leases: leases lost, worst run", "leases", worst=True
    ),
    Panel("burst", ("errors",), (), "Burst on a default client: failed requests", "requests"),
    Panel("burst-pool", ("acquire_ms",), (), "Burst, pool sized for it: all settled after", "ms"),
)

# (scenario, metric) -> target line: (value or a function of the results, label)
_TARGET_LINES = {
    ("cycle-1", "p50_us"): ("raw", 1.10, "1.10x raw"),
    ("cycle-many", "cycles_per_s"): ("raw", 0.9, "0.9x raw"),
    ("handoff-1p", "handoffs_per_s"): ("python-redis-lock", 1.0, "python-redis-lock"),
    ("hold", "us_per_renewal"): ("pipelined", 2.0, "2x pipelined"),
    ("hold", "kib_per_lease"): ("aioredlock", 1.0, "aioredlock"),
}
_ABSOLUTE_LINES = {
    ("handoff-np", "latency_p50_us"): (400.0, "p50 target"),
    ("handoff-np", "latency_p99_us"): (1000.0, "p99 target"),
    ("handoff-1p", "retake"): (10.0, "target"),
    ("handoff-np", "retake"): (10.0, "target"),
    ("hold", "cpu_pct"): (10.0, "target"),
}


def plot(results: Results, path: Path) -> None:
    panels = [p for p in PANELS if p.scenario in results.scenarios and results.measured(p.scenario)]
    if not panels:
        return
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.1 * rows + 0.9), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        _panel(ax, results, panel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    env = results.environment
    runs = results.profile["runs"]
    fig.suptitle(
        f"asynclock vs. peers: {results.mode} run, medians of {runs} runs (whiskers: min to max); "
        f"{env['server']}; {env.get('pinning_short', '')}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _panel(ax: Axes, results: Results, panel: Panel) -> None:
    peers = results.measured(panel.scenario)
    labels = [results.label(p) for p in peers]
    count = len(panel.metrics)
    height = 0.8 / count
    for index, metric in enumerate(panel.metrics):
        medians, low, high = [], [], []
        for peer in peers:
            if panel.worst:
                runs = results.values(panel.scenario, peer, metric)
                value = (max(runs) if runs else math.nan) * panel.scale
            else:
                value = results.median(panel.scenario, peer, metric) * panel.scale
            lo, hi = results.spread(panel.scenario, peer, metric)
            medians.append(value)
            low.append(max(0.0, value - lo * panel.scale) if not math.isnan(lo) else 0.0)
            high.append(max(0.0, hi * panel.scale - value) if not math.isnan(hi) else 0.0)
        positions = [y + (index - (count - 1) / 2) * height for y in range(len(peers))]
        colors = [SELF_COLORS.get(p, PEER_COLOR) for p in peers]
        bars = ax.barh(
            positions,
            [0.0 if math.isnan(v) else v for v in medians],
            height=height * 0.9,
            color=colors,
            alpha=1.0 if index == 0 else SECOND_ALPHA,
            xerr=None if panel.worst else [low, high],
            error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "#333333"},
            label=panel.legend[index] if panel.legend else None,
        )
        for bar, value in zip(bars, medians, strict=True):
            if not math.isnan(value):
                ax.annotate(
                    _short(value),
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    xytext=(3, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=7,
                )
        _target_line(ax, results, panel, metric)
    ax.set_yticks(range(len(peers)), labels, fontsize=8)
    ax.invert_yaxis()
    if panel.log:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    better = "lower is better" if panel.lower_is_better else "higher is better"
    ax.set_title(f"{panel.title} ({better})", fontsize=9)
    ax.set_xlabel(panel.unit, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.margins(x=0.15)
    if panel.legend or ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best", framealpha=0.9)


def _target_line(ax: Axes, results: Results, panel: Panel, metric: str) -> None:
    relative = _TARGET_LINES.get((panel.scenario, metric))
    if relative is not None:
        reference, factor, label = relative
        value = results.median(panel.scenario, reference, metric)
        if not math.isnan(value):
            ax.axvline(value * factor * panel.scale, ls="--", lw=1, color="#2ca02c", label=label)
    absolute = _ABSOLUTE_LINES.get((panel.scenario, metric))
    if absolute is not None:
        value, label = absolute
        ax.axvline(value, ls="--", lw=1, color="#2ca02c", label=label)


def _short(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:,.1f}k"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"
