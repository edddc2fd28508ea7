"""``every()``: once per tick across servers whose clocks disagree (issue 18, B)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

import asynclock
from asynclock.testing import ServerInfo

_SERVER = """
import asyncio, sys, time
import time_machine
import redis.asyncio as aioredis
import asynclock

url, prefix, skew, period, marker = sys.argv[1:6]

async def job(who):
    now = time.time()
    with open(marker, "a") as f:
        f.write(f"{round(now / float(period))} {who}\\n")
    await asyncio.sleep(0.05)

async def main():
    client = aioredis.Redis.from_url(url)
    await asynclock.every(client, "report", float(period), job, skew, prefix=prefix)

# This server's wall clock is off by `skew` seconds (its event loop's clock is not).
with time_machine.travel(time.time() + float(skew), tick=True):
    asyncio.run(main())
"""


@pytest.mark.parametrize("skews", [("-0.6", "0", "0.6"), ("0", "0", "0")], ids=["skewed", "same"])
def test_one_run_per_tick_across_skewed_servers(
    redis_server: ServerInfo, prefix: str, tmp_path: Path, skews: tuple[str, ...]
) -> None:
    """Three server processes, clocks -0.6, 0 and +0.6 s off (or all alike, so that they
    race for every tick), a 2 s period and a 50 ms job: every tick runs exactly once (the
    old blocking=False recipe ran it up to three times), and no server warns of an
    overlap."""
    marker = tmp_path / "runs"
    period = 2.0
    servers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SERVER,
                redis_server.url,
                prefix,
                skew,
                str(period),
                str(marker),
            ],
            stderr=subprocess.PIPE,
        )
        for skew in skews
    ]
    try:
        deadline = time.monotonic() + 4 * period + 3
        while time.monotonic() < deadline:
            if marker.exists() and len(marker.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        time.sleep(period / 2)  # (a late server's firing of the last tick, if any)
    finally:
        for server in servers:
            server.terminate()
        errors = [server.communicate(timeout=10)[1].decode() for server in servers]
    runs = [line.split() for line in marker.read_text().splitlines()]
    ticks = [tick for tick, _ in runs]
    assert len(ticks) >= 3
    assert len(ticks) == len(set(ticks)), runs  # (no tick ran twice)
    # Losing the race for a tick is normal: no server warned of an overlap (none happened).
    for err in errors:
        assert "previous run is still going on" not in err, err


async def test_overlapping_runs_are_skipped_and_logged(
    client: Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A run longer than the period: the ticks during it are skipped (on another server,
    whose clock agrees), with a warning; missed ticks are not caught up."""
    runs: list[float] = []
    running = asyncio.Event()

    async def slow() -> None:
        runs.append(time.monotonic())
        running.set()
        await asyncio.sleep(0.8)

    async def nothing() -> None:
        runs.append(-1.0)

    caplog.set_level(logging.WARNING, logger="asynclock")
    first = asyncio.create_task(asynclock.every(client, "slow", 0.5, slow, prefix=prefix))
    await running.wait()
    await asyncio.sleep(0.05)
    second = asyncio.create_task(asynclock.every(client, "slow", 0.5, nothing, prefix=prefix))
    await asyncio.sleep(0.6)
    for task in (first, second):
        task.cancel()
    for task in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert -1.0 not in runs  # (the second server never ran while the first one ran)
    assert any("previous run is still going on" in r.getMessage() for r in caplog.records)


async def test_a_failing_run_is_logged_and_the_schedule_goes_on(
    client: Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0
    twice = asyncio.Event()

    async def failing() -> None:
        nonlocal calls
        calls += 1
        if calls >= 2:
            twice.set()
        raise RuntimeError("boom")

    caplog.set_level(logging.ERROR, logger="asynclock")
    task = asyncio.create_task(asynclock.every(client, "fails", 0.2, failing, prefix=prefix))
    await asyncio.wait_for(twice.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert any("failed" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_cancelling_a_run_releases_the_lease(client: Redis, prefix: str) -> None:
    started = asyncio.Event()

    async def long() -> None:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(asynclock.every(client, "cancel", 0.1, long, prefix=prefix))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await client.exists(f"{prefix}{{cancel}}")


async def test_cron_ticks(client: Redis, prefix: str) -> None:
    """A cron expression (every minute) instead of a period: the first tick is the next
    whole minute, UTC."""
    from asynclock._apps._every import _ticks

    ticks = _ticks(None, 0.0, "* * * * *")
    tick, gap = ticks(120.5)
    assert (tick, gap) == (180.0, 60.0)
    assert _ticks(10, 3, None)(25.0) == (33.0, 10.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"period": None}, ValueError, "period must be given"),
        ({"period": 0}, ValueError, "period"),
        ({"period": 1, "cron": "* * * * *"}, ValueError, "not both"),
        ({"period": None, "cron": "not cron"}, ValueError, "cron"),
        ({"period": 1, "ttl": 0.001}, ValueError, "ttl"),
        ({"period": 1, "name": ""}, ValueError, "name"),
        ({"period": 1, "func": 3}, TypeError, "func"),
    ],
)
async def test_bad_input_before_any_io(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    client = Redis(host="127.0.0.1", port=1)
    arguments: dict[str, Any] = {"name": "x", "func": asyncio.sleep, **kwargs}
    name, period, func = arguments.pop("name"), arguments.pop("period"), arguments.pop("func")
    with pytest.raises(error, match=match):
        await asynclock.every(client, name, period, func, **arguments)
    await client.aclose()


async def test_a_redis_error_at_a_tick_s_claim_is_logged_and_the_schedule_goes_on(
    redis_server: ServerInfo, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis cannot be reached when a tick is claimed: that tick is skipped with a warning
    and the schedule goes on (the chaos run's every mode found every() ending instead,
    on the ConnectionError of the claim)."""

    class Flaky(Redis):
        failures = 1

        async def set(self, name: Any, *args: Any, **kwargs: Any) -> Any:
            if self.failures and ":tick:" in str(name):
                self.failures -= 1
                raise RedisConnectionError("Connection closed by server.")
            return await super().set(name, *args, **kwargs)

    client = Flaky.from_url(redis_server.url)
    assert isinstance(client, Flaky)
    ran = asyncio.Event()

    async def job() -> None:
        ran.set()

    caplog.set_level(logging.WARNING, logger="asynclock")
    task = asyncio.create_task(asynclock.every(client, "flaky", 0.2, job, prefix=prefix))
    waiter = asyncio.create_task(ran.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert ran.is_set(), task
        assert client.failures == 0
        assert any("could not claim" in r.getMessage() for r in caplog.records)
    finally:
        for each in (task, waiter):
            each.cancel()
        await asyncio.wait({task, waiter})
        await client.aclose()


async def test_a_tick_woken_for_late_is_skipped(
    client: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that wakes for its tick more than half a period late (a stopped process, a
    stalled loop) skips it: the claim of the server that ran it in time is kept a period
    only, and may be gone, so running it would run the tick twice (the chaos run's every
    mode found it, with a worker stopped past a period)."""
    period = 0.4
    ran_on_time: list[float] = []
    ran_late: list[float] = []
    woke_late = asyncio.Event()
    real_sleep = asyncio.sleep
    late_task: asyncio.Task[Any] | None = None

    async def sleep(delay: float, result: Any = None) -> Any:
        if asyncio.current_task() is late_task and not woke_late.is_set():
            await real_sleep(delay + 1.5 * period)  # (stopped across its tick)
            woke_late.set()
            return result
        return await real_sleep(delay, result)

    async def on_time() -> None:
        ran_on_time.append(time.time())

    async def late() -> None:
        ran_late.append(time.time())

    monkeypatch.setattr(asyncio, "sleep", sleep)
    first = asyncio.create_task(asynclock.every(client, "late", period, on_time, prefix=prefix))
    late_task = asyncio.create_task(asynclock.every(client, "late", period, late, prefix=prefix))
    try:
        await asyncio.wait_for(woke_late.wait(), 5)
        await real_sleep(0.1)  # (its run of the stale tick would be now; the next is 0.2 s off)
        assert ran_on_time  # (the other server ran the ticks in time, that one included)
        assert not ran_late, "a tick whose claim had expired was run again"
    finally:
        for task in (first, late_task):
            task.cancel()
        await asyncio.wait({first, late_task})
