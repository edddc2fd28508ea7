"""A fenced resource on SQLite: writes carrying a stale fencing token are refused.

Part of the public :mod:`asynclock.testing` kit (import from there, not from here).

A lock alone cannot stop a holder that was paused (GC, ``SIGSTOP``, a slow disk) past its
lease from writing after a newer holder took over.  The resource it writes to can: every
write carries the lease's fencing token, and the resource refuses a token lower than the
highest it has accepted for that key.  :class:`FencedStore` is such a resource, in a
SQLite file that several processes can share, and it logs every attempt so that
:func:`check_fenced_writes` can prove that no lower token was ever accepted.

The SQL, which carries over to PostgreSQL unchanged except for the column types (give
``value`` one, e.g. ``TEXT`` or ``JSONB``, and make ``fence`` a ``BIGINT``)::

    CREATE TABLE IF NOT EXISTS fenced (
        key   TEXT PRIMARY KEY,
        value,                       -- any value (no declared type: stored as given)
        fence INTEGER NOT NULL       -- highest fencing token accepted; 0 = none yet
    );

    -- a fenced write: applied only if no higher token was accepted for the key
    INSERT INTO fenced (key, value, fence) VALUES (:key, :value, :fence)
    ON CONFLICT (key) DO UPDATE SET value = excluded.value, fence = excluded.fence
    WHERE excluded.fence >= fenced.fence;
    SELECT changes();                -- 1: applied, 0: refused (PostgreSQL: the row count)

    -- a claim, made before a fenced read-modify-write reads: raises the fence without
    -- writing, so an older holder's later write is refused (not only a later one's)
    INSERT INTO fenced (key, value, fence) VALUES (:key, NULL, :fence)
    ON CONFLICT (key) DO UPDATE SET fence = excluded.fence
    WHERE excluded.fence >= fenced.fence;
    SELECT changes();

Each operation runs in its own ``BEGIN IMMEDIATE`` transaction (SQLite's write lock is
taken up front, so operations of all processes are serialised), together with an insert
into ``fenced_log`` (``seq``, ``key``, ``op``, ``fence``, ``accepted``, ``at``,
``holder``); ``seq`` is therefore the order in which the operations took effect.

Design notes: the database runs in WAL mode with ``synchronous=NORMAL`` and a busy
timeout, which suits a test fixture (fast commits; a power cut may lose the last ones).
Every call is synchronous and blocks for about a millisecond, longer while another
process holds the write lock (up to the busy timeout); calling them from a coroutine is
fine for tests, or wrap them in ``anyio.to_thread.run_sync`` (the store is thread-safe).
Only :meth:`FencedStore.increment` is async, because it awaits a pause on purpose.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Final, Literal, Self

import anyio

from ._history import Violation

__all__ = ["Attempt", "FencedStore", "FencedWriteViolation", "Value", "check_fenced_writes"]

Value = str | int | float | bytes
"""What a :class:`FencedStore` stores: a SQLite value (``None`` reads as "no value")."""

Operation = Literal["write", "claim", "unfenced"]

_MAX_TOKEN: Final = 2**63 - 1  # SQLite INTEGER is a signed 64-bit number

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS fenced (
    key   TEXT PRIMARY KEY,
    value,
    fence INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS fenced_log (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    key      TEXT NOT NULL,
    op       TEXT NOT NULL,
    fence    INTEGER,
    accepted INTEGER NOT NULL,
    at       REAL NOT NULL,
    holder   TEXT
);
"""

_WRITE: Final = """
INSERT INTO fenced (key, value, fence) VALUES (:key, :value, :fence)
ON CONFLICT (key) DO UPDATE SET value = excluded.value, fence = excluded.fence
WHERE excluded.fence >= fenced.fence
"""

_CLAIM: Final = """
INSERT INTO fenced (key, value, fence) VALUES (:key, NULL, :fence)
ON CONFLICT (key) DO UPDATE SET fence = excluded.fence
WHERE excluded.fence >= fenced.fence
"""

_WRITE_UNFENCED: Final = """
INSERT INTO fenced (key, value, fence) VALUES (:key, :value, 0)
ON CONFLICT (key) DO UPDATE SET value = excluded.value
"""

_LOG: Final = """
INSERT INTO fenced_log (key, op, fence, accepted, at, holder)
VALUES (:key, :op, :fence, :accepted, :at, :holder)
"""


def _check_token(fencing_token: int) -> int:
    if isinstance(fencing_token, bool) or not isinstance(fencing_token, int):
        raise TypeError(f"fencing_token must be an int, not {type(fencing_token).__name__}")
    if not 1 <= fencing_token <= _MAX_TOKEN:
        raise ValueError(f"fencing_token must be between 1 and 2**63 - 1, got {fencing_token}")
    return fencing_token


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """One operation on a :class:`FencedStore`, as logged.

    Attributes:
        seq: position in the order the operations took effect (all processes).
        key: the key operated on.
        op: ``"write"`` (:meth:`~FencedStore.write`), ``"claim"``
            (:meth:`~FencedStore.claim`) or ``"unfenced"``
            (:meth:`~FencedStore.write_unfenced`).
        fencing_token: the token given, or None for an unfenced write.
        accepted: whether the store applied it.
        at: ``time.monotonic()`` seconds when it took effect.
        holder: the ``holder`` passed by the caller, if any.
    """

    seq: int
    key: str
    op: Operation
    fencing_token: int | None
    accepted: bool
    at: float
    holder: str | None

    def __str__(self) -> str:
        verdict = "accepted" if self.accepted else "refused"
        who = f" by {self.holder}" if self.holder is not None else ""
        token = "" if self.fencing_token is None else f" with fence {self.fencing_token}"
        return f"#{self.seq} {self.op} of {self.key!r}{token}{who} at t={self.at:.6f}: {verdict}"


@dataclasses.dataclass(frozen=True, slots=True)
class FencedWriteViolation(Violation):
    """The store contradicted fencing at ``attempt``.

    Either it accepted a token lower than ``highest`` (the highest it had accepted for the
    key before), or it refused a token that was not lower.
    """

    attempt: Attempt
    highest: int | None

    def __str__(self) -> str:
        if self.attempt.accepted:
            problem = f"accepted although fence {self.highest} had been accepted before"
        else:
            highest = "none" if self.highest is None else self.highest
            problem = f"refused although the highest fence accepted before was {highest}"
        return f"{self.attempt}: {problem}"


class FencedStore:
    """A key-value store in a SQLite file that refuses writes with stale fencing tokens.

    Args:
        path: the database file; created if missing.  Several processes (and several
            stores in one process) may open the same file.
        busy_timeout: seconds an operation waits for another connection's write lock
            before raising ``sqlite3.OperationalError`` ("database is locked").

    Fencing tokens must be ints from 1 to 2**63 - 1 (asynclock's are).  See the module
    documentation for the SQL.  Thread-safe; use it as a context manager or call
    :meth:`close`.

    Raises:
        sqlite3.Error: the file cannot be opened or is not such a database.
    """

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 5.0) -> None:
        if busy_timeout < 0:
            raise ValueError(f"busy_timeout must not be negative, got {busy_timeout!r}")
        self._path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self._path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            self._setup(busy_timeout)
        except BaseException:
            self._db.close()
            raise

    def _setup(self, busy_timeout: float) -> None:
        # Switching to WAL takes an exclusive lock, and a second process opening the file
        # at the same moment can be told "locked" without its busy handler being called.
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                self._db.execute("PRAGMA journal_mode = WAL")
                self._db.execute("PRAGMA synchronous = NORMAL")
                with self._transaction() as db:
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            db.execute(statement)
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _log(
        self,
        db: sqlite3.Connection,
        key: str,
        op: Operation,
        fencing_token: int | None,
        accepted: bool,
        holder: str | None,
    ) -> None:
        db.execute(
            _LOG,
            {
                "key": key,
                "op": op,
                "fence": fencing_token,
                "accepted": int(accepted),
                "at": time.monotonic(),
                "holder": holder,
            },
        )

    def _fenced(
        self, sql: str, op: Operation, key: str, value: Value | None, token: int, holder: str | None
    ) -> bool:
        _check_token(token)
        with self._transaction() as db:
            db.execute(sql, {"key": key, "value": value, "fence": token})
            (changes,) = db.execute("SELECT changes()").fetchone()
            accepted = bool(changes == 1)
            self._log(db, key, op, token, accepted, holder)
        return accepted

    # -- operations -------------------------------------------------------------------------

    def write(
        self, key: str, value: Value, fencing_token: int, *, holder: str | None = None
    ) -> bool:
        """Set ``key`` to ``value`` unless a higher fencing token was accepted for ``key``.

        Equal tokens are accepted (one holder writing several times).  Every call is
        logged, accepted or not, with ``holder`` (any label, for the log).

        Returns:
            True if the value was written, False if the token was stale.

        Raises:
            TypeError, ValueError: ``fencing_token`` is not an int from 1 to 2**63 - 1.
            sqlite3.Error: the database failed (e.g. locked past the busy timeout).
        """
        return self._fenced(_WRITE, "write", key, value, fencing_token, holder)

    def claim(self, key: str, fencing_token: int, *, holder: str | None = None) -> bool:
        """Raise the fence of ``key`` to ``fencing_token`` without changing its value.

        A fenced read-modify-write claims before it reads: a write that an older holder
        makes afterwards is then refused even though it comes before this holder's own
        write.  A missing key is created with no value.  Logged like :meth:`write`.

        Returns:
            True if claimed, False if a higher token was accepted for ``key`` before.

        Raises:
            TypeError, ValueError: ``fencing_token`` is not an int from 1 to 2**63 - 1.
            sqlite3.Error: the database failed.
        """
        return self._fenced(_CLAIM, "claim", key, None, fencing_token, holder)

    def write_unfenced(self, key: str, value: Value, *, holder: str | None = None) -> None:
        """Set ``key`` to ``value`` with no fencing at all (the fence is left as it is).

        For showing what goes wrong without fencing; logged with no token.

        Raises:
            sqlite3.Error: the database failed.
        """
        with self._transaction() as db:
            db.execute(_WRITE_UNFENCED, {"key": key, "value": value})
            self._log(db, key, "unfenced", None, True, holder)

    def read(self, key: str) -> Value | None:
        """The value of ``key``, or None if it has none (unfenced: anyone may read).

        Raises:
            sqlite3.Error: the database failed.
        """
        with self._lock:
            row = self._db.execute("SELECT value FROM fenced WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        value: Value | None = row[0]
        return value

    def read_int(self, key: str, default: int = 0) -> int:
        """The integer value of ``key`` (a counter), or ``default`` if it has no value.

        Raises:
            TypeError: the value is not an integer.
            sqlite3.Error: the database failed.
        """
        value = self.read(key)
        if value is None:
            return default
        if not isinstance(value, int):
            raise TypeError(f"value of {key!r} is not an int: {value!r}")
        return value

    def highest_token(self, key: str) -> int | None:
        """The highest fencing token accepted for ``key`` (write or claim), or None.

        Raises:
            sqlite3.Error: the database failed.
        """
        with self._lock:
            row = self._db.execute("SELECT fence FROM fenced WHERE key = ?", (key,)).fetchone()
        if row is None or row[0] == 0:
            return None
        token: int = row[0]
        return token

    def attempts(self, key: str | None = None) -> list[Attempt]:
        """Every logged operation (on ``key``, or on all keys), in the order they took effect.

        Raises:
            sqlite3.Error: the database failed.
        """
        sql = "SELECT seq, key, op, fence, accepted, at, holder FROM fenced_log"
        params: tuple[str, ...] = ()
        if key is not None:
            sql += " WHERE key = ?"
            params = (key,)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY seq", params).fetchall()
        return [
            Attempt(seq, k, op, fence, bool(accepted), at, holder)
            for seq, k, op, fence, accepted, at, holder in rows
        ]

    async def increment(
        self,
        key: str,
        *,
        pause: float = 0.0,
        fencing_token: int | None = None,
        holder: str | None = None,
    ) -> bool:
        """Add 1 to the counter ``key`` the racy way: read, await ``pause`` seconds, write.

        Two callers interleaving here lose an update, unless a lock keeps them apart,
        which is what a lost-update test shows (see :func:`check_counter`).  With a
        ``fencing_token`` the increment is fenced: it :meth:`claim`\\ s before reading and
        writes with :meth:`write`, so a holder whose token is stale is refused rather
        than overwriting a newer holder's count.  ``pause=0`` still yields to the event
        loop once.

        Returns:
            True if the incremented value was written; False if a fenced increment was
            refused (nothing was written).

        Raises:
            ValueError: ``pause`` is negative (or bad ``fencing_token``, as for write).
            TypeError: the value of ``key`` is not an int.
            sqlite3.Error: the database failed.
        """
        if not pause >= 0:
            raise ValueError(f"pause must be a non-negative number of seconds, got {pause!r}")
        if fencing_token is not None and not self.claim(key, fencing_token, holder=holder):
            return False
        value = self.read_int(key) + 1
        await anyio.sleep(pause)
        if fencing_token is None:
            self.write_unfenced(key, value, holder=holder)
            return True
        return self.write(key, value, fencing_token, holder=holder)

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the database connection.  Idempotent."""
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FencedStore {str(self._path)!r}>"


def check_fenced_writes(store: FencedStore) -> list[FencedWriteViolation]:
    """Every logged operation of ``store`` that contradicts fencing (empty when none did).

    Replays the log in the order the operations took effect and, per key, keeps the
    highest token accepted so far (by writes and claims; unfenced writes are ignored).
    A violation is an accepted token lower than that, or a refused token that was not
    lower.  Never raises for what it finds; ``sqlite3.Error`` if the log cannot be read.
    """
    found = []
    highest: dict[str, int] = {}
    for attempt in store.attempts():
        token = attempt.fencing_token
        if token is None:
            continue
        top = highest.get(attempt.key)
        if attempt.accepted:
            if top is not None and token < top:
                found.append(FencedWriteViolation(attempt, top))
            highest[attempt.key] = token if top is None else max(top, token)
        elif top is None or token >= top:
            found.append(FencedWriteViolation(attempt, top))
    return found
