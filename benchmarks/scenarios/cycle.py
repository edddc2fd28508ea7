"""Uncontended ``acquire + release`` cycles: 1 worker, and 16 workers on distinct names."""

from __future__ import annotations

from ..drive import CycleResult, cycle_async, cycle_threads
from ..peers import AsyncSession, Peer, SyncSession
from ..stats import percentile
from .common import Context, Measurement, in_session

__all__ = ["cycle_many", "cycle_one"]


def _cycles(peer: Peer, ctx: Context, names: list[str], duration: float) -> CycleResult:
    p = ctx.profile

    async def run_async(session: AsyncSession) -> CycleResult:
        return await cycle_async(session, names, p.warmup, duration, p.max_ops)

    def run_threads(session: SyncSession) -> CycleResult:
        return cycle_threads(session, names, p.warmup, duration, p.max_ops)

    return in_session(peer, ctx.url, run_async, run_threads)


def _figures(result: CycleResult) -> dict[str, float]:
    latencies = [s * 1e6 for s in result.latencies]
    return {
        "p50_us": percentile(latencies, 0.50),
        "p99_us": percentile(latencies, 0.99),
        "cycles_per_s": result.throughput,
        "cycles": float(len(latencies)),
    }


def cycle_one(peer: Peer, ctx: Context) -> Measurement:
    """One worker: ``async with lock(name): pass`` in a loop; latency per cycle."""
    result = _cycles(peer, ctx, [ctx.name(peer, "cycle-1")], ctx.profile.cycle)
    return Measurement(_figures(result))


def cycle_many(peer: Peer, ctx: Context) -> Measurement:
    """``cycle_workers`` workers (tasks, or threads), each on its own name; total rate."""
    base = ctx.name(peer, "cycle-many")
    names = [f"{base}:{i}" for i in range(ctx.profile.cycle_workers)]
    result = _cycles(peer, ctx, names, ctx.profile.cycle_many)
    return Measurement(_figures(result))
