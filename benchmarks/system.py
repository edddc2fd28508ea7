"""The machine side: CPU pinning, the private server, memory and versions."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asynclock.testing import RedisServer

__all__ = [
    "LogCollector",
    "Pinning",
    "cpu_model",
    "cpu_times",
    "environment",
    "load_note",
    "plan_pinning",
    "renewal_calls",
    "rss_bytes",
    "start_server",
]

#: How renewals reach the server in every peer that renews (script calls; commands run
#: inside a script are counted under their own names too, so they are left out).
RENEWAL_COMMANDS = ("evalsha", "eval")


@dataclass
class Pinning:
    """Which CPUs the server and the clients run on (empty sets: not pinned)."""

    server: set[int] = field(default_factory=set)
    clients: set[int] = field(default_factory=set)
    server_threads: int = 0
    note: str = ""

    @property
    def short(self) -> str:
        if not self.enabled:
            return "not pinned"
        return f"server on CPU {_cpus(self.server)}, clients on CPU {_cpus(self.clients)}"

    @property
    def enabled(self) -> bool:
        return bool(self.server and self.clients)


def plan_pinning(enabled: bool) -> Pinning:
    """Server on the first CPU this process may use, clients on the second."""
    cpus = sorted(os.sched_getaffinity(0))
    if not enabled:
        return Pinning(note="not pinned (--no-pin): server and clients share every CPU")
    if len(cpus) < 2:
        return Pinning(note=f"not pinned: only {len(cpus)} CPU available")
    return Pinning(server={cpus[0]}, clients={cpus[1]})


def start_server(engine: str | None, pinning: Pinning) -> RedisServer:
    """Start a private server, on ``pinning.server`` and with this process then moved to
    ``pinning.clients`` (child processes started afterwards inherit that).

    The server is started from this process while it is pinned to the server's CPU, so the
    server and every thread it starts inherit that affinity (like ``taskset -c 0``); its
    threads are then checked, and pinned again should one have escaped.
    """
    before = os.sched_getaffinity(0)
    if pinning.enabled:
        os.sched_setaffinity(0, pinning.server)
    # The server inherits a blocked SIGINT, so a Ctrl-C in the terminal (sent to the whole
    # process group) leaves it running until the harness stops it (with SIGTERM).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        server = RedisServer(engine).start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.sched_setaffinity(0, pinning.clients if pinning.enabled else before)
    if pinning.enabled and server.pid is not None:
        tids = [int(t) for t in os.listdir(f"/proc/{server.pid}/task")]
        for tid in tids:
            if os.sched_getaffinity(tid) != pinning.server:
                os.sched_setaffinity(tid, pinning.server)
        pinning.server_threads = len(tids)
        pinning.note = (
            f"server (pid {server.pid}, {len(tids)} threads) on CPU "
            f"{_cpus(pinning.server)}; harness and its child processes on CPU "
            f"{_cpus(pinning.clients)} (sched_setaffinity, as `taskset -c`)"
        )
    return server


def _cpus(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


class LogCollector(logging.Handler):
    """Keeps the warnings the libraries log during a measurement, for its record's note."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def summary(self) -> str:
        """A one-line summary of the warnings since the last call ('' if none)."""
        records, self.records = self.records, []
        if not records:
            return ""
        first = records[0]
        return f"{len(records)} warning(s) logged, e.g. {first.name}: {first.getMessage()[:160]}"


def rss_bytes() -> int:
    """Resident set size of this process now (Linux: /proc/self/statm)."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def renewal_calls(commandstats: dict[str, Any]) -> int:
    """Calls of the commands a renewal may use, from ``INFO commandstats``."""
    total = 0
    for command in RENEWAL_COMMANDS:
        entry = commandstats.get(f"cmdstat_{command}")
        if isinstance(entry, dict):
            total += int(entry.get("calls", 0))
    return total


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_times() -> tuple[float, float]:
    """(all CPU time, stolen CPU time) of the machine so far, in clock ticks."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0.0


def load_note(before: tuple[float, float]) -> str:
    """Load average now and the share of CPU time stolen by the hypervisor since ``before``."""
    total, steal = cpu_times()
    spent = total - before[0]
    stolen = 100 * (steal - before[1]) / spent if spent > 0 else 0.0
    one, five, _ = os.getloadavg()
    return (
        f"load average {one:.2f} (1 min), {five:.2f} (5 min) at the end; {stolen:.1f}% CPU stolen"
    )


def source_revision() -> str:
    """The git commit of the working tree, and whether asynclock/ differs from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "asynclock"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    if changed:
        return f"{head} + uncommitted changes in {len(changed)} file(s) of asynclock/"
    return head


def environment(server: RedisServer, pinning: Pinning) -> dict[str, str]:
    """Versions and machine facts for the results."""
    return {
        "source": source_revision(),
        "pinning_short": pinning.short,
        "python": platform.python_version(),
        "redis-py": _version("redis"),
        "hiredis": _version("hiredis"),
        "anyio": _version("anyio"),
        "server": f"{server.engine} {server.version}",
        "cpu": cpu_model(),
        "cpu_count": str(os.cpu_count()),
        "kernel": platform.release(),
    }
