"""``asynclock run NAME -- CMD``: a command under a lease, across processes (issue 18, B)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import SECRET, urls_with_a_secret
from redis import Redis as SyncRedis

from asynclock._apps._runner import RunConfig, run_command
from asynclock.testing import FaultProxy, ProxyMode, RedisServer, ServerInfo

EXIT_LOST = 75


def _run(url: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``python -m asynclock run ARGS`` against ``url``."""
    env = {**os.environ, "REDIS_URL": url}
    return subprocess.Popen(
        [sys.executable, "-m", "asynclock", "run", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _finish(process: subprocess.Popen[str], timeout: float = 20) -> tuple[int, str]:
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err


def _wait_for(path: Path, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} not written within {timeout}s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_runs_the_command_and_exits_with_its_status(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    code, _ = _finish(
        _run(
            redis_server.url,
            f"{prefix}job",
            "--ttl",
            "5",
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w').write('x'); raise SystemExit(3)",
        )
    )
    assert code == 3
    assert marker.read_text() == "x"
    assert SyncRedis.from_url(redis_server.url).exists(f"asynclock:{{{prefix}job}}") == 0


def test_a_short_command_returns_at_once(redis_server: ServerInfo, prefix: str) -> None:
    """The command's exit ends the run and frees the lock at once, not at the next
    renewal (ttl/3 = 10 s here)."""
    started = time.monotonic()
    code, err = _finish(_run(redis_server.url, f"{prefix}short", "--", "true"))
    took = time.monotonic() - started
    assert code == 0, err
    assert took < 5, took
    assert SyncRedis.from_url(redis_server.url).exists(f"asynclock:{{{prefix}short}}") == 0


# A command that ignores SIGTERM and appends the time to a file every 10 ms.
_STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a") as out:
    while True:
        out.write(f"{time.time()!r}\\n")
        out.flush()
        time.sleep(0.01)
"""

# A command that appends the time to a file once.
_ONCE = "import sys, time; open(sys.argv[1], 'a').write(f'{time.time()!r}\\n')"


async def _exec_run(url: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asynclock",
        "run",
        *args,
        env={**os.environ, "REDIS_URL": url},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_a_silent_holder_stops_its_command_before_another_machine_runs(
    private_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """The holder's connection black-holed, its command ignoring SIGTERM, a second
    machine waiting: the first command's last write comes before the second's first."""
    first_log, second_log = tmp_path / "first", tmp_path / "second"
    name = f"{prefix}silent-holder"
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        first = await _exec_run(
            proxy.url, name, "--ttl", "4", "--grace", "1.2", "--",
            sys.executable, "-c", _STUBBORN, str(first_log),
        )  # fmt: skip
        second = None
        try:
            await asyncio.to_thread(_wait_for, first_log, 15)
            proxy.set_mode(ProxyMode.BLACKHOLE)
            second = await _exec_run(
                private_server.url, name, "--ttl", "4", "--wait", "30", "--",
                sys.executable, "-c", _ONCE, str(second_log),
            )  # fmt: skip
            async with asyncio.timeout(30):
                first_code = await first.wait()
                second_code = await second.wait()
        finally:
            for process in (first, second):
                if process is not None and process.returncode is None:
                    process.kill()
                    await process.wait()
    first_err = (await first.stderr.read()).decode() if first.stderr else ""
    assert first_code == EXIT_LOST, first_err
    assert "renewals of the lease" in first_err, first_err
    assert second_code == 0
    last_of_first = max(float(line) for line in first_log.read_text().split())
    first_of_second = min(float(line) for line in second_log.read_text().split())
    assert last_of_first < first_of_second, (last_of_first, first_of_second)


@pytest.mark.parametrize("busy_exit", [None, "9"])
def test_a_busy_lock_runs_nothing(
    redis_server: ServerInfo, prefix: str, tmp_path: Path, busy_exit: str | None
) -> None:
    """Another holder has it: the command is not run; exit 0, or --busy-exit."""
    started = tmp_path / "started"
    holder = _run(
        redis_server.url,
        f"{prefix}busy",
        "--ttl",
        "5",
        "--",
        sys.executable,
        "-c",
        f"import time; open({str(started)!r}, 'w').write('1'); time.sleep(30)",
    )
    try:
        _wait_for(started)
        marker = tmp_path / "second"
        extra = ["--busy-exit", busy_exit] if busy_exit else []
        code, err = _finish(
            _run(
                redis_server.url,
                f"{prefix}busy",
                *extra,
                "--",
                sys.executable,
                "-c",
                f"open({str(marker)!r}, 'w')",
            )
        )
        assert code == (int(busy_exit) if busy_exit else 0)
        assert "held by another holder" in err
        assert not marker.exists()
    finally:
        holder.send_signal(signal.SIGTERM)  # (passed on to its command)
        code, _ = _finish(holder)
    assert code == 128 + signal.SIGTERM


def test_a_lost_lease_stops_the_command(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """The key deleted from outside: the command is terminated at the next renewal, and
    the exit status says the lease was lost."""
    pid_file = tmp_path / "pid"
    runner = _run(
        redis_server.url,
        f"{prefix}lost",
        "--ttl",
        "0.9",
        "--",
        sys.executable,
        "-c",
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
    )
    pid = int(_wait_for(pid_file))
    SyncRedis.from_url(redis_server.url).delete(f"asynclock:{{{prefix}lost}}")
    started = time.monotonic()
    code, err = _finish(runner)
    assert code == EXIT_LOST
    assert "not_owner" in err
    assert time.monotonic() - started < 3
    assert not _alive(pid)


def test_failing_renewals_stop_the_command_before_the_deadline(
    private_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """Redis stops answering: the command is gone before the lease could expire (ttl
    after its last renewal), not after."""
    pid_file = tmp_path / "pid"
    ttl = 1.5
    runner = _run(
        private_server.url,
        f"{prefix}silent",
        "--ttl",
        str(ttl),
        "--grace",
        "0.2",
        "--",
        sys.executable,
        "-c",
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
    )
    pid = int(_wait_for(pid_file))
    private_server.pause()
    paused = time.monotonic()
    try:
        while _alive(pid) and time.monotonic() - paused < ttl + 2:
            time.sleep(0.01)
        dead_after = time.monotonic() - paused
    finally:
        private_server.resume()
    code, err = _finish(runner)
    assert code == EXIT_LOST, err
    assert dead_after < ttl, dead_after  # (the key lives ttl from its last renewal, earlier)


def test_once_per_tick_across_processes_with_hold_at_least(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """Three crontab lines firing 0.3 s apart (late clocks), a short command: with
    --hold-at-least above the skew, exactly one of them runs it."""
    ran = tmp_path / "ran"
    runners = []
    for index in range(3):
        runners.append(
            _run(
                redis_server.url,
                f"{prefix}tick",
                "--ttl",
                "5",
                "--hold-at-least",
                "2",
                "--",
                sys.executable,
                "-c",
                f"open({str(ran)!r}, 'a').write('{index}\\n')",
            )
        )
        time.sleep(0.3)
    codes = [_finish(runner)[0] for runner in runners]
    assert codes == [0, 0, 0]
    assert len(ran.read_text().split()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["name"], "give the command after --"),
        (["name", "echo"], "unrecognized arguments"),
        (["}x", "--", "true"], "hash tag"),
        (["name", "--ttl", "0", "--", "true"], "--ttl"),
        (["name", "--ttl", "3", "--grace", "2", "--", "true"], "--grace"),
    ],
)
def test_bad_usage_exits_2_before_any_io(args: list[str], message: str) -> None:
    code, err = _finish(_run("redis://127.0.0.1:1/0", *args))
    assert code == 2
    assert message in err


async def test_run_prints_no_password(private_server: RedisServer, prefix: str) -> None:
    """The password of a URL (user:password@, :password@, ?password=, $REDIS_URL) is in
    none of the output of ``asynclock run``, whether the command ran, the password was
    refused, the server could not be reached or the URL could not be parsed."""
    for label, url, environ in await urls_with_a_secret(private_server):
        options = ["--url", url] if url else []
        command = [sys.executable, "-c", "print('ran')"]
        process = await _exec_run(
            environ.get("REDIS_URL", url), "job", *options, "--prefix", prefix, "--", *command
        )
        async with asyncio.timeout(60):
            out, err = await process.communicate()
        output = out.decode() + err.decode()
        assert SECRET not in output, (label, output)
        assert "Traceback" not in output, (label, output)
        if label == "right":
            assert (process.returncode, out.decode()) == (0, "ran\n"), (label, output)
            continue
        assert process.returncode == (2 if label == "unparsable" else 69), (label, output)
        assert "***" in err.decode(), (label, output)


# -- the dead man's switch: the command stops at the deadline whatever the supervisor does


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, zombies aside."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[1] == str(pid) and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _kill_if_running(*pids: int) -> None:
    """SIGKILL what is left of ``pids`` (a failed test leaves nothing behind)."""
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def _poll(predicate: Any, timeout: float) -> float:
    """Seconds until ``predicate()`` held, polled every 10 ms; AssertionError after
    ``timeout`` seconds."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{predicate} did not hold within {timeout}s")
        time.sleep(0.01)
    return time.monotonic() - started


# A command that ignores SIGTERM, writes its pid to argv[1], then the time to argv[2]
# every 10 ms.
_STUBBORN_PID = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").write(str(os.getpid()))
with open(sys.argv[2], "a") as out:
    while True:
        out.write(f"{time.time()!r}\\n")
        out.flush()
        time.sleep(0.01)
"""


def _stubborn_under_a_lease(
    url: str, name: str, ttl: str, tmp_path: Path
) -> tuple[subprocess.Popen[str], int, int]:
    """``asynclock run`` of a command ignoring SIGTERM: the runner, the command's pid, the
    reaper's pid (the runner's other child)."""
    runner = _run(
        url, name, "--ttl", ttl, "--grace", "0.5", "--",
        sys.executable, "-c", _STUBBORN_PID, str(tmp_path / "pid"), str(tmp_path / "log"),
    )  # fmt: skip
    pid = int(_wait_for(tmp_path / "pid"))
    _poll(lambda: len(_children(runner.pid)) == 2, 10)
    (reaper,) = set(_children(runner.pid)) - {pid}
    return runner, pid, reaper


def test_a_stopped_supervisor_s_command_is_gone_by_the_deadline(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """``asynclock run`` alone SIGSTOPped, its command ignoring SIGTERM: the reaper kills
    the command before the lease could expire (ttl after its last renewal), a second run
    of the name then runs after it, and the supervisor, resumed, exits 75."""
    ttl = 3.0
    name = f"{prefix}stopped-supervisor"
    runner, pid, reaper = _stubborn_under_a_lease(redis_server.url, name, str(ttl), tmp_path)
    try:
        runner.send_signal(signal.SIGSTOP)
        dead_after = _poll(lambda: not _running(pid), ttl + 5)
        assert dead_after < ttl, dead_after
        _poll(lambda: not _running(reaper), 5)  # (it exits with its command)
        second = _run(
            redis_server.url, name, "--ttl", "5", "--wait", "30", "--",
            sys.executable, "-c", _ONCE, str(tmp_path / "second"),
        )  # fmt: skip
        assert _finish(second, 40)[0] == 0
    finally:
        runner.send_signal(signal.SIGCONT)
        code, err = _finish(runner)
        _kill_if_running(pid, reaper)
    assert code == EXIT_LOST, err
    assert "Traceback" not in err, err
    last_of_first = max(float(line) for line in (tmp_path / "log").read_text().split())
    first_of_second = float((tmp_path / "second").read_text())
    assert last_of_first < first_of_second, (last_of_first, first_of_second)
    assert not _running(pid)
    assert not _running(reaper)


def test_a_killed_supervisor_s_command_is_gone_promptly(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """``asynclock run`` SIGKILLed: its reaper sends SIGTERM at once and SIGKILL after
    the grace (0.5 s), long before the lease's TTL (20 s) runs out, then exits."""
    runner, pid, reaper = _stubborn_under_a_lease(
        redis_server.url, f"{prefix}killed-supervisor", "20", tmp_path
    )
    try:
        runner.kill()
        _finish(runner)
        dead_after = _poll(lambda: not _running(pid), 10)
        assert dead_after < 5, dead_after
        _poll(lambda: not _running(reaper), 5)
    finally:
        _kill_if_running(pid, reaper)


def test_the_command_gets_the_lease_s_fencing_token(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """``ASYNCLOCK_FENCING_TOKEN``, ``ASYNCLOCK_LEASE_KEY`` and ``ASYNCLOCK_LEASE_TTL``
    name the lease the command runs under (its key's value is ``<token>:<fencing
    token>``); the reaper leaves with the command."""
    name = f"{prefix}fenced-command"
    key = f"asynclock:{{{name}}}"
    environ, go = tmp_path / "environ", tmp_path / "go"
    command = (
        "import json, os, sys, time\n"
        f"open({str(environ)!r}, 'w').write(json.dumps([os.getpid(), dict(os.environ)]))\n"
        "end = time.monotonic() + 30\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
    )
    runner = _run(redis_server.url, name, "--ttl", "5", "--", sys.executable, "-c", command)
    try:
        command_pid, seen = json.loads(_wait_for(environ))
        value = SyncRedis.from_url(redis_server.url).get(key)
        _poll(lambda: len(_children(runner.pid)) == 2, 10)  # (the command, its reaper)
        reapers = set(_children(runner.pid)) - {command_pid}
    finally:
        go.write_text("1")
        code, err = _finish(runner)
    assert code == 0, err
    assert value is not None
    assert value.decode().split(":")[1] == seen["ASYNCLOCK_FENCING_TOKEN"]
    assert seen["ASYNCLOCK_LEASE_KEY"] == key
    assert seen["ASYNCLOCK_LEASE_TTL"] == "5"
    assert len(reapers) == 1
    assert not any(_running(pid) for pid in reapers)


def test_a_command_outliving_the_ttl_runs_to_its_end(redis_server: ServerInfo, prefix: str) -> None:
    """The reaper's deadline moves at each renewal: a command lasting 3 TTLs is not
    stopped, and returns its own status."""
    command = [sys.executable, "-c", "import time; time.sleep(2.4); raise SystemExit(5)"]
    code, err = _finish(_run(redis_server.url, f"{prefix}long", "--ttl", "0.8", "--", *command))
    assert code == 5, err
    assert "reaper" not in err, err
    assert "sent SIG" not in err, err


async def test_a_cancelled_run_stops_its_command_and_its_reaper(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """``run_command()`` cancelled (in-process): the command, which ignores SIGTERM, is
    killed after the grace, the reaper is told and exits, and no process is left."""
    pid_file, log = tmp_path / "pid", tmp_path / "log"
    config = RunConfig(
        name=f"{prefix}cancelled",
        command=[sys.executable, "-c", _STUBBORN_PID, str(pid_file), str(log)],
        url=redis_server.url,
        ttl=5.0,
        grace=0.3,
    )
    before = set(_children(os.getpid()))
    task = asyncio.create_task(run_command(config))
    pid = int(await asyncio.to_thread(_wait_for, pid_file))
    await asyncio.to_thread(
        _poll, lambda: len(set(_children(os.getpid())) - before) == 2, 10
    )  # (the command and its reaper)
    reaper = (set(_children(os.getpid())) - before - {pid}).pop()
    task.cancel()
    try:
        async with asyncio.timeout(10):
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        _kill_if_running(pid, reaper)
    assert not _running(pid)
    assert not _running(reaper)


# A supervisor that starts its reaper (deadline in 1.5 s, grace 0.3 s) and a command
# ignoring SIGTERM (argv[1:]), then stops itself before telling the reaper the pid.
_STOPPED_BEFORE_THE_PID = """
import asyncio, os, signal, subprocess, sys
from asynclock._apps._reaper import Reaper

async def main():
    reaper = await Reaper.start(0.3, asyncio.get_running_loop().time() + 1.5)
    subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stderr=subprocess.DEVNULL)
    os.kill(os.getpid(), signal.SIGSTOP)

asyncio.run(main())
"""


def test_a_supervisor_stopped_before_telling_the_pid_still_has_its_command_stopped(
    tmp_path: Path,
) -> None:
    """The supervisor stopped between its command's start and the ``pid`` line (the
    window the chaos run found): at the deadline the reaper takes the supervisor's child
    and kills it, then exits with it."""
    pid_file = tmp_path / "pid"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_BEFORE_THE_PID, _STUBBORN_PID, str(pid_file),
         str(tmp_path / "log")],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    pid = int(_wait_for(pid_file))
    seen = time.monotonic()  # (the deadline was set before the command started)
    try:
        (reaper,) = set(_children(supervisor.pid)) - {pid}
        _poll(lambda: not _running(pid), 10)
        assert time.monotonic() - seen < 1.5
        _poll(lambda: not _running(reaper), 5)
    finally:
        _kill_if_running(pid)
        supervisor.send_signal(signal.SIGCONT)
        _, err = supervisor.communicate(timeout=10)
    assert "sent SIGKILL to the command" in err, err


def _family_under_a_lease(
    url: str, name: str, ttl: str, tmp_path: Path
) -> tuple[subprocess.Popen[str], int]:
    """``asynclock run`` of a shell whose child ignores SIGTERM (the shell itself dies of
    it): the runner, and the child's pid."""
    runner = _run(
        url, name, "--ttl", ttl, "--grace", "0.5", "--",
        "sh", "-c", '"$1" -c "$2" "$3" "$4" & wait', "sh",
        sys.executable, _STUBBORN_PID, str(tmp_path / "pid"), str(tmp_path / "log"),
    )  # fmt: skip
    return runner, int(_wait_for(tmp_path / "pid"))


def test_a_lost_lease_stops_the_command_s_children_too(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """The command is a shell whose child ignores SIGTERM: once the lease is lost, the
    whole process group gets SIGTERM, then SIGKILL after the grace, so the child does not
    run on beside the next holder."""
    name = f"{prefix}family-lost"
    runner, child = _family_under_a_lease(redis_server.url, name, "3", tmp_path)
    try:
        SyncRedis.from_url(redis_server.url).delete(f"asynclock:{{{name}}}")
        code, err = _finish(runner)
        assert code == EXIT_LOST, err
        _poll(lambda: not _running(child), 5)
    finally:
        _kill_if_running(child)


def test_a_killed_supervisor_s_command_s_children_are_gone_too(
    redis_server: ServerInfo, prefix: str, tmp_path: Path
) -> None:
    """``asynclock run`` SIGKILLed, its command a shell whose child ignores SIGTERM: the
    reaper's SIGTERM ends the shell, and the child gets SIGKILL when the grace ends,
    long before the lease's TTL (20 s)."""
    runner, child = _family_under_a_lease(
        redis_server.url, f"{prefix}family-killed", "20", tmp_path
    )
    try:
        runner.kill()
        _finish(runner)
        assert _poll(lambda: not _running(child), 10) < 5
    finally:
        _kill_if_running(child)
