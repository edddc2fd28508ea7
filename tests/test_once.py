"""``once()``: a job runs once; duplicates wait and receive its result (issue 18, A)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from helpers import Monitor, server_checked
from redis.asyncio import Redis

import asynclock
from asynclock.testing import RedisServer, ServerInfo

# -- in one process -------------------------------------------------------------------------


class FailsOnce:
    """A job whose first run fails (after 0.1 s); it returns "ok" from then on."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = asyncio.Event()

    async def __call__(self) -> str:
        self.calls += 1
        self.started.set()
        await asyncio.sleep(0.1)
        if self.calls == 1:
            raise RuntimeError("first try fails")
        return "ok"


class Counter:
    """A job that counts its runs and returns its argument (after ``delay`` seconds)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay
        self.started = asyncio.Event()

    async def __call__(self, value: Any) -> Any:
        self.calls += 1
        self.started.set()
        await asyncio.sleep(self.delay)
        return {"value": value, "run": self.calls}


async def test_duplicates_wait_and_receive_the_first_result(client: Redis, prefix: str) -> None:
    """Five concurrent calls: one run, five equal results; later calls get it cached;
    only the result and the fence counter are left."""
    job = Counter(delay=0.2)
    results = await asyncio.gather(
        *(asynclock.once(client, "job", job, 7, prefix=prefix) for _ in range(5))
    )
    assert job.calls == 1
    assert results == [{"value": 7, "run": 1}] * 5
    assert await asynclock.once(client, "job", job, 8, prefix=prefix) == {"value": 7, "run": 1}
    assert job.calls == 1
    keys = sorted(
        k.decode() if isinstance(k, bytes) else k for k in await client.keys(prefix + "*")
    )
    assert keys == [f"{prefix}{{job}}:fence", f"{prefix}{{job}}:result"]


async def test_a_stored_result_costs_one_round_trip(
    redis: Redis, redis_server: ServerInfo, prefix: str
) -> None:
    """A hit: one command (the acquire-job script), func not called."""
    job = Counter()
    await asynclock.once(redis, "hit", job, 1, prefix=prefix)
    await asynclock.once(redis, "hit", job, 1, prefix=prefix)  # (scripts loaded, warm)
    async with asynclock.lease(redis, "warm-up", prefix=prefix):
        await server_checked(redis)  # (no HELLO in the call below)
    async with Monitor(redis_server.url) as monitor:
        start = await monitor.mark()
        assert await asynclock.once(redis, "hit", job, 1, prefix=prefix) == {"value": 1, "run": 1}
        end = await monitor.mark()
        assert [c.lower() for c in monitor.client_commands(start, end)] == ["evalsha"]
    assert job.calls == 1


async def test_a_result_stored_through_a_moment_cut_off_is_not_lost(
    private_server: RedisServer, prefix: str
) -> None:
    """The job's connections are reset as it returns and new ones refused for 0.3 s: the
    result is stored once Redis answers again (the store is sent again within
    ``release_timeout``), and a duplicate called afterwards receives it, without running
    the job a second time."""
    from asynclock.testing import FaultProxy

    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        cut = Redis.from_url(proxy.url)
        direct = Redis.from_url(private_server.url)
        runs: list[int] = []

        async def pay(amount: int) -> int:
            runs.append(amount)
            proxy.refuse_new = True
            await proxy.reset_all()
            asyncio.get_running_loop().call_later(0.3, setattr, proxy, "refuse_new", False)
            return amount

        try:
            assert await asynclock.once(cut, "pay", pay, 5, ttl=30, prefix=prefix) == 5
            assert await asynclock.once(direct, "pay", pay, 5, ttl=30, prefix=prefix) == 5
            assert runs == [5]
        finally:
            await cut.aclose()
            await direct.aclose()


async def test_a_store_that_gets_no_answer_ends_within_the_release_timeout(
    private_server: RedisServer, prefix: str
) -> None:
    """Redis falls silent as the job returns (a proxy swallows every byte, a client
    without a socket timeout): the store is tried until ``release_timeout`` (2 s) and
    the read-back of its unknown outcome fits in what is left of it, at least a tenth:
    ``LockLost`` about 2.2 s after the job returned (the bound leaves room for letting go
    of idle side connections on a loaded machine), where store and read-back each took
    2 s before (4 s)."""
    from asynclock.testing import FaultProxy, ProxyMode

    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        silent = Redis.from_url(proxy.url)
        returned = 0.0

        async def job() -> str:
            nonlocal returned
            proxy.set_mode(ProxyMode.BLACKHOLE)
            returned = time.monotonic()
            return "done"

        try:
            with pytest.raises(asynclock.LockLost, match="whether the result was stored"):
                await asynclock.once(silent, "silent", job, ttl=30, prefix=prefix)
            assert 1.9 < time.monotonic() - returned < 3.4  # (the read-back at least 0.2 s)
        finally:
            proxy.set_mode(ProxyMode.PASS)
            await silent.aclose()


async def test_waiters_are_woken_when_the_result_is_stored(client: Redis, prefix: str) -> None:
    """A duplicate returns right after the result is stored, not at the lease's expiry."""
    job = Counter(delay=0.3)
    holder = asyncio.create_task(asynclock.once(client, "wake", job, 1, ttl=30, prefix=prefix))
    await job.started.wait()
    started = time.monotonic()
    assert await asynclock.once(client, "wake", job, 2, ttl=30, prefix=prefix) == {
        "value": 1,
        "run": 1,
    }
    assert time.monotonic() - started < 2.0
    await holder


async def test_a_failure_is_not_cached_and_a_duplicate_takes_over(
    client: Redis, prefix: str
) -> None:
    """func raises: its caller gets the error, nothing is stored, a waiting duplicate
    runs func (and succeeds)."""
    flaky = FailsOnce()

    first = asyncio.create_task(asynclock.once(client, "flaky", flaky, prefix=prefix))
    await flaky.started.wait()
    second = asyncio.create_task(asynclock.once(client, "flaky", flaky, prefix=prefix))
    with pytest.raises(RuntimeError, match="first try fails"):
        await first
    assert await asyncio.wait_for(second, 5) == "ok"
    assert flaky.calls == 2


async def test_fingerprint_conflicts(client: Redis, prefix: str) -> None:
    """Another fingerprint for the same key, while running or after: IdempotencyConflict
    (a ValueError), func not called; the same fingerprint gets the result."""
    job = Counter(delay=0.3)
    running = asyncio.create_task(
        asynclock.once(client, "fp", job, 1, fingerprint=b"payload-1", prefix=prefix)
    )
    await job.started.wait()
    with pytest.raises(asynclock.IdempotencyConflict):
        await asynclock.once(client, "fp", job, 2, fingerprint="payload-2", prefix=prefix)
    await running
    with pytest.raises(ValueError, match="another fingerprint"):
        await asynclock.once(client, "fp", job, 2, fingerprint="payload-2", prefix=prefix)
    same = await asynclock.once(client, "fp", job, 3, fingerprint=b"payload-1", prefix=prefix)
    assert same == {"value": 1, "run": 1}
    unchecked = await asynclock.once(client, "fp", job, 3, prefix=prefix)
    assert unchecked == same
    assert job.calls == 1


async def test_an_unserializable_result_is_never_run_again(client: Redis, prefix: str) -> None:
    """A result JSON cannot encode (a datetime): the job's effect ran once; its caller
    and every duplicate get ResultNotStored naming the cause, none runs it again; the
    lease is given back (duplicates do not wait for its TTL); forget() allows a rerun."""
    charges: list[int] = []

    async def charge(order: int) -> object:
        charges.append(order)  # the effect, before the result that cannot be stored
        return {"order": order, "at": datetime.now(UTC)}

    with pytest.raises(asynclock.ResultNotStored, match="datetime") as first:
        await asynclock.once(client, "pay", charge, 42, ttl=30, prefix=prefix)
    assert isinstance(first.value, TypeError)  # (what once() raised before: still caught)
    assert isinstance(first.value.__cause__, TypeError)
    assert not await client.exists(f"{prefix}{{pay}}")  # the lease given back
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(asynclock.ResultNotStored) as again:
            await asynclock.once(client, "pay", charge, 42, ttl=30, prefix=prefix)
        assert again.value.cause == first.value.cause
        assert again.value.key == "pay"
    assert time.monotonic() - started < 5  # (at once, not after the lease's ttl)
    assert charges == [42]
    assert 0 < await client.pttl(f"{prefix}{{pay}}:result") <= 86_400_000
    assert await asynclock.forget(client, "pay", prefix=prefix)
    with pytest.raises(asynclock.ResultNotStored):
        await asynclock.once(client, "pay", charge, 43, prefix=prefix)
    assert charges == [42, 43]


async def test_a_duplicate_waiting_for_an_unstorable_result_is_not_run(
    client: Redis, prefix: str
) -> None:
    """A duplicate that waited while the job ran is woken and gets ResultNotStored; a
    fingerprint kept with the marker still refuses another payload."""
    runs: list[int] = []
    started, go = asyncio.Event(), asyncio.Event()

    async def job(value: int) -> object:
        runs.append(value)
        started.set()
        await go.wait()
        return {value}  # (a set: JSON cannot encode it)

    runner = asyncio.create_task(
        asynclock.once(client, "w", job, 1, fingerprint="a", prefix=prefix)
    )
    await started.wait()
    duplicate = asyncio.create_task(
        asynclock.once(client, "w", job, 2, fingerprint="a", prefix=prefix)
    )
    await asyncio.sleep(0.1)  # (let it wait)
    go.set()
    with pytest.raises(asynclock.ResultNotStored, match="set"):
        await runner
    with pytest.raises(asynclock.ResultNotStored, match="set"):
        await asyncio.wait_for(duplicate, 10)
    with pytest.raises(asynclock.IdempotencyConflict):
        await asynclock.once(client, "w", job, 3, fingerprint="b", prefix=prefix)
    assert runs == [1]


async def test_every_caller_gets_what_the_serializer_reads_back(client: Redis, prefix: str) -> None:
    """A tuple comes back as a list (and int keys as str) to the caller that ran the job
    and to duplicates alike."""

    async def job() -> object:
        return {1: (1, "a")}

    first = await asynclock.once(client, "tuple", job, prefix=prefix)
    again = await asynclock.once(client, "tuple", job, prefix=prefix)
    assert first == again == {"1": [1, "a"]}


async def test_a_serializer_that_cannot_read_its_own_output(client: Redis, prefix: str) -> None:
    """loads() fails on what dumps() wrote: found before storing, a marker kept instead,
    the job not run again."""
    runs: list[str] = []

    class OneWay:
        def dumps(self, obj: Any) -> str:
            return repr(obj)

        def loads(self, data: bytes) -> Any:
            raise ValueError("cannot parse a repr")

    async def job() -> str:
        runs.append("ran")
        return "x"

    for _ in range(2):
        with pytest.raises(asynclock.ResultNotStored, match="cannot parse a repr"):
            await asynclock.once(client, "oneway", job, serializer=OneWay(), prefix=prefix)
    assert runs == ["ran"]


async def test_bytes_a_text_client_cannot_read_back(
    make_client: Callable[..., Redis], redis_server: ServerInfo, prefix: str
) -> None:
    """A serializer writing bytes that are not UTF-8, through a decode_responses=True
    client: duplicates could never decode them; a marker is kept, nothing runs twice."""
    client = make_client(redis_server.url, decode_responses=True)
    runs: list[str] = []

    class Raw:
        def dumps(self, obj: Any) -> bytes:
            return b"\xff\xfe"

        def loads(self, data: bytes) -> Any:
            return data

    async def job() -> str:
        runs.append("ran")
        return "x"

    for _ in range(2):
        with pytest.raises(asynclock.ResultNotStored, match="UnicodeDecodeError"):
            await asynclock.once(client, "raw", job, serializer=Raw(), prefix=prefix)
    assert runs == ["ran"]


@pytest.mark.parametrize("storable", [True, False], ids=["result", "marker"])
async def test_cancelled_once_the_job_ran_it_is_not_run_again(
    client: Redis, prefix: str, storable: bool
) -> None:
    """The caller is cancelled right after func returned, while its result (or marker)
    is being stored: the store completes (shielded), the caller gets CancelledError, and
    a duplicate gets the result (or ResultNotStored), without running func again."""
    runs: list[int] = []
    returned = asyncio.Event()

    async def job() -> object:
        runs.append(1)
        asyncio.get_running_loop().call_soon(returned.set)
        return "ok" if storable else datetime.now(UTC)

    runner = asyncio.create_task(asynclock.once(client, "mid", job, prefix=prefix))
    await returned.wait()
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    if storable:
        assert await asynclock.once(client, "mid", job, prefix=prefix) == "ok"
    else:
        with pytest.raises(asynclock.ResultNotStored):
            await asynclock.once(client, "mid", job, prefix=prefix)
    assert runs == [1]


async def test_a_serializer_of_ones_own(client: Redis, prefix: str) -> None:
    class Reversed:
        def dumps(self, obj: Any) -> bytes:
            return str(obj)[::-1].encode()

        def loads(self, data: bytes) -> Any:
            return data.decode()[::-1]

    async def job() -> str:
        return "abc"

    assert await asynclock.once(client, "s", job, serializer=Reversed(), prefix=prefix) == "abc"
    assert await asynclock.once(client, "s", job, serializer=Reversed(), prefix=prefix) == "abc"
    assert await client.hget(f"{prefix}{{s}}:result", "v") in (b"cba", "cba")


async def test_cancelling_the_runner_stores_nothing(client: Redis, prefix: str) -> None:
    """The caller running func is cancelled mid-flight: func is cancelled, the lease
    given back, nothing stored; a waiting duplicate runs it."""
    job = Counter(delay=30)
    runner = asyncio.create_task(asynclock.once(client, "cancel", job, 1, prefix=prefix))
    await job.started.wait()
    job.delay = 0.0
    duplicate = asyncio.create_task(asynclock.once(client, "cancel", job, 2, prefix=prefix))
    await asyncio.sleep(0.05)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert await asyncio.wait_for(duplicate, 5) == {"value": 2, "run": 2}


async def test_cancelling_a_waiter_leaves_nothing(client: Redis, prefix: str) -> None:
    """A waiting duplicate is cancelled: the job goes on, and only its result and the
    fence counter are left."""
    job = Counter(delay=0.3)
    runner = asyncio.create_task(asynclock.once(client, "wcancel", job, 1, prefix=prefix))
    await job.started.wait()
    waiter = asyncio.create_task(asynclock.once(client, "wcancel", job, 2, prefix=prefix))
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await runner == {"value": 1, "run": 1}
    names = {k.decode() if isinstance(k, bytes) else k for k in await client.keys(prefix + "*")}
    tombstones = {name for name in names if ":void:" in name}  # (the cancelled wait's)
    assert names - tombstones == {f"{prefix}{{wcancel}}:result", f"{prefix}{{wcancel}}:fence"}
    for name in tombstones:
        assert 0 < await client.pttl(name) <= 90_000  # (3 x ttl: it expires by itself)


async def test_blocking_timeout(client: Redis, prefix: str) -> None:
    job = Counter(delay=1.0)
    runner = asyncio.create_task(asynclock.once(client, "slow", job, 1, prefix=prefix))
    await job.started.wait()
    with pytest.raises(asynclock.AcquireTimeout):
        await asynclock.once(client, "slow", job, 2, blocking_timeout=0.2, prefix=prefix)
    await runner


async def test_idempotent_and_forget(client: Redis, prefix: str) -> None:
    """The decorator keys each call by its arguments; forget() lets a job run again."""
    charges: list[tuple[int, int]] = []

    @asynclock.idempotent(client, key=lambda order, cents: f"charge:{order}", prefix=prefix)
    async def charge(order: int, cents: int) -> int:
        charges.append((order, cents))
        return cents

    assert await charge(1, cents=500) == 500
    assert await charge(1, cents=500) == 500
    assert await charge(2, 700) == 700
    assert charges == [(1, 500), (2, 700)]
    assert await asynclock.forget(client, "charge:1", prefix=prefix)
    assert not await asynclock.forget(client, "charge:1", prefix=prefix)
    assert await charge(1, cents=500) == 500
    assert charges == [(1, 500), (2, 700), (1, 500)]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda r, j: asynclock.once(r, "", j), ValueError, "name"),
        (lambda r, j: asynclock.once(r, "}x", j), ValueError, "hash tag"),
        (lambda r, j: asynclock.once(r, "k", j, ttl=0), ValueError, "ttl"),
        (lambda r, j: asynclock.once(r, "k", j, result_ttl=-1), ValueError, "result_ttl"),
        (lambda r, j: asynclock.once(r, "k", j, fingerprint=3), TypeError, "fingerprint"),
        (lambda r, j: asynclock.once(r, "k", j, serializer=object()), TypeError, "serializer"),
        (lambda r, j: asynclock.once(r, "k", "not callable"), TypeError, "func"),
        (lambda r, j: asynclock.forget(r, ""), ValueError, "name"),
    ],
)
async def test_bad_input_before_any_io(
    call: Callable[..., Any], error: type[Exception], match: str
) -> None:
    client = Redis(host="127.0.0.1", port=1)  # (nothing listens: any I/O would fail)
    with pytest.raises(error, match=match):
        await call(client, Counter())
    with pytest.raises(TypeError, match="key"):
        asynclock.idempotent(client, key=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key: the field"):  # (a template, when decorating)
        asynclock.idempotent(client, key="{not_a_parameter}")(Counter().__call__)
    await client.aclose()


# -- across processes ------------------------------------------------------------------------

_WORKER = """
import asyncio, json, os, sys, time
import redis.asyncio as aioredis
import asynclock

url, prefix, key, delay, ttl, marker = sys.argv[1:7]

async def job(who):
    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\\n")
    await asyncio.sleep(float(delay))
    return {"by": who}

async def main():
    client = aioredis.Redis.from_url(url)
    try:
        result = await asynclock.once(client, key, job, os.getpid(), ttl=float(ttl),
                                      prefix=prefix)
        print(json.dumps({"result": result}), flush=True)
    except asynclock.LockLost as lost:
        print(json.dumps({"lost": str(lost.reason)}), flush=True)
    finally:
        await client.aclose()

asyncio.run(main())
"""


def _worker(url: str, prefix: str, key: str, delay: float, ttl: float, marker: Path) -> Any:
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, url, prefix, key, str(delay), str(ttl), str(marker)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _runs(marker: Path) -> list[str]:
    return marker.read_text().split() if marker.exists() else []


async def _until(predicate: Callable[[], bool], within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_duplicates_across_processes(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """Three processes call once() for one key at once: one run, one result for all."""
    marker = tmp_path / "runs"
    workers = [_worker(redis_server.url, prefix, "x", 0.5, 10, marker) for _ in range(3)]
    outputs = [json.loads(w.communicate(timeout=30)[0]) for w in workers]
    assert len(_runs(marker)) == 1
    assert len({json.dumps(o) for o in outputs}) == 1
    assert outputs[0]["result"]["by"] == int(_runs(marker)[0])


async def test_a_killed_holder_is_replaced_within_its_ttl(
    client: Redis, redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """The holder's process is SIGKILLed mid-job: a duplicate runs the job once the
    holder's lease expires (within ttl)."""
    marker = tmp_path / "runs"
    holder = _worker(redis_server.url, prefix, "k", 30, 1.0, marker)
    try:
        await _until(lambda: len(_runs(marker)) == 1)
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=5)
        killed = time.monotonic()
        result = await asynclock.once(client, "k", Counter(), "dup", prefix=prefix)
        assert result == {"value": "dup", "run": 1}
        assert time.monotonic() - killed < 1.0 + 0.5
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate(timeout=5)


async def test_a_paused_holder_stores_no_late_result(
    private_server: RedisServer, make_client: Callable[..., Redis], prefix: str, tmp_path: Path
) -> None:
    """The holder is SIGSTOPped past its TTL; a duplicate runs and stores its result;
    the resumed holder is told LockLost and its result is never stored."""
    marker = tmp_path / "runs"
    holder = _worker(private_server.url, prefix, "p", 0.5, 0.6, marker)
    client = make_client(private_server.url)
    try:
        await _until(lambda: len(_runs(marker)) == 1)
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            result = await asynclock.once(client, "p", Counter(), "dup", ttl=5, prefix=prefix)
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        assert result == {"value": "dup", "run": 1}
        output = json.loads(holder.communicate(timeout=20)[0])
        assert "lost" in output
        cached = await asynclock.once(client, "p", Counter(), "again", prefix=prefix)
        assert cached == {"value": "dup", "run": 1}
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate(timeout=5)


async def test_a_hand_over_refreshed_by_an_attempt_keeps_the_job_fingerprinted(
    client: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job fails; the key is handed to a waiting duplicate of the same client (the key
    then holds no digest), but that grant comes too late to use, so the waiter refreshes
    it by an attempt of its own: the attempt finds the key its own, and the lease it hands
    out must match what the key holds, so that the job's result is stored."""
    from asynclock._kinds import _mutex

    handed = _mutex.HandOverLine.handed
    late: list[bool] = []

    def handed_late(self: _mutex.HandOverLine) -> Any:
        grant = handed(self)
        if grant is not None and not late:  # (as if answered most of a ttl later)
            late.append(True)
            grant.t_send -= 0.9
        return grant

    monkeypatch.setattr(_mutex.HandOverLine, "handed", handed_late)
    flaky = FailsOnce()

    def run() -> Any:
        return asynclock.once(client, "late", flaky, ttl=1.0, fingerprint="p", prefix=prefix)

    first = asyncio.create_task(run())
    await flaky.started.wait()
    second = asyncio.create_task(run())
    await asyncio.sleep(0.02)
    with pytest.raises(RuntimeError, match="first try fails"):
        await first
    assert await asyncio.wait_for(second, 5) == "ok"
    assert late == [True]
    assert flaky.calls == 2
    assert await asynclock.once(client, "late", flaky, fingerprint="p", prefix=prefix) == "ok"
    assert flaky.calls == 2
