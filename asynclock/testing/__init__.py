"""A fault kit for testing code that uses locks: servers, faults, and checkers.

This package is public API.  It helps tests (yours and asynclock's own) exercise the
failure modes a distributed lease has to survive, and check what happened:

* **Servers** -- :class:`RedisServer` runs a private ``redis-server`` or
  ``valkey-server`` process on a free loopback port, and can pause (``SIGSTOP``),
  resume, kill, restart it on the same port, and start replicas of it;
  :func:`available_engines`, :func:`find_server_binary`, :func:`resp_command`.
* **PostgreSQL** -- :class:`PostgresServer` runs a private PostgreSQL cluster on a free
  loopback port (as the ``postgres`` user when run as root), for fenced effects.
* **Network faults** -- :class:`FaultProxy` is an asyncio TCP proxy between a client
  and a server that can delay, drop or hold traffic per direction (:class:`ProxyMode`),
  reset every connection, refuse new ones, or lose exactly one reply.
* **History** -- :class:`History` records who held which lock when (from any number of
  processes, into one JSON-lines file); :func:`check_no_overlap`,
  :func:`check_fencing`, :func:`measure_overlap`, :func:`check_counter` and
  :func:`keys_left` check the record and the server afterwards.
* **A fenced resource** -- :class:`FencedStore`, on SQLite, refuses writes whose
  fencing token is stale and logs every attempt for :func:`check_fenced_writes`; its
  :meth:`~FencedStore.increment` is a read-pause-write counter for lost-update tests.

The checkers never raise on what they find: each returns a list of :class:`Violation`
objects whose ``str()`` explains the problem, so a test writes
``assert not check_no_overlap(history.intervals)``.  All durations are in seconds
(``float``), and all timestamps are ``time.monotonic()`` seconds.

Nothing here is needed at run time by asynclock itself.
"""

from __future__ import annotations

from ._fenced import Attempt as Attempt
from ._fenced import FencedStore as FencedStore
from ._fenced import FencedWriteViolation as FencedWriteViolation
from ._fenced import Value as Value
from ._fenced import check_fenced_writes as check_fenced_writes
from ._history import CounterMismatch as CounterMismatch
from ._history import FencingViolation as FencingViolation
from ._history import Guard as Guard
from ._history import History as History
from ._history import Interval as Interval
from ._history import Loss as Loss
from ._history import Overlap as Overlap
from ._history import OverlapStats as OverlapStats
from ._history import Pause as Pause
from ._history import Violation as Violation
from ._history import check_counter as check_counter
from ._history import check_fencing as check_fencing
from ._history import check_no_overlap as check_no_overlap
from ._history import keys_left as keys_left
from ._history import measure_overlap as measure_overlap
from ._postgres import PostgresServer as PostgresServer
from ._postgres import find_postgres_bindir as find_postgres_bindir
from ._proxy import Direction as Direction
from ._proxy import FaultProxy as FaultProxy
from ._proxy import ProxyMode as ProxyMode
from ._servers import ENGINES as ENGINES
from ._servers import LOOPBACK as LOOPBACK
from ._servers import ExternalServer as ExternalServer
from ._servers import RedisServer as RedisServer
from ._servers import ServerInfo as ServerInfo
from ._servers import ServerStartError as ServerStartError
from ._servers import TLSFiles as TLSFiles
from ._servers import available_engines as available_engines
from ._servers import find_server_binary as find_server_binary
from ._servers import resp_command as resp_command
from ._servers import server_version as server_version

# ENGINES and LOOPBACK stay importable as before the package split, but (as before) are
# not part of ``from asynclock.testing import *``.
__all__ = [
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

# Show the public home in reprs, docs and pickles: asynclock.testing.History, not
# asynclock.testing._history.History (pickle finds the names here as well).
for _name in __all__:
    _obj = globals()[_name]
    if (isinstance(_obj, type) or callable(_obj)) and getattr(_obj, "__module__", "").startswith(
        "asynclock.testing._"
    ):
        _obj.__module__ = __name__
del _name, _obj
