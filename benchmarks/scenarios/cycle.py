"""Uncontended ``acquire + release`` cycles: 1 worker, and 16 workers on distinct names.

The 1-worker cycle is the figure most exposed to the machine's drift: on a VM its speed
moves by tens of percent within seconds, and a peer measured a few seconds after another
can come out 20% faster or slower with the same code (seen in one run: asynclock ÷ raw
0.84x, 0.95x and 1.26x in three runs minutes apart). So its peers are measured together
(``cycle_one_together``): every peer's session is open at once, and they take turns in
``cycle_blocks`` short blocks, in an order reversed every other block, so that drift
falls on all of them alike. The 16-worker cycle measures throughput over its window and
keeps one window per peer.
"""

from __future__ import annotations

import asyncio

from ..drive import CycleResult, cycle_async, cycle_threads
from ..peers import AsyncPeer, AsyncSession, Peer, SyncSession, ThreadPeer
from ..stats import percentile
from .common import Context, Measurement, in_session

__all__ = ["cycle_many", "cycle_one_together"]

_BLOCK_WARMUP = 0.02  # seconds of unrecorded cycles before each block (after a warm-up)


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


def cycle_one_together(peers: list[Peer], ctx: Context) -> dict[str, Measurement | Exception]:
    """Every peer's 1-worker cycle in turns (see the module's note): the figures of each
    peer from all its blocks, or the error that stopped it (it then takes no more turns)."""
    return asyncio.run(_together(peers, ctx))


async def _together(peers: list[Peer], ctx: Context) -> dict[str, Measurement | Exception]:
    p = ctx.profile
    block = p.cycle / p.cycle_blocks
    outcome: dict[str, Measurement | Exception] = {}
    sessions: dict[str, AsyncSession | SyncSession] = {}
    results = {peer.key: CycleResult() for peer in peers}

    async def turn(peer: Peer, warmup: float, length: float) -> None:
        session = sessions[peer.key]
        names = [ctx.name(peer, "cycle-1")]
        if isinstance(session, AsyncSession):
            part = await cycle_async(session, names, warmup, length, p.max_ops)
        else:  # (a thread peer blocks this loop meanwhile: nothing else runs on it)
            part = cycle_threads(session, names, warmup, length, p.max_ops)
        results[peer.key].latencies.extend(part.latencies)
        results[peer.key].elapsed += part.elapsed

    try:
        for peer in peers:
            try:
                if isinstance(peer, AsyncPeer):
                    sessions[peer.key] = await peer.open(ctx.url)
                elif isinstance(peer, ThreadPeer):
                    sessions[peer.key] = peer.open(ctx.url)
                else:
                    raise TypeError(f"{peer!r} is neither an AsyncPeer nor a ThreadPeer")
                await turn(peer, p.warmup, 0.0)  # (connect, load scripts, warm up)
                results[peer.key] = CycleResult()
            except Exception as exc:
                outcome[peer.key] = exc
        for index in range(p.cycle_blocks):
            order = peers if index % 2 == 0 else peers[::-1]
            for peer in order:
                if peer.key in outcome:
                    continue
                try:
                    await turn(peer, _BLOCK_WARMUP, block)
                except Exception as exc:
                    outcome[peer.key] = exc
    finally:
        for session in sessions.values():
            if isinstance(session, AsyncSession):
                await session.aclose()
            else:
                session.close()
    for peer in peers:
        if peer.key not in outcome:
            outcome[peer.key] = Measurement(_figures(results[peer.key]))
    return outcome


def cycle_many(peer: Peer, ctx: Context) -> Measurement:
    """``cycle_workers`` workers (tasks, or threads), each on its own name; total rate."""
    base = ctx.name(peer, "cycle-many")
    names = [f"{base}:{i}" for i in range(ctx.profile.cycle_workers)]
    result = _cycles(peer, ctx, names, ctx.profile.cycle_many)
    return Measurement(_figures(result))
