"""How long and how big each scenario runs, in the quick and the full mode."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["FULL", "QUICK", "Profile"]


@dataclass(frozen=True)
class Profile:
    name: str
    runs: int  # runs of every scenario; figures are medians over them
    warmup: float  # seconds of unrecorded cycles before each cycle measurement
    cycle: float  # seconds of the uncontended cycle, 1 worker, per peer
    cycle_blocks: int  # blocks the 1-worker window is cut into, the peers taking turns
    cycle_many: float  # seconds of the uncontended cycle, `cycle_workers` workers
    cycle_workers: int
    contend: float  # seconds of a contention measurement (after `contend_warmup`)
    contend_warmup: float
    contenders: int
    contend_processes: int  # processes of the cross-process handoff (contenders split)
    hold_leases: int
    hold_ttl: float
    hold_window: float  # seconds over which CPU and renewals are measured
    hold_runs: int  # runs of the hold scenario (it is the longest)
    hold_concurrency: int  # acquisitions in flight while taking the held leases
    burst_leases: int
    burst_runs: int
    max_ops: int = 10_000_000  # per worker: a bound that no timed loop should reach

    def describe(self) -> dict[str, object]:
        return asdict(self)


QUICK = Profile(
    name="quick",
    runs=3,
    warmup=0.15,
    cycle=0.3,
    cycle_blocks=3,
    cycle_many=0.3,
    cycle_workers=16,
    contend=0.4,
    contend_warmup=0.15,
    contenders=8,
    contend_processes=2,
    hold_leases=2_000,
    hold_ttl=3.0,
    hold_window=4.0,  # still longer than the ttl: every lease must be renewed to survive
    hold_runs=1,
    hold_concurrency=64,
    burst_leases=1_000,
    burst_runs=1,
)

FULL = Profile(
    name="full",
    runs=3,
    warmup=0.5,
    cycle=3.0,
    cycle_blocks=10,
    cycle_many=3.0,
    cycle_workers=16,
    contend=4.0,
    contend_warmup=0.5,
    contenders=8,
    contend_processes=2,
    hold_leases=10_000,
    hold_ttl=3.0,
    hold_window=30.0,
    hold_runs=3,
    hold_concurrency=64,
    burst_leases=1_000,
    burst_runs=3,
)
