"""The scenarios, each written once against the peer interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import Profile
from ..peers import BURST, CONTEND, CYCLE, HOLD, Peer
from .common import Context, Measurement
from .contend import handoff_one_process, handoff_processes
from .cycle import cycle_many, cycle_one_together
from .hold import burst, burst_pool, burst_pool_size, hold_many

__all__ = ["SCENARIOS", "Context", "Measurement", "Scenario", "get_scenario"]


@dataclass(frozen=True)
class Scenario:
    key: str
    family: str
    # measures one peer; None for a scenario whose peers are measured ``together``
    measure: Callable[[Peer, Context], Measurement] | None
    title: Callable[[Profile], str]
    headline: str  # the metric shown in progress lines and compared first
    higher_is_better: bool
    # measures every peer of a run together (taking turns) instead of one after another
    together: Callable[[list[Peer], Context], dict[str, Measurement | Exception]] | None = None

    def runs(self, profile: Profile) -> int:
        if self.family == HOLD:
            return profile.hold_runs
        if self.family == BURST:
            return profile.burst_runs
        return profile.runs


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "cycle-1",
        CYCLE,
        None,
        lambda p: "Uncontended acquire + release, 1 task",
        "p50_us",
        higher_is_better=False,
        together=cycle_one_together,
    ),
    Scenario(
        "cycle-many",
        CYCLE,
        cycle_many,
        lambda p: f"Uncontended acquire + release, {p.cycle_workers} tasks on distinct names",
        "cycles_per_s",
        higher_is_better=True,
    ),
    Scenario(
        "handoff-1p",
        CONTEND,
        handoff_one_process,
        lambda p: f"Handoff, {p.contenders} contenders in 1 process",
        "handoffs_per_s",
        higher_is_better=True,
    ),
    Scenario(
        "handoff-np",
        CONTEND,
        handoff_processes,
        lambda p: f"Handoff, {p.contenders} contenders in {p.contend_processes} processes",
        "latency_p50_us",
        higher_is_better=False,
    ),
    Scenario(
        "hold",
        HOLD,
        hold_many,
        lambda p: (
            f"{p.hold_leases:,} leases held at once, ttl {p.hold_ttl:g} s, for {p.hold_window:g} s"
        ),
        "us_per_renewal",
        higher_is_better=False,
    ),
    Scenario(
        "burst",
        BURST,
        burst,
        lambda p: f"{p.burst_leases:,} leases acquired at once, default client (pool of 100)",
        "acquire_ms",
        higher_is_better=False,
    ),
    Scenario(
        "burst-pool",
        BURST,
        burst_pool,
        lambda p: (
            f"{p.burst_leases:,} leases acquired at once, client pool of "
            f"{burst_pool_size(p.burst_leases):,}"
        ),
        "acquire_ms",
        higher_is_better=False,
    ),
)


def get_scenario(key: str) -> Scenario:
    for scenario in SCENARIOS:
        if scenario.key == key:
            return scenario
    raise KeyError(f"unknown scenario {key!r}; known: {', '.join(s.key for s in SCENARIOS)}")
