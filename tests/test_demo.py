"""End-to-end tests of ``python -m examples.demo`` (each run starts its own server)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from asynclock.__main__ import main
from asynclock.testing import available_engines

ROOT = Path(__file__).resolve().parent.parent

needs_server = pytest.mark.skipif(
    not available_engines(), reason="no redis-server or valkey-server binary installed"
)


def _demo(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "examples.demo", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,
    )


def _sigint_default() -> None:
    """(In the child, before exec) SIGINT back to its default: a pytest-xdist worker
    ignores it, and an ignored signal stays ignored across exec, so the demo would never
    see a Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def _assert_no_leftovers(lock_name: str, output: str) -> None:
    if Path("/proc/self/cmdline").exists():
        deadline = time.monotonic() + 5
        while _processes_mentioning(lock_name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_mentioning(lock_name) == [], "worker processes outlived the demo"
    match = re.search(r"server at redis://127\.0\.0\.1:(\d+)/0", output)
    assert match, output
    with pytest.raises(ConnectionRefusedError):  # the private server is gone
        socket.create_connection(("127.0.0.1", int(match[1])), 1).close()


@pytest.mark.slow
@needs_server
def test_demo_runs_the_whole_scenario() -> None:
    lock_name = f"demo-test-{uuid.uuid4().hex[:12]}"
    proc = _demo("--seconds", "12", "--name", lock_name)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    report = f"exit status {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert proc.returncode == 0, report

    acquired = re.findall(r"worker-\d+\s+acquired\s+fence (\d+)", out)
    assert len(acquired) >= 3, report
    assert re.search(r"worker-\d+\s+renewed\s+\(\d+\.\d+s left\)", out), report
    kill = re.search(r"demo\s+killing (worker-\d+) \(SIGKILL\) while it holds the lease", out)
    assert kill, report
    takeover = re.search(r"(worker-\d+)\s+acquired\s+fence \d+\s+\(took over (\d+\.\d+)s", out)
    assert takeover, report
    assert takeover[1] != kill[1], report
    assert float(takeover[2]) > 0.5, report  # only once the dead holder's key expired
    assert re.search(r"demo\s+deleting the lease key", out), report
    assert re.search(r"LockLost\s+reason not_owner: its work was cancelled", out), report
    assert "fencing tokens  strictly increasing" in out, report
    assert "the lease key is gone" in out, report
    assert "OK: everything happened as expected" in out, report
    assert "Traceback" not in out + err, report
    _assert_no_leftovers(lock_name, out)


@pytest.mark.slow
@needs_server
def test_ctrl_c_kills_the_workers_and_the_server() -> None:
    lock_name = f"demo-test-{uuid.uuid4().hex[:12]}"
    proc = _demo("--seconds", "30", "--name", lock_name)
    try:
        # The workers are up and taking turns: a lease was acquired (read as it comes;
        # a loaded machine may take seconds to start them).
        assert proc.stdout is not None
        seen: list[str] = []
        for line in proc.stdout:
            seen.append(line)
            if " acquired " in line:
                break
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
        out = "".join(seen) + rest
    finally:
        proc.kill()
        proc.wait()
    report = f"exit status {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert proc.returncode == 130, report
    assert "interrupted: the workers were killed" in out, report
    assert "Traceback" not in out + err, report
    _assert_no_leftovers(lock_name, out)


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--workers", "1"],
        ["demo", "--ttl", "0"],
        ["demo", "--ttl", "2", "--seconds", "5"],
        ["demo", "--seconds", "nan"],
        ["bogus"],
        [],
    ],
)
def test_bad_arguments_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_asynclock_demo_outside_a_clone_says_where_the_demo_is(tmp_path: Path) -> None:
    """The demo is not in the package: run where ``examples`` cannot be imported,
    ``asynclock demo`` says where it lives and exits 2 (in a clone it runs it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import asynclock, importlib.util as u; print(u.find_spec('examples') is None)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "True", probe  # (no examples package out here)
    done = subprocess.run(
        [sys.executable, "-m", "asynclock", "demo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "./dev demo" in done.stderr
    assert "Traceback" not in done.stderr
