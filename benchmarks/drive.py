"""The measurement loops, once for asyncio sessions and once for thread sessions.

Every loop is bounded in count and in time and stops by itself: a worker stops after
``max_ops`` operations or once its stop time has passed, and the whole run is abandoned
(raising ``TimeoutError``) ``GRACE`` seconds after its stop time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .peers import AsyncSession, SyncSession
from .stats import Hold

__all__ = [
    "GRACE",
    "BurstResult",
    "CycleResult",
    "burst_async",
    "burst_threads",
    "contend_async",
    "contend_threads",
    "cycle_async",
    "cycle_threads",
]

GRACE = 30.0  # seconds a run may overrun its stop time before it is abandoned


@dataclass
class CycleResult:
    """Uncontended acquire + release cycles of ``workers`` workers, each on its own lock."""

    latencies: list[float] = field(default_factory=list)  # seconds per cycle, all workers
    elapsed: float = 0.0  # seconds from the common start to the last worker's end

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0


@dataclass
class BurstResult:
    acquire_s: float = 0.0  # from the start until every lease was held
    total_s: float = 0.0  # until every lease was released again
    held: int = 0
    errors: list[str] = field(default_factory=list)
    clients: int = 0  # connected clients on the server while all were held


def _check_threads(threads: Sequence[threading.Thread], what: str) -> None:
    alive = sum(1 for t in threads if t.is_alive())
    if alive:
        raise TimeoutError(f"{alive} {what} thread(s) did not stop in time")


# -- uncontended cycles ----------------------------------------------------------------


async def cycle_async(
    session: AsyncSession, names: Sequence[str], warmup: float, duration: float, max_ops: int
) -> CycleResult:
    """Each name gets one task that enters and leaves ``session.lock(name)`` in a loop."""
    result = CycleResult()
    clock = time.perf_counter

    async def worker(name: str, stop_at: float, record: bool) -> None:
        lock = session.lock
        latencies = result.latencies
        for _ in range(max_ops):
            begin = clock()
            async with lock(name):
                pass
            done = clock()
            if record:
                latencies.append(done - begin)
            if done >= stop_at:
                return

    for record, length in ((False, warmup), (True, duration)):
        start = clock()
        async with asyncio.timeout(length + GRACE):
            await asyncio.gather(*(worker(name, start + length, record) for name in names))
        if record:
            result.elapsed = clock() - start
    return result


def cycle_threads(
    session: SyncSession, names: Sequence[str], warmup: float, duration: float, max_ops: int
) -> CycleResult:
    """Each name gets one thread that enters and leaves ``session.lock(name)`` in a loop."""
    result = CycleResult()
    _thread_cycles(session, names, warmup, max_ops, None)
    result.elapsed = _thread_cycles(session, names, duration, max_ops, result.latencies)
    return result


def _thread_cycles(
    session: SyncSession,
    names: Sequence[str],
    length: float,
    max_ops: int,
    latencies: list[float] | None,
) -> float:
    """One phase of ``cycle_threads``; returns its elapsed seconds."""
    clock = time.perf_counter
    window = [0.0, 0.0]  # start, stop

    def begin() -> None:  # run by the barrier once every thread is ready
        window[0] = clock()
        window[1] = window[0] + length

    gate = threading.Barrier(len(names) + 1, action=begin)

    def worker(name: str) -> None:
        lock = session.lock
        gate.wait()
        stop_at = window[1]
        for _ in range(max_ops):
            t0 = clock()
            with lock(name):
                pass
            done = clock()
            if latencies is not None:
                latencies.append(done - t0)
            if done >= stop_at:
                return

    threads = [threading.Thread(target=worker, args=(name,), daemon=True) for name in names]
    for thread in threads:
        thread.start()
    gate.wait()
    deadline = time.monotonic() + length + GRACE
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    _check_threads(threads, "cycle")
    return clock() - window[0]


# -- contention --------------------------------------------------------------------------


async def contend_async(
    session: AsyncSession,
    name: str,
    contenders: Sequence[int],
    end_at: float,
    max_ops: int,
) -> list[Hold]:
    """The contenders loop on ``name`` until ``end_at`` (time.monotonic), going straight
    back to the lock after each release; returns every turn."""
    holds: list[Hold] = []
    mono = time.monotonic

    async def contender(ident: int) -> None:
        lock = session.lock_as
        for _ in range(max_ops):
            if mono() >= end_at:
                return
            async with lock(name, ident):
                t_in = mono()
                t_release = mono()
            holds.append(Hold(t_in, t_release, ident))

    async with asyncio.timeout(max(0.0, end_at - mono()) + GRACE):
        await asyncio.gather(*(contender(ident) for ident in contenders))
    return holds


def contend_threads(
    session: SyncSession,
    name: str,
    contenders: Sequence[int],
    end_at: float,
    max_ops: int,
) -> list[Hold]:
    """``contend_async`` with one thread per contender."""
    holds: list[Hold] = []
    mono = time.monotonic

    def contender(ident: int) -> None:
        lock = session.lock
        for _ in range(max_ops):
            if mono() >= end_at:
                return
            with lock(name):
                t_in = mono()
                t_release = mono()
            holds.append(Hold(t_in, t_release, ident))

    threads = [threading.Thread(target=contender, args=(i,), daemon=True) for i in contenders]
    for thread in threads:
        thread.start()
    deadline = end_at + GRACE
    for thread in threads:
        thread.join(max(0.0, deadline - mono()))
    _check_threads(threads, "contender")
    return holds


# -- burst -------------------------------------------------------------------------------


async def burst_async(
    session: AsyncSession, names: Sequence[str], clients: Callable[[], int], limit: float
) -> BurstResult:
    """Enter ``session.lock(name)`` for every name at once; hold all, then release all."""
    result = BurstResult()
    everyone_in = asyncio.Event()
    release = asyncio.Event()
    settled = 0

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == len(names):
            everyone_in.set()

    async def one(name: str) -> None:
        try:
            async with session.lock(name):
                result.held += 1
                settle()
                await release.wait()
        except Exception as exc:
            result.errors.append(repr(exc))
            if not release.is_set():
                settle()

    start = time.perf_counter()
    async with asyncio.timeout(limit):
        tasks = [asyncio.ensure_future(one(name)) for name in names]
        await everyone_in.wait()
        result.acquire_s = time.perf_counter() - start
        result.clients = clients()
        release.set()
        await asyncio.gather(*tasks)
    result.total_s = time.perf_counter() - start
    return result


def burst_threads(
    session: SyncSession, names: Sequence[str], clients: Callable[[], int], limit: float
) -> BurstResult:
    """``burst_async`` with one thread per lease."""
    result = BurstResult()
    everyone_in = threading.Event()
    release = threading.Event()
    guard = threading.Lock()
    settled = [0]

    def settle() -> None:
        with guard:
            settled[0] += 1
            if settled[0] == len(names):
                everyone_in.set()

    def one(name: str) -> None:
        try:
            with session.lock(name):
                with guard:
                    result.held += 1
                settle()
                release.wait(limit)
        except Exception as exc:
            with guard:
                result.errors.append(repr(exc))
            if not release.is_set():
                settle()

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(name,), daemon=True) for name in names]
    for thread in threads:
        thread.start()
    if not everyone_in.wait(limit):
        release.set()
        raise TimeoutError(f"burst: not every lease was settled within {limit:g} s")
    result.acquire_s = time.perf_counter() - start
    result.clients = clients()
    release.set()
    deadline = time.monotonic() + limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    _check_threads(threads, "burst")
    result.total_s = time.perf_counter() - start
    return result
