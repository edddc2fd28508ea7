"""Tests of asynclock.testing's history recorder, checkers and fenced store.

Each checker is shown to catch a crafted violation and to pass clean data; the JSON-lines
history and the SQLite store are exercised by two real processes at once; and an end-to-end
run of asynclock leases on a real server is checked with all of them, next to a counter
without the lock that the checker must find broken.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis.asyncio as aioredis

import asynclock
import asynclock.testing
from asynclock import LeaseEvent, LeaseEventKind, LockLost, LossReason
from asynclock.testing import (
    CounterMismatch,
    FencedStore,
    FencedWriteViolation,
    FencingViolation,
    History,
    Interval,
    Loss,
    Overlap,
    Pause,
    ServerInfo,
    Violation,
    check_counter,
    check_fenced_writes,
    check_fencing,
    check_no_overlap,
    keys_left,
    measure_overlap,
)

MakeClient = Callable[..., aioredis.Redis]

# Generous bound for anything awaited rather than slept for (seconds).
BOUND = 10.0


def iv(
    holder: str,
    token: int,
    start: float,
    end: float,
    *,
    lock: str = "L",
    paused: bool = False,
    lost: str | None = None,
) -> Interval:
    return Interval(lock, holder, token, start, end, paused, lost)


# --------------------------------------------------------------------------- #
# The public surface
# --------------------------------------------------------------------------- #


def test_public_names_are_pinned() -> None:
    assert asynclock.testing.__all__ == [
        "Attempt",
        "CounterMismatch",
        "Direction",
        "ExternalServer",
        "FaultProxy",
        "FencedStore",
        "FencedWriteViolation",
        "FencingViolation",
        "Guard",
        "History",
        "Interval",
        "Loss",
        "Overlap",
        "OverlapStats",
        "Pause",
        "ProxyMode",
        "RedisServer",
        "ServerInfo",
        "ServerStartError",
        "TLSFiles",
        "Value",
        "Violation",
        "available_engines",
        "check_counter",
        "check_fenced_writes",
        "check_fencing",
        "check_no_overlap",
        "find_server_binary",
        "keys_left",
        "measure_overlap",
        "resp_command",
        "server_version",
    ]
    assert asynclock.testing.__all__ == sorted(asynclock.testing.__all__)
    for name in asynclock.testing.__all__:
        assert hasattr(asynclock.testing, name), name
    # Public before the package split, though never in __all__.
    assert asynclock.testing.LOOPBACK == "127.0.0.1"
    assert asynclock.testing.ENGINES == ("redis", "valkey")
    assert asynclock.testing.History.__module__ == "asynclock.testing"
    assert asynclock.testing.RedisServer.__module__ == "asynclock.testing"


# --------------------------------------------------------------------------- #
# Recording
# --------------------------------------------------------------------------- #


def test_interval_rejects_an_end_before_its_start() -> None:
    with pytest.raises(ValueError, match="before it starts"):
        iv("a", 1, 2.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        iv("a", 1, 0.0, float("nan"))
    assert iv("a", 1, 1.0, 1.5).duration == 0.5


def test_guard_records_an_interval_also_when_the_block_raises() -> None:
    history = History()
    before = time.monotonic()
    with history.guard("L", "a", 7) as guard:
        assert guard.start is not None
        assert guard.start >= before
    with pytest.raises(KeyError), history.guard("L", "b", 8):
        raise KeyError("boom")
    first, second = history.intervals
    assert (first.holder, first.fencing_token, first.lost) == ("a", 7, None)
    assert before <= first.start <= first.end <= second.start <= second.end <= time.monotonic()
    assert guard.interval == first
    assert second.holder == "b"
    with pytest.raises(RuntimeError, match="only once"), guard:
        pass


async def test_guard_records_an_interval_when_its_task_is_cancelled() -> None:
    history = History()
    entered = asyncio.Event()

    async def hold() -> None:
        with history.guard("L", "a", 1):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(hold())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (interval,) = history.intervals
    assert interval.holder == "a"
    assert interval.lost is None


def test_guard_records_the_reason_of_a_lock_lost_leaving_it() -> None:
    history = History()
    with pytest.raises(LockLost), history.guard("L", "a", 1):
        raise LockLost("L", LossReason.DEADLINE)
    with pytest.raises(ExceptionGroup), history.guard("L", "b", 2):
        raise ExceptionGroup("tasks", [ValueError(), LockLost("L", LossReason.NOT_OWNER)])
    with history.guard("L", "c", 3) as guard:
        guard.mark_lost("killed")
        guard.mark_paused()
    reasons = [(i.lost, i.paused) for i in history.intervals]
    assert reasons == [
        (LossReason.DEADLINE, False),
        (LossReason.NOT_OWNER, False),
        ("killed", True),
    ]
    assert isinstance(history.intervals[0].lost, LossReason)


def test_pauses_and_losses_are_merged_into_the_intervals() -> None:
    history = History()
    history.record(iv("a", 1, 10.0, 20.0))
    history.record(iv("a", 2, 30.0, 40.0))
    history.record(iv("b", 3, 10.0, 20.0))
    history.record(Pause("a", 15.0, 16.0))  # during a's first interval only
    history.record(Pause("b", 20.0, 25.0))  # touches b's interval: not during it
    history.mark_lost("L", 2, "not_owner")
    history.on_event(LeaseEvent(LeaseEventKind.LOST, "L", 3, 0.0, 0.0, "deadline"))
    history.on_event(LeaseEvent(LeaseEventKind.RENEWED, "L", 1, 0.0, 0.0))  # ignored
    with history.paused("a", "c"):
        pass
    a1, a2, b = history.intervals
    assert (a1.paused, a1.lost) == (True, None)
    assert (a2.paused, a2.lost) == (False, LossReason.NOT_OWNER)
    assert (b.paused, b.lost) == (False, LossReason.DEADLINE)
    assert [p.holder for p in history.pauses] == ["a", "b", "a", "c"]
    assert [(x.fencing_token, x.reason) for x in history.losses] == [
        (2, "not_owner"),
        (3, "deadline"),
    ]
    with pytest.raises(TypeError, match="Interval, Pause or Loss"):
        history.record("nope")  # type: ignore[arg-type]


def test_history_file_round_trips_and_rejects_broken_lines(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with History(path) as history:
        history.record(iv("a", 1, 1.25, 2.5, lost=LossReason.DEADLINE))
        history.record(Pause("a", 1.5, 1.75))
        history.record(Loss("L", 9, "custom", 3.0))
        history.record(iv("b", 9, 3.0, 4.0, paused=True))
    assert history.path == path
    loaded = History.load(path)
    assert loaded.path is None
    assert loaded.records == history.records
    assert loaded.intervals == history.intervals
    assert loaded.intervals[1].lost == "custom"
    # A pickled History carries only its path (e.g. to a spawned worker).
    copy = pickle.loads(pickle.dumps(history))
    assert copy.path == path
    assert copy.records == []
    copy.record(Pause("z", 5.0, 6.0))
    copy.close()
    assert History.load(path).records[-1] == Pause("z", 5.0, 6.0)

    with path.open("ab") as file:
        file.write(b'{"kind": "pause", "holder": "x"')  # no end of line: truncated
    with pytest.raises(ValueError, match=r"h\.jsonl:6: truncated"):
        History.load(path)
    path.write_bytes(b'{"kind": "pause", "holder": "x"}\n')
    with pytest.raises(ValueError, match=r"h\.jsonl:1: bad record"):
        History.load(path)
    path.write_bytes(b"\n[1]\n")
    with pytest.raises(ValueError, match=r"h\.jsonl:2: bad record"):
        History.load(path)


HISTORY_WORKER = """
import sys
from asynclock.testing import History

path, holder, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with History(path) as history:
    print("ready", flush=True)
    sys.stdin.readline()
    for token in range(1, count + 1):
        with history.guard("lock-%d" % (token % 3), holder, token):
            pass
print("done", flush=True)
"""

STORE_WORKER = """
import json, sys
from asynclock.testing import FencedStore

path, holder, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with FencedStore(path) as store:
    print("ready", flush=True)
    sys.stdin.readline()
    results = [store.write("k", "%s:%d" % (holder, t), t, holder=holder) for t in tokens]
print(json.dumps(results), flush=True)
"""


def run_together(code: str, argvs: Sequence[Sequence[str]]) -> list[str]:
    """Run one Python process per argv, start them at once, and return their last lines.

    Each process prints ``ready``, waits for a line on stdin, works, and prints its
    result as its last line.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=BOUND)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0] * len(procs)
    return [out.strip().splitlines()[-1] for out in outputs]


def test_two_processes_append_to_one_history_file(tmp_path: Path) -> None:
    path = tmp_path / "shared.jsonl"
    count = 2000
    assert run_together(
        HISTORY_WORKER, [[str(path), "p1", str(count)], [str(path), "p2", str(count)]]
    ) == [
        "done",
        "done",
    ]
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    assert len(lines) == 2 * count + 1
    intervals = History.load(path).intervals
    for holder in ("p1", "p2"):
        mine = [i for i in intervals if i.holder == holder]
        assert [i.fencing_token for i in mine] == list(range(1, count + 1))
        assert all(a.end <= b.start for a, b in itertools.pairwise(mine))


# --------------------------------------------------------------------------- #
# Checkers on crafted data
# --------------------------------------------------------------------------- #


def test_check_no_overlap() -> None:
    clean = [iv("a", 1, 0.0, 1.0), iv("b", 2, 1.0, 2.0), iv("c", 3, 0.5, 1.5, lock="M")]
    assert check_no_overlap(clean) == []
    # Two records of one lease are not two holders.
    assert check_no_overlap([iv("a", 1, 0.0, 1.0), iv("a", 1, 0.2, 0.4)]) == []

    bad = [*clean, iv("d", 4, 1.5, 3.0), iv("e", 5, 2.75, 2.8)]
    violations = check_no_overlap(bad)
    assert [(v.first.holder, v.second.holder) for v in violations] == [
        ("b", "d"),
        ("d", "e"),
    ]
    assert violations[0].seconds == pytest.approx(0.5)
    assert violations[1].seconds == pytest.approx(0.05)
    assert all(isinstance(v, Overlap) and isinstance(v, Violation) for v in violations)
    text = str(violations[0])
    assert "lock 'L' had two holders for 0.500000 s" in text
    assert "b (fence 2)" in text
    assert "d (fence 4)" in text


def test_paused_holders_are_excluded_unless_asked_and_measured() -> None:
    intervals = [
        iv("a", 1, 0.0, 5.0, paused=True),  # stopped past its TTL, still believes it holds
        iv("b", 2, 2.0, 3.0),
        iv("c", 3, 3.0, 4.5),
    ]
    assert check_no_overlap(intervals) == []
    included = check_no_overlap(intervals, include_paused=True)
    assert len(included) == 2
    assert "a (fence 1, paused)" in str(included[0])

    stats = measure_overlap(intervals)
    assert stats.count == 2
    assert stats.total_seconds == pytest.approx(2.5)
    assert stats.max_seconds == pytest.approx(1.5)
    assert stats.overlaps == tuple(included)
    assert str(stats) == (
        "2 overlapping pair(s), 2.500000 s overlapped in total, the longest 1.500000 s"
    )
    none = measure_overlap(intervals, include_paused=False)
    assert (none.count, none.total_seconds, none.max_seconds, str(none)) == (
        0,
        0.0,
        0.0,
        "no overlap",
    )


def test_check_fencing() -> None:
    clean = [iv("a", 5, 0.0, 1.0), iv("b", 9, 1.0, 2.0), iv("c", 1, 0.5, 0.7, lock="M")]
    assert check_fencing(clean) == []
    # Listed out of order: the checker orders by start time.
    assert check_fencing(list(reversed(clean))) == []

    bad = [*clean, iv("d", 7, 2.0, 3.0), iv("e", 9, 3.0, 4.0), iv("f", 10, 4.0, 5.0)]
    violations = check_fencing(bad)
    assert [(v.earlier.holder, v.later.holder) for v in violations] == [("b", "d"), ("b", "e")]
    assert all(isinstance(v, FencingViolation) for v in violations)
    assert str(violations[0]) == (
        "lock 'L': d started at t=2.000000 with fence 7, not above fence 9 of b that "
        "started at t=1.000000 (fencing tokens must strictly increase)"
    )


def test_check_counter() -> None:
    assert check_counter(200, 200) == []
    (short,) = check_counter(200, 150)
    assert isinstance(short, CounterMismatch)
    assert short.lost == 50
    assert str(short) == "counter is 150, expected 200: 50 update(s) lost"
    (extra,) = check_counter(10, 12)
    assert str(extra) == "counter is 12, expected 10: 2 more update(s) than were made"


# --------------------------------------------------------------------------- #
# FencedStore
# --------------------------------------------------------------------------- #


def test_fenced_store_refuses_stale_tokens_and_logs_every_attempt(tmp_path: Path) -> None:
    with FencedStore(tmp_path / "s.db") as store:
        assert store.read("k") is None
        assert store.highest_token("k") is None
        assert store.write("k", "v5", 5, holder="a") is True
        assert store.write("k", "v4", 4, holder="b") is False  # stale: refused
        assert store.write("k", "v5b", 5) is True  # equal: the same holder again
        assert store.write("k", b"v6", 6) is True
        assert store.read("k") == b"v6"
        assert store.highest_token("k") == 6
        assert store.write("other", 1, 1) is True  # fences are per key
        store.write_unfenced("free", 3.5)
        assert store.read("free") == 3.5
        assert store.highest_token("free") is None

        attempts = store.attempts("k")
        assert [(a.fencing_token, a.accepted, a.holder) for a in attempts] == [
            (5, True, "a"),
            (4, False, "b"),
            (5, True, None),
            (6, True, None),
        ]
        assert [a.seq for a in store.attempts()] == sorted(a.seq for a in store.attempts())
        assert all(a.at <= b.at for a, b in itertools.pairwise(attempts))
        assert str(attempts[1]).endswith(
            f"write of 'k' with fence 4 by b at t={attempts[1].at:.6f}: refused"
        )
        assert check_fenced_writes(store) == []

        for bad in (0, -1, 2**63):
            with pytest.raises(ValueError, match="fencing_token"):
                store.write("k", "x", bad)
        with pytest.raises(TypeError, match="fencing_token"):
            store.write("k", "x", True)
        with pytest.raises(TypeError, match="not an int"):
            store.read_int("k")


def test_check_fenced_writes_catches_a_store_that_broke_fencing(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with FencedStore(path) as store:
        store.write("k", "a", 5)
        store.write("k", "b", 3)  # refused, correctly
    # Forge the log of a store gone wrong: a stale token accepted, a fresh one refused.
    db = sqlite3.connect(path)
    with db:
        db.execute(
            "INSERT INTO fenced_log (key, op, fence, accepted, at) VALUES ('k', 'write', 4, 1, 0)"
        )
        db.execute(
            "INSERT INTO fenced_log (key, op, fence, accepted, at) VALUES ('k', 'write', 9, 0, 0)"
        )
    db.close()
    with FencedStore(path) as store:
        stale, refused = check_fenced_writes(store)
    assert isinstance(stale, FencedWriteViolation)
    assert (stale.attempt.fencing_token, stale.highest) == (4, 5)
    assert str(stale).endswith("accepted although fence 5 had been accepted before")
    assert (refused.attempt.fencing_token, refused.highest) == (9, 5)
    assert "refused although the highest fence accepted before was 5" in str(refused)


def test_fenced_store_across_two_processes(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    with FencedStore(path) as store:
        assert store.write("k", "parent:10", 10)
        (results,) = run_together(STORE_WORKER, [[str(path), "child", "[5, 10, 11]"]])
        assert json.loads(results) == [False, True, True]  # stale refused; equal, higher taken
        assert store.read("k") == "child:11"
        assert store.highest_token("k") == 11
        assert store.write("k", "parent:10", 10) is False
        assert check_fenced_writes(store) == []


def test_fenced_store_two_processes_writing_at_once(tmp_path: Path) -> None:
    path = tmp_path / "race.db"  # created by the two workers at the same moment
    count = 1000  # writes per process: enough for their turns at the write lock to alternate
    odd, even = list(range(1, 2 * count, 2)), list(range(2, 2 * count + 1, 2))
    out_a, out_b = run_together(
        STORE_WORKER, [[str(path), "a", json.dumps(odd)], [str(path), "b", json.dumps(even)]]
    )
    assert len(json.loads(out_a)) == len(json.loads(out_b)) == count
    assert json.loads(out_b)[-1] is True  # the highest token of all is never stale
    with FencedStore(path) as store:
        attempts = store.attempts()
        assert len(attempts) == 2 * count
        assert check_fenced_writes(store) == []
        assert store.highest_token("k") == 2 * count
        assert store.read("k") == f"b:{2 * count}"
        accepted = [a.fencing_token or 0 for a in attempts if a.accepted]
        assert accepted == sorted(accepted)


async def test_counter_without_the_lock_loses_updates(tmp_path: Path) -> None:
    with FencedStore(tmp_path / "c.db") as store:

        async def worker() -> None:
            for _ in range(10):
                assert await store.increment("hits", pause=0.01)

        async with asyncio.TaskGroup() as tasks:
            for _ in range(4):
                tasks.create_task(worker())
        (violation,) = check_counter(40, store.read_int("hits"))
        assert violation.lost > 0, violation
        assert "update(s) lost" in str(violation)


async def test_fenced_increment_refuses_a_holder_that_was_overtaken(tmp_path: Path) -> None:
    with FencedStore(tmp_path / "c.db") as store:
        assert await store.increment("hits", fencing_token=1)
        # Holder 2 reads the counter (claiming fence 2) ...
        assert store.claim("hits", 2)
        seen = store.read_int("hits")
        # ... then holder 1, paused past its lease, wakes up and writes: refused.
        assert await store.increment("hits", fencing_token=1) is False
        assert store.write("hits", 99, 1) is False
        assert store.write("hits", seen + 1, 2) is True
        assert store.read_int("hits") == 2
        assert await store.increment("hits", fencing_token=3)
        assert store.read_int("hits") == 3
        assert check_fenced_writes(store) == []
        with pytest.raises(ValueError, match="pause"):
            await store.increment("hits", pause=-1)


# --------------------------------------------------------------------------- #
# Against a real server
# --------------------------------------------------------------------------- #


async def test_keys_left_lists_only_lease_keys(
    redis_server: ServerInfo, make_client: MakeClient, prefix: str
) -> None:
    client = make_client(decode_responses=True)
    odd = prefix + "a*[b]?:"  # glob characters in the prefix are matched literally
    await client.set(prefix + "aXbY:{decoy}", "1", px=60_000)
    async with asynclock.lease(client, "x", prefix=odd) as lock:
        await client.set(f"{lock.key}:void:abc", "1", px=60_000)
        assert await keys_left(client, odd) == [lock.key]
        assert await keys_left(make_client(), odd) == [lock.key]  # bytes replies too
    assert await client.exists(f"{lock.key}:fence", f"{lock.key}:void:abc") == 2
    assert await keys_left(client, odd) == []
    await client.delete(prefix + "aXbY:{decoy}", f"{lock.key}:fence", f"{lock.key}:void:abc")


async def test_a_lost_lease_is_recorded_with_its_reason(
    redis_server: ServerInfo, make_client: MakeClient, prefix: str
) -> None:
    client = make_client()
    history = History()
    with pytest.raises(LockLost):
        async with asynclock.lease(client, "job", prefix=prefix, on_event=history.on_event) as lock:
            with history.guard_lease(lock, "worker"):
                await client.delete(lock.key)  # someone else's mistake
                assert not await lock.is_held(verify=True)  # notices: the block is cancelled
                await asyncio.sleep(BOUND)
                pytest.fail("the block was not cancelled")
    (interval,) = history.intervals
    assert interval.lost == LossReason.NOT_OWNER
    assert [loss.reason for loss in history.losses] == [LossReason.NOT_OWNER]
    assert await keys_left(client, prefix) == []


@pytest.mark.parametrize("fenced", [False, True], ids=["plain", "fenced"])
async def test_end_to_end_leases_keep_the_history_clean(
    redis_server: ServerInfo,
    make_client: MakeClient,
    prefix: str,
    tmp_path: Path,
    fenced: bool,
) -> None:
    workers, rounds = 4, 50
    history = History()
    with FencedStore(tmp_path / "counter.db") as store:

        async def worker(number: int) -> None:
            client = make_client()
            holder = f"task-{number}"
            for _ in range(rounds):
                async with asynclock.lease(
                    client, "counter", prefix=prefix, on_event=history.on_event
                ) as lock:
                    with history.guard_lease(lock, holder):
                        token = lock.fencing_token if fenced else None
                        applied = await store.increment(
                            "hits", pause=0.001, fencing_token=token, holder=holder
                        )
                        assert applied

        async with asyncio.timeout(BOUND), asyncio.TaskGroup() as tasks:
            for number in range(workers):
                tasks.create_task(worker(number))

        intervals = history.intervals
        assert len(intervals) == workers * rounds
        assert not any(i.paused or i.lost for i in intervals)
        assert check_no_overlap(intervals, include_paused=True) == []
        assert check_fencing(intervals) == []
        assert check_counter(workers * rounds, store.read_int("hits")) == []
        assert check_fenced_writes(store) == []
        assert len({i.holder for i in intervals}) == workers
    assert await keys_left(make_client(), prefix) == []
