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

from ._context import LeaseContext as LeaseContext
from ._context import acquire as acquire
from ._context import lease as lease
from ._events import EventHook as EventHook
from ._events import LeaseEvent as LeaseEvent
from ._events import LeaseEventKind as LeaseEventKind
from ._every import every as every
from ._exceptions import AcquireTimeout as AcquireTimeout
from ._exceptions import IdempotencyConflict as IdempotencyConflict
from ._exceptions import LimitConflict as LimitConflict
from ._exceptions import LockBusy as LockBusy
from ._exceptions import LockError as LockError
from ._exceptions import LockLost as LockLost
from ._exceptions import LossReason as LossReason
from ._lease import Lease as Lease
from ._lease import LeaseGuard as LeaseGuard
from ._lease import LeaseState as LeaseState
from ._once import Serializer as Serializer
from ._once import forget as forget
from ._once import idempotent as idempotent
from ._once import once as once
from ._statistics import LockStatistics as LockStatistics
from ._statistics import statistics as statistics

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
    "LockLost",
    "LockStatistics",
    "LossReason",
    "Serializer",
    "acquire",
    "every",
    "forget",
    "idempotent",
    "lease",
    "once",
    "statistics",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("asynclock._"):
        _obj.__module__ = "asynclock"
del _name, _obj
