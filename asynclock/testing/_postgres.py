"""A private PostgreSQL server for tests: ``initdb`` and ``postgres`` on a free port.

The binaries come from ``$PG_BINDIR``, ``pg_config --bindir``, ``/usr/lib/postgresql/*/bin``
(Debian's ``initdb`` on PATH is a wrapper), PATH, or the ``pgserver`` wheel. PostgreSQL
refuses to run as root: as root, the cluster is made and run as the unprivileged
``postgres`` user, on directories that user owns. Trust authentication, loopback only, no
fsync: a server for tests, started in about a second and removed when stopped.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from ._servers import LOOPBACK, ServerStartError, _free_port

__all__ = ["PostgresServer", "find_postgres_bindir"]

_START_TIMEOUT = 30.0


def find_postgres_bindir() -> Path | None:
    """The directory holding ``initdb`` and ``postgres``, or None if there is none."""
    candidates: list[str] = []
    if os.environ.get("PG_BINDIR"):
        candidates.append(os.environ["PG_BINDIR"])
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            found = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            candidates.append(found.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    embedded = importlib.util.find_spec("pgserver")  # (a wheel that ships the binaries)
    if embedded is not None and embedded.submodule_search_locations:
        for location in embedded.submodule_search_locations:
            candidates.append(str(Path(location) / "pginstall" / "bin"))
    for candidate in candidates:
        directory = Path(candidate)
        if (directory / "initdb").is_file() and (directory / "postgres").is_file():
            return directory
    return None


class PostgresServer:
    """A private PostgreSQL cluster on a free loopback port, with trust authentication.

    ``with PostgresServer() as server: server.url`` is a ``postgresql://`` URL for the
    ``postgres`` user and database. ``pause()``/``resume()`` send SIGSTOP/SIGCONT to the
    postmaster; ``stop()`` shuts it down and removes its directory.

    Raises:
        ServerStartError: no binaries, or the server did not start (the log's tail is in
            the message).
    """

    def __init__(self, bindir: Path | None = None) -> None:
        self._bindir = bindir or find_postgres_bindir()
        self._dir: Path | None = None
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the server has not been started")
        return self._port

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{LOOPBACK}:{self.port}/postgres"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @staticmethod
    def _owner() -> str | None:
        """The user to run PostgreSQL's programs as: ``postgres`` when we are root (it
        refuses root; run by Popen itself, the process is the server, to signal)."""
        if os.geteuid() != 0:
            return None
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise ServerStartError("running as root needs a 'postgres' user") from None
        return "postgres"

    def start(self) -> Self:
        if self._process is not None:
            return self
        if self._bindir is None:
            raise ServerStartError(
                "no PostgreSQL binaries (initdb, postgres): install PostgreSQL, set "
                "PG_BINDIR, or give DATABASE_URL"
            )
        self._dir = Path(tempfile.mkdtemp(prefix="asynclock-postgres-"))
        data, sockets = self._dir / "data", self._dir / "run"
        sockets.mkdir()
        if os.geteuid() == 0:
            account = pwd.getpwnam("postgres")
            for path in (self._dir, sockets):
                os.chown(path, account.pw_uid, account.pw_gid)
        initdb = [
            str(self._bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        ]
        owner = self._owner()
        extra_groups: list[str] | None = [] if owner else None
        done = subprocess.run(
            initdb,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self._dir,
            user=owner,
            group=owner,
            extra_groups=extra_groups,
        )
        if done.returncode != 0:
            raise ServerStartError(f"initdb failed: {done.stderr[-2000:]}")
        self._port = _free_port()
        log = self._dir / "postgres.log"
        argv = [
            str(self._bindir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(self._port),
            "-h",
            LOOPBACK,
            "-k",
            str(sockets),
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=200",
        ]
        with open(log, "wb") as out:
            self._process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                user=owner,
                group=owner,
                extra_groups=extra_groups,
            )
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerStartError(f"postgres exited: {log.read_text()[-2000:]}")
            if _answers(self._port) and "ready to accept" in log.read_text():
                return self
            time.sleep(0.05)
        self.stop()
        raise ServerStartError(f"postgres did not start within {_START_TIMEOUT}s")

    def pause(self) -> None:
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGCONT)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            self.resume_quietly(process)
            process.send_signal(signal.SIGINT)  # (fast shutdown)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    @staticmethod
    def resume_quietly(process: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self._process is not None else "stopped"
        return f"<PostgresServer port={self._port} {state}>"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5):
            return True
    except OSError:
        return False
