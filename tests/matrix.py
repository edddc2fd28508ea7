"""The contract tests on every Python the package claims, the oldest and the newest
redis-py it supports, and both of redis-py's parsers: ``./dev test`` runs this after the
full suite (``./dev matrix [LEG ...]`` runs it alone).

Each leg is a virtual environment of its own under ``.venvs/`` (git-ignored), made with
that leg's Python and the project installed in it (``pip install -e .[test]`` with the
leg's redis-py pinned; for the pure-Python parser, hiredis is then uninstalled). A venv
is reused while its Python, pins and ``pyproject.toml`` are unchanged, and made anew
otherwise. The legs run at the same time (the tests mostly wait on sockets and timers),
each on the contract tests (``CONTRACT``) against the Redis engine only (the full suite
covers the engines), and each must pass: a failed leg fails the run, named with the tail
of its log (the whole log is in ``.venvs/logs/``).

Pythons are taken from ``ASYNCLOCK_PYTHON_3_12`` (and so on) if set, else ``python3.12``
on PATH, else pyenv's newest 3.12.x. A Python that cannot be found fails its leg: the
interpreters cannot be installed from the package registries, and a leg skipped in
silence would leave a claimed Python untested while CI stays green. On a machine without
them, ``ASYNCLOCK_MATRIX=skip ./dev test`` runs without the matrix, and says so.

Standard library only: run by the project's ``.venv`` Python, before anything else is
installed anywhere.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".venvs"
LOGS = VENVS / "logs"

OLDEST = "5.0.2"  # the floor in pyproject.toml (see README, Install): keep them equal
NEWEST = "8.1.0"  # the newest redis-py release tested: bump it when a new one comes out

CONTRACT = [
    "tests/test_compat.py",
    "tests/test_lease.py",
    "tests/test_acquire.py",
    "tests/test_watchdog.py",
    "tests/test_faults.py",
    "tests/test_cancel.py",
    "tests/test_lane.py",
]
"""The contract of a lease, the watchdog under real faults, cancellation, the lane, and
the redis-py/Python differences themselves (a reset storm among them)."""


@dataclasses.dataclass(frozen=True)
class Leg:
    python: str  # "3.13"
    redis: str  # an exact redis-py version
    hiredis: bool  # False: redis-py's pure-Python parser
    extra: tuple[str, ...] = ()  # test files beyond CONTRACT
    extras: tuple[str, ...] = ()  # the project's extras installed beyond `test`

    @property
    def name(self) -> str:
        parser = "hiredis" if self.hiredis else "python-parser"
        return f"py{self.python}-redis{self.redis}-{parser}"


# The full suite runs on .venv (the first Python >= 3.11 found, the newest redis-py,
# hiredis). Together with it, these cover every Python the package claims, the oldest
# and the newest redis-py, and both parsers; the chaos run (issue 17: it failed on 3.12
# and 3.13) goes to the legs on the Pythons the main run may not use.
LEGS = [
    Leg("3.13", OLDEST, hiredis=False, extra=("tests/test_chaos.py",)),
    Leg("3.12", NEWEST, hiredis=True, extra=("tests/test_chaos.py",)),
    # arq pins redis-py below 6, so the real arq workers of tests/test_arq.py run here
    Leg("3.11", OLDEST, hiredis=True, extra=("tests/test_arq.py",), extras=("test-arq",)),
]


_INSTALLING = threading.Lock()  # (pip builds the project in the shared tree: one at a time)


class LegError(Exception):
    """A leg could not be set up (no such Python, an install that failed)."""


def find_python(version: str) -> str:
    """The interpreter for ``version`` ("3.12"); raises :class:`LegError` if none."""
    variable = "ASYNCLOCK_PYTHON_" + version.replace(".", "_")
    candidates: list[str] = []
    if os.environ.get(variable):
        candidates.append(os.environ[variable])
    on_path = shutil.which(f"python{version}")
    if on_path:
        candidates.append(on_path)  # (a pyenv shim may refuse: it is tried, below)
    candidates += _pyenv_pythons(version)
    for candidate in candidates:
        if _runs_as(candidate, version):
            return candidate
    raise LegError(
        f"no Python {version} found (set {variable}=/path/to/python{version}, put "
        f"python{version} on PATH or `pyenv install {version}`); tried: "
        + (", ".join(candidates) or "nothing")
    )


def _pyenv_pythons(version: str) -> list[str]:
    roots = [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    found: list[tuple[tuple[int, ...], str]] = []
    for root in filter(None, roots):
        for path in Path(root, "versions").glob(f"{version}.*/bin/python{version}"):
            patch = path.parent.parent.name.removeprefix(version + ".")
            if patch.isdigit():  # (not 3.12-dev, 3.12.0a1, a virtualenv, ...)
                found.append(((int(patch),), str(path)))
    return [path for _, path in sorted(found, reverse=True)]


def _runs_as(python: str, version: str) -> bool:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == version


def ensure_venv(leg: Leg, log: Path) -> Path:
    """The leg's venv, made (or made anew) as the leg asks; returns its python."""
    python = find_python(leg.python)
    venv = VENVS / leg.name
    stamp = venv / ".asynclock-matrix-stamp"
    want = json.dumps(
        {
            "python": os.path.realpath(python),
            "leg": dataclasses.asdict(leg) | {"extra": None},
            "pyproject": hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest(),
        },
        sort_keys=True,
    )
    bin_python = venv / "bin" / "python"
    if bin_python.exists() and stamp.exists() and stamp.read_text() == want:
        return bin_python
    shutil.rmtree(venv, ignore_errors=True)
    pin = f"redis[hiredis]=={leg.redis}" if leg.hiredis else f"redis=={leg.redis}"
    extras = ("test", *leg.extras)
    steps = [
        [python, "-m", "venv", str(venv)],
        [str(bin_python), "-m", "pip", "install", "-q", "-e", f".[{','.join(extras)}]", pin],
    ]
    if not leg.hiredis:  # (the project itself asks for redis[hiredis])
        steps.append([str(bin_python), "-m", "pip", "uninstall", "-q", "-y", "hiredis"])
    with log.open("a") as out:
        for step in steps:
            out.write("$ " + " ".join(step) + "\n")
            out.flush()
            env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
            done = subprocess.run(step, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
            if done.returncode != 0:
                raise LegError(f"`{' '.join(step[:4])} ...` failed ({done.returncode})")
    stamp.write_text(want)
    return bin_python


_CHECK = """
import sys, redis
from redis.utils import HIREDIS_AVAILABLE
print("Python %s, redis-py %s, %s" % (sys.version.split()[0], redis.__version__,
      "hiredis" if HIREDIS_AVAILABLE else "pure-Python parser"))
sys.exit(0 if (redis.__version__, HIREDIS_AVAILABLE) == (sys.argv[1], sys.argv[2] == "1")
         else 1)
"""


@dataclasses.dataclass
class Outcome:
    leg: Leg
    ok: bool
    summary: str
    seconds: float
    log: Path


def run_leg(leg: Leg, pytest_args: list[str]) -> Outcome:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{leg.name}.log"
    log.write_text("")
    started = time.monotonic()
    try:
        with _INSTALLING:
            python = ensure_venv(leg, log)
        check = subprocess.run(
            [str(python), "-c", _CHECK, leg.redis, "1" if leg.hiredis else "0"],
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            raise LegError(f"the venv is not what the leg asks: {check.stdout or check.stderr}")
        what = check.stdout.strip()
        set_up = time.monotonic() - started
        command = [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "not valkey",
            "-m",
            "not slow",  # (the chaos checks' negative controls: the main run has them)
            *CONTRACT,
            *leg.extra,
            *pytest_args,
        ]
        with log.open("a") as out:
            out.write(f"{what}\n$ {' '.join(command)}\n")
            out.flush()
            done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        last = _last_line(log)
        # (pytest's 5: no test ran, which proves nothing)
        ok = done.returncode == 0
        summary = f"{what}: {last} (set-up {set_up:.0f} s)"
        if done.returncode == 5:
            summary = f"{what}: no test ran"
    except LegError as exc:
        ok, summary = False, str(exc)
    return Outcome(leg, ok, summary, time.monotonic() - started, log)


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return re.sub(r"^=+ | =+$", "", lines[-1]) if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("legs", nargs="*", help="leg names (default: every leg)")
    parser.add_argument("--list", action="store_true", help="list the legs and exit")
    parser.add_argument("--pytest", default="", help="more pytest arguments, one string")
    args = parser.parse_args(argv)
    if args.list:
        for leg in LEGS:
            print(leg.name)
        return 0
    if os.environ.get("ASYNCLOCK_MATRIX") == "skip":
        print("matrix: SKIPPED (ASYNCLOCK_MATRIX=skip): other Pythons and redis-py versions")
        print("matrix: untested; CI runs it")
        return 0
    unknown = set(args.legs) - {leg.name for leg in LEGS}
    if unknown:
        parser.error(f"no such leg: {', '.join(sorted(unknown))} (see --list)")
    legs = [leg for leg in LEGS if not args.legs or leg.name in args.legs]
    pytest_args = args.pytest.split()
    print(f"matrix: {len(legs)} legs, contract tests: {' '.join(CONTRACT)}", flush=True)
    started = time.monotonic()
    # Venvs are made one after another, the tests run together: a leg whose venv is ready
    # starts its tests while the next one installs.
    outcomes: list[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(len(legs)) as pool:
        futures = [pool.submit(run_leg, leg, pytest_args) for leg in legs]
        for future in concurrent.futures.as_completed(futures):
            outcome = future.result()
            outcomes.append(outcome)
            status = "ok" if outcome.ok else "FAILED"
            print(
                f"matrix: {status} {outcome.leg.name} in {outcome.seconds:.0f} s: "
                f"{outcome.summary}",
                flush=True,
            )
    failed = [o for o in outcomes if not o.ok]
    for outcome in failed:
        print(f"\n---- leg {outcome.leg.name} FAILED: the end of {outcome.log} ----")
        lines = outcome.log.read_text(errors="replace").splitlines()
        print("\n".join(f"[{outcome.leg.name}] {line}" for line in lines[-60:]))
    elapsed = time.monotonic() - started
    names = ", ".join(o.leg.name for o in failed)
    print(f"matrix: {len(legs)} legs in {elapsed:.0f} s" + (f"; FAILED: {names}" if failed else ""))
    print(f"legs: {len(legs) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
