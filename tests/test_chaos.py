"""The chaos run of issue 3: ``python -m chaos``.

The 20-second run is part of the default suite: worker processes contend for three locks
through a fault proxy while a seeded nemesis injects every kind of fault, and every
checker must pass. The other tests are fast: the seed's schedule is deterministic, and
the overlap classification excuses exactly what it should.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

import asynclock
from asynclock._kinds._fair import FAIR_PATIENCE
from asynclock.testing import (
    FaultProxy,
    History,
    Interval,
    Pause,
    ProxyMode,
    RedisServer,
    available_engines,
    check_fencing,
    check_no_overlap,
)
from chaos import FaultKind, make_schedule
from chaos import _jobcheck as jobcheck
from chaos.__main__ import main
from chaos._cluster import (
    CLUSTER_KINDS,
    ChaosCluster,
    across_migrations,
    make_cluster_schedule,
    migration_losses,
)
from chaos._jobs import PERIOD_TTLS, skews
from chaos._modes import (
    exclusive_waits,
    fair_bound,
    free_while_waiting,
    job_results,
    out_of_order,
    starved_writers,
)
from chaos._nemesis import (
    FAIR_KINDS,
    JOB_KINDS,
    ORDINARY,
    REDLOCK_KINDS,
    Fault,
    Injection,
    make_failover_schedule,
)
from chaos._replication import Replication
from chaos._run import ChaosConfig
from chaos._soak import plan, soak
from chaos._summary import (
    DataLoss,
    RoundReport,
    RunRecord,
    Summary,
    classify_overlaps,
    failover_windows,
    local_handoffs,
    most_at_once,
    percentile,
    summarize,
)
from chaos._worker import holder_name

ROOT = Path(__file__).resolve().parent.parent
SEED = 20240603  # a 20-second schedule with all eight kinds of fault
TTL = 0.8

needs_server = pytest.mark.skipif(
    not available_engines(), reason="no redis-server or valkey-server binary installed"
)


# -- the schedule ----------------------------------------------------------------------


def test_same_seed_same_schedule():
    first = make_schedule(SEED, 20.0, TTL)
    assert first == make_schedule(SEED, 20.0, TTL)
    assert first != make_schedule(SEED + 1, 20.0, TTL)
    assert {f.kind for f in first} == set(ORDINARY)
    assert FaultKind.FAILOVER not in ORDINARY  # only the failover mode fails over


@pytest.mark.parametrize("seed", [0, 1, SEED, 2**40 + 3])
@pytest.mark.parametrize("seconds", [20.0, 600.0])
def test_schedule_is_ordered_bounded_and_healed_between_faults(seed: int, seconds: float):
    schedule = make_schedule(seed, seconds, TTL)
    assert schedule, "a 20 s run has room for several faults"
    assert [f.index for f in schedule] == list(range(len(schedule)))
    assert schedule[0].at >= 2 * TTL  # warm-up
    assert schedule[-1].end <= seconds - 1.5 * TTL  # calm at the end
    for before, after in itertools.pairwise(schedule):
        assert after.at - before.end >= TTL  # healed for at least a TTL in between
    for fault in schedule:
        assert 0 <= fault.pick < 1
        if fault.kind is FaultKind.DELAY and fault.variant == "within":
            assert 2 * fault.amount < TTL / 3  # the round trip fits the renewal period
        if fault.kind is FaultKind.DELAY and fault.variant == "beyond":
            assert 2 * fault.amount > 2 * TTL / 3  # ... and here it does not fit the budget
        if fault.kind in (FaultKind.STALL, FaultKind.BLACKHOLE):
            assert fault.duration > TTL  # longer than a lease lives
        if fault.kind is FaultKind.HOLDER_STOP:
            assert fault.duration == pytest.approx(2.5 * TTL)
    if seconds >= 600:
        assert {f.kind for f in schedule} == set(ORDINARY)


def test_schedule_scales_with_the_ttl():
    short, long = make_schedule(5, 60.0, 0.5), make_schedule(5, 120.0, 1.0)
    assert [f.kind for f in short] == [f.kind for f in long]
    for a, b in zip(short, long, strict=True):
        assert b.at == pytest.approx(2 * a.at)
        assert b.duration == pytest.approx(2 * a.duration)


def test_print_schedule_replays(capsys: pytest.CaptureFixture[str]):
    assert main(["--seed", str(SEED), "--print-schedule"]) == 0
    once = capsys.readouterr().out
    assert main(["--seed", str(SEED), "--seconds", "20", "--print-schedule"]) == 0
    assert capsys.readouterr().out == once
    assert once.count("\n") == len(make_schedule(SEED, 20.0, TTL))


@pytest.mark.parametrize(
    "args",
    [
        ["--workers", "1"],
        ["--seconds", "0"],
        ["--ttl", "0.01"],
        ["--locks", "0"],
        ["--tasks", "0"],
        ["--tasks", "17"],
        ["--limit", "0"],
        ["--limit", "65"],
        ["--min-replicas", "1"],  # without --failover
        ["--failovers", "3"],
        ["--failover", "--min-replicas", "2"],  # the run has one replica
        ["--failover", "--min-replicas", "-1"],
        ["--failover", "--failovers", "0"],
        ["--cluster", "--failovers", "3"],  # the cluster mode schedules its own
        ["--cluster", "--failover"],
        ["--cluster", "--min-replicas", "2"],
    ],
)
def test_bad_arguments_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        main([*args, "--print-schedule"])
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err


# -- the checks ------------------------------------------------------------------------


def _interval(holder: str, token_s: float, start: float, end: float) -> Interval:
    """An interval on lock "a" whose fencing token was minted at wall time ``token_s``."""
    return Interval("a", holder, int(token_s * 1e6), start, end)


NOW = 1_700_000_000.0  # wall clock of the synthetic run; monotonic times are NOW - 1000


def test_overlap_of_holders_not_paused_is_a_violation():
    first = _interval("w1", NOW, 0.0, 1.0)
    second = _interval("w2", NOW + 0.5, 0.5, 1.5)
    classes = classify_overlaps([first, second], [], [], TTL, now_wall=NOW)
    assert len(classes.unpaused) == 1
    assert classes.unpaused[0].seconds == pytest.approx(0.5)
    assert not classes.paused
    assert not classes.after_data_loss


def test_overlap_of_a_paused_holder_is_excused_also_when_it_was_acquiring():
    first = _interval("w1", NOW, 0.0, 3.0)
    second = _interval("w2", NOW + 1.5, 1.5, 2.0)
    paused = classify_overlaps([first, second], [Pause("w1", 0.2, 2.9)], [], TTL, now_wall=NOW)
    assert len(paused.paused) == 1
    assert not paused.unpaused
    # stopped before its guard began, while its acquire was in flight (within a TTL)
    late = _interval("w1", NOW, 2.8, 3.0)
    early = _interval("w2", NOW + 2.5, 2.5, 2.9)
    stopped = [Pause("w1", 2.0, 2.7)]
    assert classify_overlaps([late, early], stopped, [], TTL, now_wall=NOW).paused
    # ... but not a pause that ended more than a TTL before
    long_ago = [Pause("w1", 0.0, 1.0)]
    assert classify_overlaps([late, early], long_ago, [], TTL, now_wall=NOW).unpaused


def test_overlap_after_data_loss_is_allowed_only_across_the_loss():
    offset = NOW - 1000.0  # wall minus monotonic
    loss = DataLoss(1000.5, 1000.6, 1000.5 + offset, 1000.6 + offset)
    old = _interval("w1", NOW - 0.2, 1000.0, 1000.9)  # granted before the flush
    new = _interval("w2", NOW + 0.7, 1000.7, 1001.0)  # granted after it
    classes = classify_overlaps([old, new], [], [loss], TTL, now_wall=NOW)
    assert len(classes.after_data_loss) == 1
    assert not classes.unpaused
    # two holders both granted after the loss may not overlap
    newer = _interval("w3", NOW + 0.8, 1000.8, 1001.2)
    classes = classify_overlaps([new, newer], [], [loss], TTL, now_wall=NOW)
    assert len(classes.unpaused) == 1
    assert not classes.after_data_loss
    # nor may a holder whose guard ended before the loss began
    done = _interval("w1", NOW - 0.2, 1000.0, 1000.4)
    assert classify_overlaps([done, new], [], [loss], TTL, now_wall=NOW).after_data_loss == ()


def test_two_contenders_of_one_process_are_distinct_holders():
    """Contenders of one worker process record under holder ids of their own, so two of
    them holding one lock at once is an overlap like any other; a SIGSTOP of the process
    is recorded as a pause of each of them, and excuses exactly their intervals."""
    t0, t1 = holder_name("worker-0", 0), holder_name("worker-0", 1)
    assert t0 != t1
    first = _interval(t0, NOW, 0.0, 1.0)
    second = _interval(t1, NOW + 0.5, 0.5, 1.5)
    classes = classify_overlaps([first, second], [], [], TTL, now_wall=NOW)
    assert len(classes.unpaused) == 1
    stopped = [Pause(t0, 0.2, 0.4), Pause(t1, 0.2, 0.4)]
    classes = classify_overlaps([first, second], stopped, [], TTL, now_wall=NOW)
    assert len(classes.paused) == 1
    assert not classes.unpaused
    # a pause of another process's contender excuses nothing here
    other = [Pause(holder_name("worker-1", 0), 0.2, 0.4)]
    assert classify_overlaps([first, second], other, [], TTL, now_wall=NOW).unpaused


def _round(holder: str, lock: str, start: float, end: float, lease_from: float) -> RoundReport:
    return RoundReport(
        "worker-0",
        lock,
        int(NOW * 1e6),
        "released",
        None,
        None,
        start,
        end,
        lease_from + TTL,
        None,
        holder=holder,
        lease_from=lease_from,
        exit_end=end + 0.002,
    )


def test_local_handoff_is_a_lease_counted_from_a_siblings_release():
    t0, t1 = holder_name("worker-0", 0), holder_name("worker-0", 1)
    releaser = _round(t0, "a", 1.0, 2.0, 0.99)  # released from t=2.0 to t=2.002
    handed = _round(t1, "a", 2.004, 2.5, 2.001)  # its lease counts from within that
    own = _round(t0, "a", 2.6, 2.9, 2.55)  # its own attempt, after t1's release
    elsewhere = _round(t1, "b", 2.004, 2.5, 2.001)  # another lock
    assert local_handoffs([releaser, handed, own, elsewhere]) == [handed]
    other_process = dataclasses.replace(handed, worker="worker-1", holder="worker-1/t1")
    assert local_handoffs([releaser, other_process]) == []


def test_replay_names_the_limit_only_in_the_semaphore_mode():
    assert "--limit" not in ChaosConfig(seed=1).replay()
    assert ChaosConfig(seed=1, limit=3).replay().endswith("--limit 3")
    assert ChaosConfig(seed=1, locks=2, limit=2).slots == (
        "lock-0#0",
        "lock-0#1",
        "lock-1#0",
        "lock-1#1",
    )
    assert ChaosConfig(seed=1, locks=2).slots == ("lock-0", "lock-1")


def test_most_at_once_merges_a_locks_permits_and_ignores_touching_intervals():
    intervals = [
        Interval("a#0", "w1", 1, 0.0, 1.0),
        Interval("a#1", "w2", 2, 0.5, 2.0),
        Interval("a#0", "w3", 3, 1.0, 1.5),  # touches w1's end: not at once with it
        Interval("a#2", "w4", 4, 1.2, 1.3),
        Interval("b", "w5", 5, 0.0, 9.0),
    ]
    assert most_at_once(intervals) == {"a": 3, "b": 1}
    assert most_at_once([]) == {}


def test_replay_names_the_tasks_only_when_not_the_default():
    assert "--tasks" not in ChaosConfig(seed=1).replay()
    assert "--tasks 1" in ChaosConfig(seed=1, tasks=1).replay()


def _stopped_holder_record(rounds: list[RoundReport]) -> RunRecord:
    """A run in which worker w1 was stopped from t=1.0 to t=3.0 (SIGCONT sent at 2.999)."""
    fault = Fault(0, 1.0, FaultKind.HOLDER_STOP, "", 2.0, 0.0, 0.5)
    stop = Injection(fault, start=1.0, end=3.0, target="w1", resumed=2.999)
    return RunRecord(
        seed=1,
        workers=2,
        seconds=10.0,
        locks=("a",),
        ttl=TTL,
        engine="test",
        schedule=(fault,),
        injections=(stop,),
        rounds=tuple(rounds),
        outcomes=(),
        intervals=(),
        pauses=(Pause("w1", 1.0, 3.0),),
        attempts=(),
        fenced_violations=(),
        counters={},
        keys_left=(),
        wall_seconds=10.0,
        replay="",
    )


def _lost(start: float, end: float, lost_at: float, reason: str = "deadline") -> RoundReport:
    return RoundReport(
        "w1", "a", int(NOW * 1e6), "lost", reason, None, start, end, start + 0.5, lost_at
    )


def test_sigcont_latency_counts_only_bodies_running_when_resumed():
    running = _lost(0.5, 3.001, 3.0005)  # stopped mid-body, cancelled 2 ms after SIGCONT
    later = _lost(3.2, 4.6, 4.7, "not_owner")  # began after the SIGCONT: not this figure
    summary = summarize(_stopped_holder_record([running, later]))
    figure = summary.data["detection_latency"]["after_sigcont"]
    assert figure["n"] == 1
    assert figure["max_ms"] == pytest.approx(2.0, abs=0.01)


def test_not_owner_found_by_the_release_is_attributed():
    """A ``LockLost(not_owner)`` found only by the release (the body had returned with time
    left) is put down to a data-loss fault; failing that, a reply that came after the safe
    deadline or nothing at all fails the run. A stop of the holder explains none (the key
    cannot expire by its TTL before the deadline, stopped or not)."""

    def found_at_release(
        holder: str, start: float, lost_at: float, safe_until: float, granted: float
    ) -> RoundReport:
        return RoundReport(
            holder, "a", int(granted * 1e6), "lost", "not_owner", None, start, start + 0.2,
            safe_until, lost_at, left_at_end=0.1,
        )  # fmt: skip

    flush = Fault(1, 5.05, FaultKind.FLUSH, "", 0.01, 0.0, 0.5)
    lost_keys = Injection(flush, start=5.05, end=5.06, start_wall=NOW + 5.05, end_wall=NOW + 5.06)

    def summary_of(*rounds: RoundReport) -> Any:
        record = _stopped_holder_record(list(rounds))  # w1 was stopped from 1.0 to 3.0
        return summarize(dataclasses.replace(record, injections=(*record.injections, lost_keys)))

    flushed = found_at_release("w2", 5.0, 5.3, 5.5, NOW)  # its key was flushed at 5.05
    explained = summary_of(flushed)
    assert explained.data["not_owner_at_release"] == {
        "after_data_loss": 1,
        "answered_late": 0,
        "unexplained": 0,
    }
    assert not [f for f in explained.failures if "at release" in f]
    late = found_at_release("w2", 6.0, 6.6, 6.5, NOW + 6.0)  # answered after its deadline
    stopped = found_at_release("w1", 0.5, 1.2, 1.3, NOW)  # its holder was stopped
    nothing = found_at_release("w2", 7.0, 7.25, 7.5, NOW + 7.0)
    failed = summary_of(flushed, late, stopped, nothing)
    assert failed.data["not_owner_at_release"] == {
        "after_data_loss": 1,
        "answered_late": 1,
        "unexplained": 2,
    }
    assert not failed.ok
    assert "1 LockLost(not_owner) at release answered after the safe deadline" in "\n".join(
        failed.failures
    )
    assert "2 LockLost(not_owner) at release with no data-loss fault" in "\n".join(failed.failures)
    assert "1 after data loss, 1 answered after the deadline, 2 unexplained  <- must be 0" in (
        "\n".join(failed.lines)
    )


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0


# -- the 20-second run -----------------------------------------------------------------


def _chaos(*args: str, tmp: Path, timeout: float) -> tuple[int, str, str]:
    """Run ``python -m chaos ARGS``; on timeout stop it cleanly, then fail.

    Its work directory (kept when a run fails) goes under ``tmp``, which pytest rotates.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["TMPDIR"] = str(tmp)
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the run stops its workers and server
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"the chaos run did not end within {timeout:g} s\n{out}\n{err}")
    return proc.returncode, out, err


def _summary(*args: str, tmp: Path, timeout: float, status: int = 0) -> tuple[dict[str, Any], str]:
    """Run ``python -m chaos ARGS --json`` (see ``_chaos``) and check its exit status;
    returns its summary (the last line of its output) and its output."""
    code, out, err = _chaos(*args, "--json", tmp=tmp, timeout=timeout)
    assert code == status, f"{out}\n{err}"
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return summary, out


@needs_server
def test_chaos_run_of_20_seconds(tmp_path: Path):
    """Four workers of two contenders each, three locks, 20 s of faults of every kind,
    half the rounds held with ``async with lease`` and half with ``acquire()``, ``guard()``
    and ``release()``: every check passes."""
    summary, out = _summary(
        "--seconds",
        "20",
        "--workers",
        "4",
        "--seed",
        str(SEED),
        "--detached",
        "0.5",
        tmp=tmp_path,
        timeout=120,
    )
    assert summary["ok"]
    assert summary["seed"] == SEED
    assert summary["tasks"] == 2  # the default: contenders share their worker's client
    forms = summary["rounds"]["by_form"]
    assert forms["block"] >= 10, forms
    assert forms["detached"] >= 10, forms
    assert summary["overlap"]["unpaused"]["count"] == 0
    assert summary["fenced_writes"]["stale_accepted"] == 0
    assert summary["counter_mismatches"] == 0
    assert summary["keys_left"] == []
    assert summary["workers_died"] == []
    assert summary["unexpected_errors"] == 0
    assert summary["fencing_order_violations"] == 0
    assert len(summary["faults"]["by_kind"]) >= 6, summary["faults"]
    assert summary["faults"]["errors"] == 0
    assert summary["lock_lost"]["total"] > 0
    assert summary["acquisitions"]["total"] >= 30
    assert set(summary["acquisitions"]["by_lock"]) == {"lock-0", "lock-1", "lock-2"}
    assert "overlap, not paused  0 pairs" in out
    assert 20 <= summary["wall_seconds"] < 60


@needs_server
def test_chaos_run_of_semaphores(tmp_path: Path):
    """The semaphore mode: two locks of two permits each, eight contenders, 12 s of faults
    of every kind. Each permit passes every check a lock does, no lock ever has more than
    two unpaused holders, and both locks reach their limit."""
    summary, out = _summary(
        "--seconds",
        "12",
        "--workers",
        "4",
        "--locks",
        "2",
        "--limit",
        "2",
        "--seed",
        str(SEED),
        "--detached",
        "0.3",
        tmp=tmp_path,
        timeout=90,
    )
    assert summary["ok"]
    assert summary["limit"] == 2
    assert summary["locks"] == 2
    assert summary["most_holders_at_once"] == {"lock-0": 2, "lock-1": 2}
    assert set(summary["acquisitions"]["by_lock"]) == {
        "lock-0#0",
        "lock-0#1",
        "lock-1#0",
        "lock-1#1",
    }
    assert summary["overlap"]["unpaused"]["count"] == 0
    assert summary["fenced_writes"]["stale_accepted"] == 0
    assert summary["fenced_writes"]["accepted"] > 0
    assert summary["counter_mismatches"] == 0
    assert summary["fencing_order_violations"] == 0
    assert summary["keys_left"] == []
    assert summary["workers_died"] == []
    assert summary["unexpected_errors"] == 0
    assert summary["lock_lost"]["total"] > 0
    assert "2 locks of 2 permits" in out


@needs_server
@pytest.mark.slow
@pytest.mark.parametrize("limit", [1, 2], ids=["mutex", "semaphore"])
def test_chaos_run_catches_work_that_outlives_its_lease(tmp_path: Path, limit: int):
    """Negative control: with the hidden ``--sabotage`` the workers' bodies ignore the loss
    of their lease (shielded from its cancellation, no ``is_held()``). The checks must see
    the overlap, fail the run and print the replay command; fencing still keeps the data
    right. Seed 6: with two contenders per worker it failed 4 runs out of 4 (5-6 pairs);
    seed 5, chosen when workers had one contender, let 1 run out of 3 pass. In the
    semaphore mode (two locks of two permits) the limit check fails too."""
    kind = ["--locks", "2", "--limit", "2"] if limit == 2 else []
    summary, out = _summary(
        "--seconds",
        "20",
        "--workers",
        "4",
        "--seed",
        "6",
        "--sabotage",
        *kind,
        tmp=tmp_path,
        timeout=120,
        status=1,
    )
    assert summary["overlap"]["unpaused"]["count"] > 0
    assert summary["fenced_writes"]["stale_accepted"] == 0
    assert summary["counter_mismatches"] == 0
    replay = "FAILED: replay with python -m chaos --seed 6 --workers 4 --seconds 20"
    failed = [line for line in out.splitlines() if line.startswith(replay)]
    assert len(failed) == 1, out
    assert "--sabotage" in failed[0]
    assert ("--limit 2" in failed[0]) == (limit == 2)
    if limit == 2:
        assert max(summary["most_holders_at_once"].values()) > 2
        assert "more unpaused holders at once than the limit" in out


# -- the failover mode -----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 3, SEED])
def test_failover_schedule_is_bounded_and_healed_between_failovers(seed: int):
    schedule = make_failover_schedule(seed, 20.0, TTL, 4)
    assert schedule == make_failover_schedule(seed, 20.0, TTL, 4)
    assert len(schedule) == 4
    assert [f.index for f in schedule] == list(range(4))
    assert {f.kind for f in schedule} == {FaultKind.FAILOVER}
    assert schedule[0].at >= 2 * TTL
    for before, after in itertools.pairwise(schedule):
        assert after.at - before.end >= 3 * TTL  # a new replica and calm in between
    assert schedule[-1].end <= 20.0 - 1.5 * TTL - 3 * TTL
    for fault in schedule:
        assert fault.variant in ("lagging", "synced")
        assert fault.scope in ("holder", "all")
        assert 0 <= fault.amount <= 0.05 * TTL  # SIGKILL this long after the grant seen
        assert fault.duration == pytest.approx(1.5 * TTL + fault.amount)
    # a long run mixes the variants and scopes
    many = make_failover_schedule(seed, 600.0, TTL, 40)
    assert len(many) == 40
    assert {f.variant for f in many} == {"lagging", "synced"}
    assert {f.scope for f in many} == {"holder", "all"}


def test_failover_schedule_fits_the_run():
    assert len(make_failover_schedule(1, 15.0, TTL, 2)) == 2
    assert len(make_failover_schedule(1, 15.0, TTL, 50)) == 3  # 4.55 TTLs each at least
    assert make_failover_schedule(1, 4.0, TTL, 3) == ()
    with pytest.raises(ValueError, match="count"):
        make_failover_schedule(1, 20.0, TTL, 0)


def test_print_schedule_of_the_failover_mode(capsys: pytest.CaptureFixture[str]):
    assert main(["--seed", "3", "--failover", "--failovers", "3", "--print-schedule"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert all(" failover/" in line and "after a grant" in line for line in lines)
    assert (
        ChaosConfig(seed=3, failover=True, min_replicas=1)
        .replay()
        .endswith("--failover --min-replicas 1")
    )
    assert (
        ChaosConfig(seed=3, failover=True, failovers=9)
        .replay()
        .endswith("--failover --min-replicas 0 --failovers 9")
    )
    assert "--failover" not in ChaosConfig(seed=3).replay()


def _failover_injection(killed: float, promoted: float, now: float = NOW) -> Injection:
    """A failover whose primary was killed at monotonic ``killed`` and whose promoted
    replica the workers reached at ``promoted`` (wall clock: now - 1000 + monotonic)."""
    fault = Fault(0, 0.0, FaultKind.FAILOVER, "lagging", 1.2, 0.01, 0.5, "all")
    offset = now - 1000.0
    return Injection(
        fault,
        start=killed - 0.5,
        end=promoted + 0.2,
        start_wall=killed - 0.5 + offset,
        end_wall=promoted + 0.2 + offset,
        target="w1 on a",
        killed=killed,
        killed_wall=killed + offset,
        promoted=promoted,
        promoted_wall=promoted + offset,
        after_grant=True,
    )


def test_overlap_across_a_failover_is_a_double_grant_of_its_own():
    """Granted by the old primary and still guarding at its SIGKILL, then overlapped by a
    holder granted after it: a double grant across the failover (not a data loss, and
    not excused as one). Two holders both granted after it are a plain violation."""
    windows = failover_windows([_failover_injection(1000.5, 1000.51)])
    assert windows == [DataLoss(1000.5, 1000.51, NOW + 0.5, NOW + 0.51)]
    old = _interval("w1", NOW + 0.49, 1000.49, 1000.9)  # granted just before the kill
    new = _interval("w2", NOW + 0.6, 1000.6, 1001.0)  # granted by the promoted replica
    classes = classify_overlaps([old, new], [], [], TTL, now_wall=NOW, failovers=windows)
    assert len(classes.across_failover) == 1
    assert not classes.unpaused
    assert not classes.after_data_loss
    # without the failover window, the same pair is a plain violation
    assert classify_overlaps([old, new], [], [], TTL, now_wall=NOW).unpaused
    newer = _interval("w3", NOW + 0.7, 1000.7, 1001.2)
    classes = classify_overlaps([new, newer], [], [], TTL, now_wall=NOW, failovers=windows)
    assert len(classes.unpaused) == 1
    assert not classes.across_failover
    # a holder whose guard had ended before the kill overlaps nothing across it
    done = _interval("w1", NOW + 0.1, 1000.1, 1000.4)
    assert classify_overlaps([done, new], [], [], TTL, now_wall=NOW, failovers=windows) == (
        classify_overlaps([], [], [], TTL)
    )
    # a failover cut short before the promotion has no window
    cut_short = dataclasses.replace(_failover_injection(1000.5, 1000.51), promoted=None)
    assert failover_windows([cut_short]) == []


def _failover_record(min_replicas: int, intervals: list[Interval], now: float) -> RunRecord:
    injection = _failover_injection(1000.5, 1000.51, now)
    return RunRecord(
        seed=1,
        workers=2,
        seconds=10.0,
        locks=("a",),
        ttl=TTL,
        engine="test",
        schedule=(injection.fault,),
        injections=(injection,),
        rounds=(
            RoundReport(
                "w1", "a", 1, "unconfirmed", None, "ReplicationTimeout", None, None, None, None
            ),
        ),
        outcomes=(),
        intervals=tuple(intervals),
        pauses=(),
        attempts=(),
        fenced_violations=(),
        counters={},
        keys_left=(),
        wall_seconds=10.0,
        replay="",
        failover=True,
        min_replicas=min_replicas,
        replicas_started=2,
    )


def test_double_grants_across_a_failover_fail_the_run_only_with_min_replicas():
    now = time.time()  # (summarize reads tokens as timestamps near the present)
    old = _interval("w1", now + 0.49, 1000.49, 1000.9)
    new = _interval("w2", now + 0.6, 1000.6, 1001.0)
    guarded = summarize(_failover_record(1, [old, new], now))
    assert not guarded.ok
    assert "1 double grant(s) across a failover with min_replicas=1" in guarded.failures
    assert guarded.data["double_grants_across_failover"] == 1
    text = "\n".join(guarded.lines)
    assert (
        "double grants across a failover: 1 pairs, max 300 ms (lagging/all 1)  <- must be 0" in text
    )
    assert guarded.data["double_grants_by_failover"] == {"lagging/all": 1}
    assert "failover mode (primary + replica, min_replicas 1)" in text
    assert "failovers            1 of 1 scheduled, 1 right after a grant; 2 replicas" in text
    assert "ReplicationTimeout   1 acquisitions refused" in text
    assert guarded.data["replication_timeouts"] == 1
    assert guarded.data["mode"] == "failover"
    unguarded = summarize(_failover_record(0, [old, new], now))
    assert not [f for f in unguarded.failures if "failover" in f or "overlap" in f]
    assert unguarded.data["double_grants_across_failover"] == 1
    assert unguarded.data["most_holders_at_once"] == {"a": 1}  # the second one set aside
    assert "(what min_replicas prevents)" in "\n".join(unguarded.lines)
    # and the ordinary summary says nothing of failovers
    plain = summarize(dataclasses.replace(_failover_record(0, [], now), failover=False))
    assert not [line for line in plain.lines if "failover" in line]


@needs_server
async def test_a_write_the_lagging_replica_missed_is_lost_by_the_failover():
    """The failover mode's servers: a write answered while the link is held never
    reaches the replica, which the failover promotes without it; a write before is kept;
    the new replica syncs; the link follows the new primary."""
    async with Replication() as replication:
        first = replication.primary
        client = Redis.from_url(first.url)
        try:
            await client.set("kept", "1")
            assert await client.execute_command("WAIT", 1, 2000) == 1
            replication.hold_link()
            await client.set("missed", "1")
            assert await client.execute_command("WAIT", 1, 100) == 0
        finally:
            await client.aclose()
        replica = replication.replica
        await replication.kill_primary()
        promoted = await replication.promote()
        assert promoted is replica is replication.primary
        assert replication.replica is None
        assert not first.is_running
        client = Redis.from_url(promoted.url)
        try:
            assert await client.get("kept") == b"1"
            assert await client.get("missed") is None
            await client.set("after", "1")
            await replication.add_replica()
            assert replication.replica is not None
            assert replication.link.target_port == promoted.port
            assert await client.execute_command("WAIT", 1, 2000) == 1
        finally:
            await client.aclose()
        assert replication.replicas_started == 2


@needs_server
def test_chaos_run_of_failovers_with_min_replicas(tmp_path: Path):
    """The failover mode (issue 21 C): the primary is killed right after a grant, its
    replica promoted, the workers' proxies repointed, a new replica started, three
    times; with min_replicas=1 no lock is ever held twice, across a failover or not.
    Seed 5 schedules one failover of each kind: after a lag of the replica, right after
    a grant, and right after a grant with the grantee cut off from the new primary."""
    summary, out = _summary(
        "--failover",
        "--min-replicas",
        "1",
        "--failovers",
        "3",
        "--seconds",
        "15",
        "--seed",
        "5",
        tmp=tmp_path,
        timeout=90,
    )
    assert summary["ok"]
    assert summary["mode"] == "failover"
    assert summary["min_replicas"] == 1
    assert summary["failovers"]["done"] >= 1, summary["failovers"]
    assert summary["failovers"]["after_grant"] >= 1, summary["failovers"]
    assert summary["faults"]["errors"] == 0
    assert summary["double_grants_across_failover"] == 0
    assert summary["overlap"]["unpaused"]["count"] == 0
    assert summary["fenced_writes"]["stale_accepted"] == 0
    assert summary["counter_mismatches"] == 0
    assert summary["keys_left"] == []
    assert summary["workers_died"] == []
    assert summary["unexpected_errors"] == 0
    assert summary["acquisitions"]["total"] >= 10
    assert "failover mode (primary + replica, min_replicas 1)" in out


# -- the shared and fair modes, and the soak (issue 31) --------------------------------


def _mode_round(
    holder: str,
    kind: str,
    asked: float,
    waited: float,
    *,
    outcome: str = "released",
    granted: bool = True,
    blocking_timeout: float = 12 * TTL,
    body: float = 0.3,
) -> RoundReport:
    """A round on lock "a" asked for at ``asked``, its wait over at ``waited`` (its body
    then running for ``body`` s when ``granted``)."""
    start = waited if granted else None
    end = waited + body if granted else None
    return RoundReport(
        holder.partition("/")[0],
        "a",
        int((NOW + waited) * 1e6) if granted else None,
        outcome,
        None,
        None,
        start,
        end,
        None,
        None,
        holder=holder,
        lease_from=waited - 0.001 if granted else None,
        exit_end=end + 0.002 if end is not None else None,
        kind=kind,
        asked_at=asked,
        waited_until=waited,
        blocking_timeout=blocking_timeout,
    )


def test_shared_intervals_overlap_only_beside_an_exclusive_one():
    readers = [
        dataclasses.replace(_interval("r1", NOW, 1.0, 3.0), shared=True),
        dataclasses.replace(_interval("r2", NOW + 0.1, 1.5, 2.5), shared=True),
    ]
    assert check_no_overlap(readers) == []
    writer = _interval("w", NOW + 0.2, 2.9, 4.0)  # beside r1 for 0.1 s
    overlaps = check_no_overlap([*readers, writer])
    assert [(o.first.holder, o.second.holder) for o in overlaps] == [("r1", "w")]
    assert "shared" in str(overlaps[0])
    # fencing: readers are not compared with each other (r2 started first with the
    # higher token), but each is compared with the writers before it, and vice versa
    swapped = [
        dataclasses.replace(_interval("r1", NOW + 0.2, 1.6, 3.0), shared=True),
        dataclasses.replace(_interval("r2", NOW + 0.1, 1.5, 2.5), shared=True),
    ]
    assert check_fencing(swapped) == []
    late_writer = _interval("w", NOW + 0.15, 3.5, 4.0)  # token below r1's
    assert [v.later.holder for v in check_fencing([*swapped, late_writer])] == ["w"]
    stale_reader = dataclasses.replace(_interval("r3", NOW, 5.0, 6.0), shared=True)
    assert [v.later.holder for v in check_fencing([late_writer, stale_reader])] == ["r3"]


def test_history_file_keeps_the_shared_flag(tmp_path: Path):
    path = tmp_path / "history.jsonl"
    with History(path) as history:
        with history.guard("a", "r1", 5, shared=True):
            pass
        with history.guard("a", "w1", 6):
            pass
    assert "shared" not in path.read_text().splitlines()[1]  # exclusive lines as before
    assert [i.shared for i in History.load(path).intervals] == [True, False]


def test_an_exclusive_waiter_timed_out_behind_shared_holders_alone_is_starved():
    starved = _mode_round("w0/t0", "exclusive", 10.0, 12.4, outcome="timeout", granted=False)
    behind_writer = _mode_round("w1/t0", "exclusive", 20.0, 22.4, outcome="timeout", granted=False)
    in_fault = _mode_round("w2/t0", "exclusive", 30.0, 32.4, outcome="timeout", granted=False)
    writer = _interval("w3/t0", NOW, 21.0, 21.5)
    fault = Fault(0, 0.0, FaultKind.RESET, "plain", 0.0, 0.0, 0.5, "all")
    reset = Injection(fault, start=29.0, end=29.0)  # its aftermath reaches the wait
    rounds = [starved, behind_writer, in_fault]
    assert starved_writers(rounds, [writer], [reset], TTL) == [starved]
    waits = exclusive_waits([_mode_round("w0/t1", "exclusive", 1.0, 1.5), starved])
    assert waits == [pytest.approx(0.5)]


def test_a_grant_out_of_arrival_order_among_live_waiters_is_caught():
    first = _mode_round("w0/t0", "fair", 1.0, 3.0)  # asked first, granted after `jumper`
    jumper = _mode_round("w1/t0", "plain", 1.44, 2.0)
    close = _mode_round("w2/t0", "fair", 1.2, 2.5)  # asked within the margin of both
    violations = out_of_order([first, jumper, close], [], [], TTL)
    assert [(v.earlier.who, v.later.who) for v in violations] == [("w0/t0", "w1/t0")]
    assert "was granted" in str(violations[0])
    # excused: the earlier waiter was stopped, or a data loss emptied the queue
    assert out_of_order([first, jumper], [Pause("w0/t0", 1.2, 1.4)], [], TTL) == []
    assert out_of_order([first, jumper], [], [(1.6, 1.7)], TTL) == []
    # excused: a fault cutting connections when the earlier one asked (its first attempt
    # may not have arrived: it arrives by its next unprompted try), but not one before
    cut = Fault(0, 0.0, FaultKind.RESET, "refuse", 0.0, 0.0, 0.5, "all")
    assert out_of_order([first, jumper], [], [], TTL, [Injection(cut, 0.95, 1.05)]) == []
    assert len(out_of_order([first, jumper], [], [], TTL, [Injection(cut, 0.5, 0.9)])) == 1
    # a waiter that gave up before the grant was not waiting any more
    gone = _mode_round("w0/t0", "fair", 1.0, 1.9, outcome="timeout", granted=False)
    assert out_of_order([gone, jumper], [], [], TTL) == []


def test_the_lock_free_while_a_live_waiter_waits_is_measured_against_the_bound():
    holder = _mode_round("w0/t0", "fair", 0.0, 0.1, body=0.4)  # holds to 0.5
    dead_head = _mode_round("w1/t0", "fair", 0.2, 5.0, granted=False, outcome="cancelled")
    waiter = _mode_round("w2/t0", "fair", 0.2, 5.0, body=0.2)  # gets it 4.5 s later
    gaps = free_while_waiting([holder, dead_head, waiter], [Pause("w1/t0", 0.3, 4.0)], TTL)
    assert [g.waiter for g in gaps] == ["w2/t0"]
    assert gaps[0].seconds > fair_bound(TTL)
    assert fair_bound(TTL) == pytest.approx(1.5 * FAIR_PATIENCE + TTL + 0.25)
    # the only waiter stopped: nobody live waited, nothing to measure
    assert free_while_waiting([holder, waiter], [Pause("w2/t0", 1.0, 2.0)], TTL) == []


def test_the_fair_mode_schedules_its_own_faults_and_the_others_none_of_them():
    fair = make_schedule(SEED, 120.0, TTL, FAIR_KINDS)
    assert {f.kind for f in fair} == set(FAIR_KINDS)
    stops = [f for f in fair if f.kind is FaultKind.WAITER_STOP]
    assert all(f.duration == pytest.approx(1.5 * FAIR_PATIENCE) for f in stops)
    assert FaultKind.WAITER_STOP not in ORDINARY
    assert ChaosConfig(seed=SEED, fair=True, seconds=120.0).schedule() == fair


@pytest.mark.parametrize(
    "args",
    [
        ["--shared", "1.5"],
        ["--shared", "0.5", "--fair"],
        ["--fair", "--limit", "2"],
        ["--shared", "0.5", "--failover"],
        ["--soak", "1", "--fair"],
        ["--soak", "1", "--sabotage"],
        ["--soak", "0"],
        ["--redlock", "2"],
        ["--redlock", "3", "--fair"],
    ],
)
def test_bad_arguments_of_the_new_modes_are_refused(
    args: list[str], capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err


def test_replay_names_the_shared_and_fair_modes():
    assert ChaosConfig(seed=1, shared=0.5).replay().endswith("--shared 0.5")
    assert ChaosConfig(seed=1, fair=True, locks=1).replay().endswith("--locks 1 --fair")
    assert ChaosConfig(seed=1).mode == "mutex"
    assert ChaosConfig(seed=1, shared=0.5).mode == "shared"
    assert ChaosConfig(seed=1, redlock=3).replay().endswith("--redlock 3")
    assert ChaosConfig(seed=1, redlock=3).mode == "redlock"
    assert {f.kind for f in ChaosConfig(seed=SEED, redlock=3, seconds=60).schedule()} == set(
        REDLOCK_KINDS
    )


def test_the_soak_rotates_every_mode_and_adds_up_one_table():
    runs = plan(100, 9.0)
    assert [c.seed for c in runs] == list(range(100, 100 + len(runs)))
    modes = ["mutex", "semaphore", "shared", "fair", "failover", "redlock", "jobs", "cluster"]
    modes += ["jobs-fenced", "jobs-every", "jobs-run"]
    assert [c.mode for c in runs] == modes
    assert sum(c.seconds + 3.0 for c in runs) <= 9.0 * 60 + 1e-6
    assert all(15 <= c.seconds <= 60 for c in runs)
    assert {c.detached for c in plan(100, 20.0)} == {0.0, 0.5}  # both lease forms

    def fake(config: ChaosConfig) -> tuple[Summary, Path] | str:
        if config.mode == "failover":
            return "no server"
        bad = config.mode == "fair"
        data = {
            "seconds": config.seconds,
            "faults": {"by_kind": {"flush": 2, "reset": 1}},
            "acquisitions": {"total": 10},
            "lock_lost": {"by_reason": {"deadline": 1}},
            "overlap": {"unpaused": {"count": 0}},
            "fair": {"out_of_order": 3 if bad else 0, "free_while_waiting": {"over_bound": 0}},
        }
        return Summary(not bad, ("3 grants out of order",) if bad else (), data, (), ()), Path()

    out = io.StringIO()
    assert soak(100, 1.5, runner=fake, out=out) == 1
    text = out.getvalue()
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert set(rows) == {"mode", *modes}
    assert "| mutex | 1 (0) | 15 | 3: flush 2, reset 1 | 10 | 1: deadline 1 |" in rows["mutex"]
    assert rows["fair"].endswith("| 3 |")  # the mode's own must-be-0 column
    assert rows["failover"].startswith("| failover | 1 (1) |")  # could not be carried out
    assert rows["redlock"].startswith("| redlock | 0 (0) |")  # 1.5 min: 5 runs only
    assert "python -m chaos --seed 103 --workers 4 --seconds 15 --locks 1 --fair" in text
    assert "--failover --min-replicas 1  # could not be carried out: no server" in text
    assert "OK: every run" not in text


@needs_server
def test_chaos_run_of_shared_leases(tmp_path: Path):
    """The shared mode: half the rounds hold a shared lease, 10 s of faults of every kind.
    No exclusive holder beside any other, shared holders together, no exclusive waiter
    starved by shared holders alone, and every check of the ordinary run."""
    summary, out = _summary(
        "--seconds", "10", "--seed", str(SEED), "--shared", "0.5", tmp=tmp_path, timeout=90
    )
    assert summary["ok"], out
    assert summary["mode"] == "shared"
    shared = summary["shared"]
    assert shared["acquisitions"]["shared"] >= 10, shared
    assert shared["acquisitions"]["exclusive"] >= 5, shared
    assert max(summary["most_shared_holders_at_once"].values()) >= 2
    assert shared["starved_writers"] == 0
    assert shared["exclusive_wait"]["n"] == shared["acquisitions"]["exclusive"]
    assert summary["overlap"]["unpaused"]["count"] == 0
    assert summary["fencing_order_violations"] == 0
    assert summary["fenced_writes"]["stale_accepted"] == 0
    assert summary["keys_left"] == []
    assert summary["workers_died"] == []
    assert "exclusive waiters starved by shared holders" in out


@needs_server
def test_chaos_run_of_fair_locks(tmp_path: Path):
    """The fair mode: eight contenders queue for one fair lock, a quarter of them giving
    up early, while the nemesis flushes and restarts the server, resets connections and
    stops a waiter past the queue's patience (seed 20240603, 10 s). Grants follow arrival
    among live waiters, and the lock is never left free for longer than the bound while
    a live waiter waits."""
    summary, out = _summary(
        "--seconds", "10", "--seed", str(SEED), "--fair", "--locks", "1", tmp=tmp_path, timeout=90
    )
    assert summary["ok"], out
    assert summary["mode"] == "fair"
    assert summary["faults"]["by_kind"].get("waiter_stop") == 1, summary["faults"]
    fair = summary["fair"]
    assert fair["acquisitions"].get("fair", 0) >= 10, fair
    assert fair["out_of_order"] == 0
    assert fair["free_while_waiting"]["count"] > 0
    assert fair["free_while_waiting"]["over_bound"] == 0
    assert summary["overlap"]["unpaused"]["count"] == 0
    assert summary["fenced_writes"]["stale_accepted"] == 0
    assert summary["keys_left"] == []
    assert summary["workers_died"] == []


@needs_server
def test_chaos_run_of_redlock(tmp_path: Path):
    """The Redlock mode: three independent servers, each lease held on a majority, while
    one server at a time is restarted without persistence, cut off and paused (seed
    20240603, 10 s): no overlap while a majority is healthy, every check passes."""
    summary, out = _summary(
        "--seconds", "10", "--seed", str(SEED), "--redlock", "3", tmp=tmp_path, timeout=90
    )
    assert summary["ok"], out
    assert summary["mode"] == "redlock"
    kinds = summary["faults"]["by_kind"]
    assert {"server_restart", "server_cut", "server_stop"} <= set(kinds), kinds
    assert summary["acquisitions"]["total"] >= 20
    assert summary["overlap"]["unpaused"]["count"] == 0
    assert summary["fenced_writes"]["stale_accepted"] == 0
    assert summary["counter_mismatches"] == 0
    assert summary["keys_left"] == []
    assert summary["workers_died"] == []
    assert "Redlock mode over 3 servers" in out


@needs_server
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fair", "redlock"])
def test_the_fair_and_redlock_checks_catch_their_sabotage(tmp_path: Path, mode: str):
    """Negative controls, 10 s each (seed 6). Fair: a third of the rounds take the lock
    with a plain ``lease()``, which does not queue: grants out of arrival order. Redlock:
    each fault of a server hits a majority of them, and bodies outlive their leases:
    holders overlap. (The shared mode's is the ordinary ``--sabotage``: see
    docs/chaos.md.)"""
    args = ["--fair", "--locks", "1"] if mode == "fair" else ["--redlock", "3"]
    summary, out = _summary(
        "--seconds", "10", "--seed", "6", "--sabotage", *args, tmp=tmp_path, timeout=90, status=1
    )
    if mode == "fair":
        assert summary["fair"]["out_of_order"] > 0
        assert summary["fair"]["acquisitions"].get("plain", 0) > 0
        assert summary["overlap"]["unpaused"]["count"] == 0  # the jumpers still exclude
    else:
        assert summary["overlap"]["unpaused"]["count"] > 0
        assert summary["fenced_writes"]["stale_accepted"] == 0  # fencing still holds
    failed = [line for line in out.splitlines() if line.startswith("FAILED: replay with")]
    assert len(failed) == 1, out
    assert "--sabotage" in failed[0]
    assert args[0] in failed[0]


def test_two_results_for_one_job_key_are_caught_unless_a_data_loss_came_between():
    def call(holder: str, result: str, at: float, ran: bool = False) -> RoundReport:
        report = _mode_round(holder, "job", at - 0.5, at, body=0.0)
        return dataclasses.replace(
            report,
            lock="job-1",
            result=result,
            ran=result if ran else None,
            body_start=at - 0.4 if ran else None,
            body_end=at - 0.01 if ran else None,
        )

    first = call("w0/t0", "w0/t0#1", 2.0, ran=True)
    same = call("w1/t0", "w0/t0#1", 2.5)
    other = call("w2/t0", "w2/t0#4", 4.0, ran=True)
    conflicts = job_results([first, same, other], [])
    assert [(c.first.who, c.second.who, c.after_data_loss) for c in conflicts] == [
        ("w0/t0", "w2/t0", False)
    ]
    assert "'w0/t0#1'" in str(conflicts[0])
    # a FLUSHALL after the first job had ended forgets its result: counted apart
    assert [c.after_data_loss for c in job_results([first, same, other], [(3.0, 3.1)])] == [True]
    # ... but one before it had ended does not explain a second result
    assert [c.after_data_loss for c in job_results([first, other], [(1.7, 1.8)])] == [False]
    assert job_results([first, same], []) == []


@needs_server
async def test_once_gives_every_caller_one_result_when_the_store_is_not_answered(
    prefix: str,
):
    """``python -m chaos --jobs --seconds 20 --seed 11`` found it (a reset refusing new
    connections while the runner stored its result); here, deterministically, the store
    is black-holed: the runner was given ``first``, which was never stored, and a caller
    after the lease's TTL ran the job again and was given ``second``. Now the runner,
    which cannot read the result back either, raises ``LockLost`` instead of returning a
    result no other caller is given; a later caller runs the job (nothing was stored) and
    every caller after it gets that one result."""
    server = RedisServer()
    await asyncio.to_thread(server.start)
    try:
        async with FaultProxy(server.host, server.port) as proxy:
            client = Redis.from_url(proxy.url, socket_timeout=0.5)
            observer = Redis.from_url(server.url)
            try:

                async def first_job() -> str:
                    proxy.set_mode(ProxyMode.BLACKHOLE)  # the store will not get through
                    return "first"

                async def second_job() -> str:
                    return "second"

                with pytest.raises(asynclock.LockLost, match="whether the result was stored"):
                    await asynclock.once(client, "job", first_job, ttl=0.6, prefix=prefix)
                proxy.set_mode(ProxyMode.PASS)
                again = await asynclock.once(
                    observer, "job", second_job, ttl=0.6, blocking_timeout=5, prefix=prefix
                )
                assert again == "second"
                assert await asynclock.once(client, "job", first_job, prefix=prefix) == again
            finally:
                await client.aclose()
                await observer.aclose()
    finally:
        await asyncio.to_thread(server.stop)


# -- the cluster mode (issue 31) -------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7, SEED])
def test_the_cluster_schedule_is_its_own_and_keeps_room_to_heal(seed: int) -> None:
    """Migrations, failovers and holder stops only; in order, each failover followed by
    the seconds it takes to heal (so the next fault finds three primaries with replicas),
    every fault ending 1.5 TTLs before the end; the same seed, the same schedule."""
    schedule = ChaosConfig(seed=seed, cluster=True, seconds=120.0).schedule()
    assert schedule == make_cluster_schedule(seed, 120.0, TTL)
    assert {f.kind for f in schedule} == set(CLUSTER_KINDS)
    assert schedule[0].at >= 2 * TTL - 1e-9
    assert schedule[-1].end <= 120.0 - 1.5 * TTL + 1e-9
    for one, two in itertools.pairwise(schedule):
        room = {"takeover": 4.0, "automatic": 8.0}.get(one.variant, 0.0)
        room += 0.5 if one.kind is FaultKind.MIGRATE else 0.0
        assert two.at >= one.end + room + TTL - 1e-9
    assert {f.variant for f in schedule if f.kind is FaultKind.MIGRATE} <= {
        "quick",
        "halfway",
        "slow",
    }
    assert {f.variant for f in schedule if f.kind is FaultKind.FAILOVER} <= {
        "takeover",
        "automatic",
    }
    assert (
        ChaosConfig(seed=3, cluster=True, min_replicas=1)
        .replay()
        .endswith("--cluster --min-replicas 1")
    )


def _migration(start: float, end: float, kind: FaultKind = FaultKind.MIGRATE) -> Injection:
    fault = Fault(0, 0.0, kind, "halfway", end - start, 0.0, 0.5)
    return Injection(fault, start=start, end=end, start_wall=NOW + start, end_wall=NOW + end)


def test_a_lease_lost_across_a_migration_is_caught_unless_another_fault_explains_it() -> None:
    """The cluster mode's own check: a lease held while its slot migrated and lost with
    no other fault in its way is lost to the migration; the same loss with a failover or
    a stop of its holder in its way is not; a lease granted after the migration, or
    never lost, is not."""
    lost = _mode_round("worker-0/t0", "exclusive", 10.0, 10.1, outcome="lost", body=1.0)
    lost = dataclasses.replace(lost, reason="deadline", lost_at=11.0)
    kept = _mode_round("worker-1/t0", "exclusive", 10.0, 10.2, body=1.0)
    later = dataclasses.replace(
        _mode_round("worker-2/t0", "exclusive", 12.0, 12.1, outcome="lost"), reason="not_owner"
    )
    migration = _migration(10.5, 10.8)
    found = migration_losses([lost, kept, later], [migration], TTL)
    assert [loss.round for loss in found] == [lost]
    assert "held across" in str(found[0])
    assert across_migrations([lost, kept, later], [migration]) == {
        "held": 2,
        "waited": 0,
        "waited_then_granted": 0,
    }
    waiter = _mode_round("worker-3/t0", "exclusive", 10.4, 10.9)
    assert across_migrations([waiter], [migration])["waited_then_granted"] == 1
    for other in (FaultKind.FAILOVER, FaultKind.HOLDER_STOP):
        assert migration_losses([lost], [migration, _migration(9.5, 9.7, other)], TTL) == []
    skipped = dataclasses.replace(migration, outcome="error: refused")
    assert migration_losses([lost], [skipped], TTL) == []


@needs_server
def test_the_primary_of_a_key_killed_three_times_rejoins_each_time_as_an_empty_replica() -> None:
    """The cluster mode's failover, by hand, three times over: the primary of a key is
    killed and its replica taken over; the killed node rejoins, empty, as the replica of
    the promoted one. The third time, the node killed is one whose sync as a replica
    wrote an RDB file holding the key (it must not load it: a node that is not empty
    cannot become a replica). The key survives; the cluster is healthy after each
    failover (six nodes, three primaries with slots, none failing)."""
    cluster = ChaosCluster()
    cluster.start()
    try:
        key = "asynclock:{lock-0}"
        slot = cluster.slot(key)
        first = cluster.owner(slot)
        assert first.command("SET", key, "kept") == b"+OK\r\n"
        second = cluster.replica_of(first)
        for _ in range(3):
            primary = cluster.owner(slot)
            replica = cluster.replica_of(primary)
            assert replica is not None
            assert primary.command("WAIT", 1, 5000) == b":1\r\n"
            primary.kill()
            cluster.promote(replica, takeover=True)
            cluster.rejoin_as_replica(primary, replica)
            assert cluster.owner(slot) is replica
            assert cluster.replica_of(replica) is primary
            assert replica.command("GET", key) == b"$4\r\nkept\r\n"
        assert cluster.owner(slot) is second
        assert cluster.replicas_started == 6
    finally:
        cluster.stop()
    assert not any(node.is_running for node in cluster.nodes)


@needs_server
def test_chaos_run_of_a_cluster(tmp_path: Path) -> None:
    """The cluster mode: three primaries with a replica each; seed 7 (15 s) kills the
    primary of a lock right after a grant (its replica taken over), migrates a leased
    slot slowly (MIGRATING with its keys still on the owner, then moved), and stops a
    holder, with min_replicas=1: no lease lost to the migration, no lock held twice, no
    key left."""
    summary, out = _summary(
        "--cluster", "--seconds", "15", "--seed", "7", tmp=tmp_path, timeout=120
    )
    assert summary["ok"], out
    assert summary["mode"] == "cluster"
    assert summary["min_replicas"] == 1
    kinds = summary["faults"]["by_kind"]
    assert kinds.get("migrate", 0) >= 1, kinds
    assert kinds.get("failover", 0) >= 1, kinds
    assert summary["faults"]["errors"] == 0
    assert summary["cluster"]["held_across_migration"] >= 1
    assert summary["cluster"]["waited_then_granted"] >= 1
    assert summary["cluster"]["lost_to_migration"] == 0
    assert summary["failovers"]["replicas_started"] == 4  # three, then the killed one
    assert summary["double_grants_across_failover"] == 0
    assert summary["overlap"]["unpaused"]["count"] == 0
    assert summary["fenced_writes"]["stale_accepted"] == 0
    assert summary["counter_mismatches"] == 0
    assert summary["keys_left"] == []
    assert summary["workers_died"] == []
    assert summary["acquisitions"]["total"] >= 20
    assert "cluster mode (3 primaries + replicas, min_replicas 1)" in out


# -- the job sub-modes (chaos._jobs) -----------------------------------------------------


def _run(key: str, who: str, start: float, end: float, label: str = "") -> jobcheck.Run:
    return jobcheck.Run(key, who, start, end, label or f"{who}@{start:g}")


def test_job_runs_overlap_unless_a_pause_or_a_data_loss_explains_it() -> None:
    stop = jobcheck.Hit("runner_stop", 10.0, 12.0, target="w1.0")
    flush = jobcheck.Hit("flush", 20.0, 20.1, data_loss=True)
    runs = [
        _run("a", "w0.0", 1.0, 2.0),
        _run("a", "w1.0", 1.5, 2.5),  # overlaps the first: not excused
        _run("a", "w1.0", 11.0, 13.0),  # stopped while it ran
        _run("a", "w2.0", 12.5, 13.5),
        _run("a", "w0.0", 19.0, 20.5),  # still running when the server lost its keys
        _run("a", "w2.0", 20.2, 21.0),
        _run("b", "w3.0", 1.2, 1.8),  # another key: no overlap with "a"
    ]
    found = jobcheck.overlaps(runs, [stop, flush], TTL)
    assert [(a.start, b.start) for a, b in found.unexcused] == [(1.0, 1.5)]
    assert [(a.start, b.start) for a, b in found.paused] == [(11.0, 12.5)]
    assert [(a.start, b.start) for a, b in found.after_loss] == [(19.0, 20.2)]
    assert jobcheck.longest(found.after_loss) == pytest.approx(0.3)


def test_a_fenced_run_ends_at_its_end_its_stop_its_round_or_its_kill() -> None:
    records = [
        {"e": "start", "t": 1.0, "key": "k", "who": "w0.0/t0", "run": "w0.0/t0#1"},
        {"e": "end", "t": 2.0, "key": "k", "who": "w0.0/t0", "run": "w0.0/t0#1"},
        {"e": "start", "t": 3.0, "key": "k", "who": "w1.0/t1", "run": "w1.0/t1#1"},
        {"e": "stop", "t": 3.5, "key": "k", "who": "w1.0/t1", "run": "w1.0/t1#1"},
        {"e": "round", "t": 3.9, "key": "k", "who": "w1.0/t1", "run": "w1.0/t1#1"},
        {"e": "start", "t": 5.0, "key": "k", "who": "w2.0/t0", "run": "w2.0/t0#1"},
        {"e": "start", "t": 7.0, "key": "k", "who": "w3.0/t0", "run": "w3.0/t0#1"},
    ]
    kill = jobcheck.Hit("runner_kill", 6.0, 6.2, target="w2.0")
    runs = jobcheck.fenced_runs(records, [kill], until=9.0)
    assert [(r.who, r.start, r.end) for r in runs] == [
        ("w0.0", 1.0, 2.0),
        ("w1.0", 3.0, 3.5),
        ("w2.0", 5.0, 6.0),
        ("w3.0", 7.0, 9.0),
    ]


def test_an_effect_written_twice_is_caught_and_a_refused_write_is_not_counted() -> None:
    def attempt(seq: int, key: str, op: str, accepted: bool) -> Any:
        from asynclock.testing import Attempt

        return Attempt(seq, key, op, None if op == "unfenced" else seq, accepted, 0.0, "w")  # type: ignore[arg-type]

    attempts = [
        attempt(1, "effect:a", "claim", True),
        attempt(2, "effect:a", "write", True),
        attempt(3, "effect:a", "write", False),
        attempt(4, "effect:b", "write", True),
        attempt(5, "effect:c", "unfenced", True),
        attempt(6, "effect:c", "unfenced", True),
    ]
    assert list(jobcheck.effects_applied_twice(attempts)) == ["effect:c"]


def test_a_result_stored_twice_is_caught_unless_a_data_loss_came_between() -> None:
    """A fenced job's result names the run whose effect was applied and the run storing
    it: a second store of a key is caught unless a data loss came between; a result
    naming another effect is caught whatever happened (found first by ``--jobs fenced
    --seed 11 --seconds 30``: a caller cut off while storing was given the read-back
    result of the run that stored it next, which is no second store)."""

    def call(who: str, t: float, result: str, run: str | None = None) -> dict[str, Any]:
        ran = result if run else None
        return {"e": "round", "t": t, "key": "k", "who": who, "run": run, "ran": ran,
                "result": result}  # fmt: skip

    records = [
        {"e": "end", "t": 1.9, "run": "a#1"},
        call("a", 2.0, "a#1@a#1", run="a#1"),
        call("x", 2.1, "a#1@a#1"),
        {"e": "end", "t": 3.9, "run": "b#1"},
        call("b", 4.0, "a#1@b#1", run="b#1"),  # stored again, no data loss: twice
        {"e": "end", "t": 6.9, "run": "c#1"},
        call("c", 7.0, "a#1@c#1", run="c#1"),  # after the flush: by design
        call("d", 7.5, "a#1@c#1", run="d#1"),  # cut off; given c's result read back
        call("e", 9.0, "e#1@e#1"),  # another effect: never
    ]
    flush = jobcheck.Hit("flush", 5.0, 5.1, data_loss=True)
    changes = jobcheck.stored_results(records, [flush])
    assert [(c.first.who, c.second.who, c.after_data_loss) for c in changes] == [
        ("a", "b", False),
        ("b", "c", True),
        ("c", "e", False),
    ]
    assert [(a["who"], b["who"]) for a, b in jobcheck.effects_differ(records)] == [("a", "e")]


def test_a_tick_run_twice_is_caught_unless_its_claim_may_have_been_flushed() -> None:
    runs = [
        _run("tick-job-0", "w0.0", 1.0, 1.1, "tick-job-0@1000"),
        _run("tick-job-0", "w1.0", 1.6, 1.7, "tick-job-0@1000"),  # a late clock: twice
        _run("tick-job-0", "w0.0", 4.0, 4.1, "tick-job-0@4000"),
        _run("tick-job-0", "w2.0", 4.8, 4.9, "tick-job-0@4000"),  # after the flush
        _run("tick-job-1", "w1.0", 1.6, 1.7, "tick-job-1@1000"),  # another job's tick
    ]
    flush = jobcheck.Hit("flush", 4.5, 4.6, data_loss=True)
    twice, after_loss = jobcheck.ticks_run_twice(runs, [flush], period=3.0)
    assert [b.who for _, b in twice] == ["w1.0"]
    assert [b.who for _, b in after_loss] == ["w2.0"]
    records = [{"e": "tick", "t": 1.0, "who": "w0.0", "job": "j", "tick": 5}]
    assert jobcheck.tick_runs(records, until=2.0) == [_run("j", "w0.0", 1.0, 2.0, "j@5")]
    # With the claim's time known, only a loss after it erased it: a flush before the
    # claim (a second run of the tick woken for late, then) is no excuse.
    claimed = dataclasses.replace(runs[2], granted=3.95)
    early = jobcheck.Hit("flush", 3.0, 3.1, data_loss=True)
    twice, after_loss = jobcheck.ticks_run_twice([claimed, runs[3]], [early], period=3.0)
    assert (len(twice), len(after_loss)) == (1, 0)
    twice, after_loss = jobcheck.ticks_run_twice([claimed, runs[3]], [flush], period=3.0)
    assert (len(twice), len(after_loss)) == (0, 1)


def test_a_command_lives_from_its_first_line_to_its_last() -> None:
    records = [
        {"e": "cmd-start", "t": 1.0, "id": "w0.0#1"},
        {"e": "cmd-beat", "t": 1.04, "id": "w0.0#1"},
        {"e": "cmd-beat", "t": 1.08, "id": "w0.0#1"},  # then killed
        {"e": "exit", "t": 1.2, "id": "w0.0#1", "status": 75, "launched": 0.4},
        {"e": "cmd-start", "t": 2.0, "id": "w1.0#3"},
        {"e": "cmd-end", "t": 2.5, "id": "w1.0#3"},
    ]
    runs = jobcheck.command_runs(records)
    assert runs == [
        jobcheck.Run("cron-job", "w0.0", 1.0, 1.08, "w0.0#1", granted=0.4),
        _run("cron-job", "w1.0", 2.0, 2.5, "w1.0#3"),
    ]
    # A restart while w0.0#1's supervisor held the lease, before its command started
    # (found by --jobs run --seed 43 --seconds 120): its lease counts from the launch.
    restart = jobcheck.Hit("restart", 0.8, 0.9, data_loss=True)
    later = _run("cron-job", "w2.0", 1.05, 1.5)
    found = jobcheck.overlaps([runs[0], later], [restart], TTL)
    assert (len(found.after_loss), len(found.unexcused)) == (1, 0)
    found = jobcheck.overlaps([runs[0], later], [], TTL)
    assert (len(found.after_loss), len(found.unexcused)) == (0, 1)


def test_the_job_modes_schedule_their_own_faults_and_name_themselves() -> None:
    for mode, kinds in JOB_KINDS.items():
        config = ChaosConfig(seed=SEED, jobs_mode=mode, seconds=120)
        assert {f.kind for f in config.schedule()} == set(kinds)
        assert config.mode == f"jobs-{mode}"
        assert config.replay().endswith(f"--jobs {mode}")
    stops = [f for f in ChaosConfig(seed=1, jobs_mode="every", seconds=600).schedule()]
    lengths = [f.duration for f in stops if f.kind is FaultKind.RUNNER_STOP]
    assert min(lengths) >= 2.5 * TTL
    assert max(lengths) > 4 * TTL
    period = PERIOD_TTLS * TTL
    for seed in range(20):
        clocks = skews(seed, 4, period)
        assert max(clocks) - min(clocks) < period / 2  # (what every() promises to absorb)
        assert [c > 0 for c in clocks] == [True, False, True, False]


@pytest.mark.parametrize(
    ("args", "jobs", "jobs_mode"),
    [(["--jobs"], True, ""), (["--jobs", "once"], True, ""), (["--jobs", "run"], False, "run")],
)
def test_jobs_alone_is_the_once_mode_and_a_kind_picks_a_sub_mode(
    args: list[str], jobs: bool, jobs_mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, "--seed", "3", "--seconds", "15", "--print-schedule"]) == 0
    lines = capsys.readouterr().out.splitlines()
    config = ChaosConfig(seed=3, seconds=15, jobs=jobs, jobs_mode=jobs_mode)
    assert lines == [fault.describe() for fault in config.schedule()]


_JOB_RUNS = {  # mode: (seed, seconds, the faults its schedule must have brought)
    "fenced": ("1", "15", {"runner_kill", "runner_stop", "flush", "restart"}),
    "every": ("2", "15", {"runner_stop", "flush", "restart"}),
    "run": ("31", "15", {"runner_stop", "supervisor_stop", "supervisor_kill", "restart"}),
}


@needs_server
@pytest.mark.parametrize("mode", sorted(_JOB_RUNS))
def test_chaos_run_of_a_job_mode(tmp_path: Path, mode: str) -> None:
    """15 s of each job sub-mode (see docs/chaos.md): ``once()`` callers whose runners
    are killed and stopped apply every job's effect once and get one result per key;
    ``every()`` on four clocks skewed up to a quarter period runs each tick once;
    ``asynclock run`` commands of four machines (half ignoring SIGTERM) never overlap,
    also when ``asynclock run`` alone is stopped or killed (its reaper stops them)."""
    seed, seconds, kinds = _JOB_RUNS[mode]
    summary, out = _summary(
        "--seconds", seconds, "--seed", seed, "--jobs", mode, tmp=tmp_path, timeout=90
    )
    assert summary["ok"], out
    assert summary["mode"] == f"jobs-{mode}"
    assert kinds <= set(summary["faults"]["by_kind"]), summary["faults"]
    assert summary["overlap"]["unpaused"]["count"] == 0
    assert summary["workers_died"] == []
    jobs = summary["jobs"]
    assert jobs["stored_twice"] == 0
    if mode == "fenced":
        assert jobs["runs"] >= 10, jobs
        assert jobs["effects_applied_twice"] == 0
        assert summary["fenced_writes"]["stale_accepted"] == 0
        assert summary["fenced_writes"]["applied"] >= 5
    elif mode == "every":
        assert jobs["ticks"] >= 8, jobs
        assert jobs["ticks_run_twice"] == 0
    else:
        assert jobs["commands"] >= 5, jobs
        assert jobs["exit_status"].get("3", 0) > 0, jobs  # (machines found it busy)


@needs_server
@pytest.mark.slow
def test_the_cluster_checks_catch_a_migration_that_loses_the_lease(tmp_path: Path) -> None:
    """Negative control of the cluster mode (seed 7, 15 s, the run above): each
    migration deletes the lease key of the lock it moves (a resharding that loses a key),
    and bodies outlive their leases: a lease lost to a migration, reported."""
    summary, out = _summary(
        "--cluster",
        "--seconds",
        "15",
        "--seed",
        "7",
        "--sabotage",
        tmp=tmp_path,
        timeout=120,
        status=1,
    )
    # The deleted key makes its holder lose the lease (not_owner) while others take the
    # lock: counted as lost to the migration, unless another fault of the seed (its
    # failover) came close enough to explain the loss, as on a loaded machine it may:
    # then its holders overlapped, which the run reports as well. (The rule that counts a
    # loss as the migration's has unit tests of its own, above.)
    caught = summary["cluster"]["lost_to_migration"] + summary["double_grants_across_failover"]
    assert caught + summary["overlap"]["unpaused"]["count"] >= 1, out
    if summary["cluster"]["lost_to_migration"]:
        assert "lease(s) lost to a slot migration" in out
    failed = [line for line in out.splitlines() if line.startswith("FAILED: replay with")]
    assert len(failed) == 1, out
    assert "--sabotage" in failed[0]
    assert "--cluster --min-replicas 1" in failed[0]


@needs_server
@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(_JOB_RUNS))
def test_the_job_mode_checks_catch_their_sabotage(tmp_path: Path, mode: str) -> None:
    """Negative controls, 15 s each: fenced jobs that ignore their lease's loss and write
    their effect unfenced apply it twice; the old ``lease(blocking=False)`` recipe on
    skewed clocks runs ticks twice; commands that fork into the background overlap."""
    seed, seconds, _ = _JOB_RUNS[mode]
    summary, out = _summary(
        "--seconds", seconds, "--seed", seed, "--jobs", mode, "--sabotage",
        tmp=tmp_path, timeout=90, status=1,
    )  # fmt: skip
    jobs = summary["jobs"]
    if mode == "fenced":
        assert jobs["effects_applied_twice"] > 0, jobs
    elif mode == "every":
        assert jobs["ticks_run_twice"] > 0, jobs
    else:
        assert summary["overlap"]["unpaused"]["count"] > 0
    failed = [line for line in out.splitlines() if line.startswith("FAILED: replay with")]
    assert len(failed) == 1, out
    assert failed[0].endswith(f"--sabotage --jobs {mode}")
