"""asynclock: distributed leases on Redis for asyncio, whose work stops before the lease can.

::

    async with asynclock.lease(redis, "import-products", ttl=30) as lock:
        ...  # cancelled, and LockLost raised, before another holder could get the lock

    lock = await asynclock.acquire(redis, "partition-7", ttl=30)  # held until released
    async with lock.guard():
        ...  # the same promise, for this stretch of work
    await lock.release()

See ``lease`` for the arguments and ``Lease`` for what the holder sees.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from ._apps._current import current_lease as current_lease
from ._apps._every import every as every
from ._apps._exclusive import exclusive as exclusive
from ._apps._inspect import LockInfo as LockInfo
from ._apps._inspect import inspect as inspect
from ._apps._once import Serializer as Serializer
from ._apps._once import forget as forget
from ._apps._once import idempotent as idempotent
from ._apps._once import once as once
from ._apps._statistics import LockStatistics as LockStatistics
from ._apps._statistics import statistics as statistics
from ._apps._template import client_from as client_from
from ._base._events import EventHook as EventHook
from ._base._events import LeaseEvent as LeaseEvent
from ._base._events import LeaseEventKind as LeaseEventKind
from ._base._exceptions import AcquireTimeout as AcquireTimeout
from ._base._exceptions import IdempotencyConflict as IdempotencyConflict
from ._base._exceptions import LimitConflict as LimitConflict
from ._base._exceptions import LockBusy as LockBusy
from ._base._exceptions import LockError as LockError
from ._base._exceptions import LockLost as LockLost
from ._base._exceptions import LossReason as LossReason
from ._base._exceptions import ReplicationTimeout as ReplicationTimeout
from ._base._exceptions import ResultNotStored as ResultNotStored
from ._lifecycle._context import LeaseContext as LeaseContext
from ._lifecycle._context import acquire as acquire
from ._lifecycle._context import lease as lease
from ._lifecycle._lease import Lease as Lease
from ._lifecycle._lease import LeaseGuard as LeaseGuard
from ._lifecycle._lease import LeaseState as LeaseState
from ._lifecycle._redlock import RedlockLease as RedlockLease

try:
    __version__ = _version("asynclock")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AcquireTimeout",
    "EventHook",
    "IdempotencyConflict",
    "Lease",
    "LeaseContext",
    "LeaseEvent",
    "LeaseEventKind",
    "LeaseGuard",
    "LeaseState",
    "LimitConflict",
    "LockBusy",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockStatistics",
    "LossReason",
    "RedlockLease",
    "ReplicationTimeout",
    "ResultNotStored",
    "Serializer",
    "acquire",
    "client_from",
    "current_lease",
    "every",
    "exclusive",
    "forget",
    "idempotent",
    "inspect",
    "lease",
    "once",
    "statistics",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("asynclock._"):
        _obj.__module__ = "asynclock"
del _name, _obj
