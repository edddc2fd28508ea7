"""valkey-py clients: the Valkey project's fork of redis-py, with the same API and its own
exception classes.

Design note. asynclock drives a client's pools and connections directly (see ``_lane``),
which valkey-py's mirror, so a ``valkey.asyncio.Valkey`` client (a Sentinel's
``master_for()`` one too) works as a redis-py one does; what differs is that it raises
``valkey.exceptions.*``, which redis-py's classes do not catch. Where a reply or an error
comes off a connection (the lane's round trips and the pools asked for a connection), a
valkey-py error is turned into one that is both: an instance of a class deriving from the
redis-py class of the same name and from the valkey-py class itself, with the same
arguments, attributes and traceback. asynclock's own handling (NOSCRIPT, a connection
error, an error reply returned in a reply's place) then works unchanged, and an
application that catches ``valkey.exceptions.ConnectionError`` still catches it.

valkey-py is never imported here: a valkey-py error can only exist once the application
has imported it, so :func:`valkey_errors` looks for it in ``sys.modules`` when an error
is being matched (never on the path of a reply).

A ``valkey.asyncio.ValkeyCluster`` client is a cluster client as redis-py's
``RedisCluster`` is (``_cluster``): its node clients are valkey-py ``Valkey`` clients
(:class:`Family`), and what asynclock asks of the cluster client itself (its slot map,
loaded or reloaded) goes through :func:`redis_errors`, so that its errors, too, are
redis-py's classes as well (``ValkeyClusterException`` as ``RedisClusterException``).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Awaitable
from typing import Any, Final, TypeVar

import redis.exceptions

__all__ = [
    "LIBRARIES",
    "Family",
    "as_redis_error",
    "family_named",
    "family_of",
    "redis_errors",
    "sentinel_classes",
    "valkey_errors",
]

T = TypeVar("T")

_REDIS_ERRORS: Final = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)


def valkey_errors() -> tuple[type[BaseException], ...]:
    """valkey-py's base errors (``ValkeyError`` and ``ValkeyClusterException``, which is
    not one) once valkey-py is imported, else ``()``: for an ``except`` clause, evaluated
    only when an error is matched."""
    module = sys.modules.get("valkey.exceptions")
    return () if module is None else (module.ValkeyError, module.ValkeyClusterException)


async def redis_errors(awaitable: Awaitable[T]) -> T:
    """``await awaitable``, a valkey-py error it raises as :func:`as_redis_error` makes it
    (a call on a client or a pool itself, not a lane's round trip: a cluster's slot
    map, a connection the lane borrows)."""
    try:
        return await awaitable
    except valkey_errors() as exc:  # (evaluated only when an error is matched)
        raise as_redis_error(exc) from exc.__cause__


def as_redis_error(error: BaseException) -> BaseException:
    """``error`` as an instance of both its valkey-py class and the redis-py class of the
    same name (the nearest base's name, "Valkey" read as "Redis": ``RedisError`` for
    ``ValkeyError``), same arguments, attributes and traceback; any other error as it is."""
    errors = valkey_errors()
    if not errors or not isinstance(error, errors) or isinstance(error, _REDIS_ERRORS):
        return error
    both = _both(type(error))  # type: ignore[arg-type]  # (a class is hashable)
    try:  # (redis-py's __init__ sets attributes of its own: error_type, status_code)
        translated = both(*error.args)
    except Exception:  # (a class whose __init__ takes other arguments)
        translated = both.__new__(both, *error.args)
    translated.args = error.args
    translated.__dict__.update(error.__dict__)
    translated.__cause__ = error.__cause__
    translated.__context__ = error.__context__
    translated.__suppress_context__ = error.__suppress_context__
    return translated.with_traceback(error.__traceback__)


@functools.cache
def _both(cls: type[BaseException]) -> type[BaseException]:
    """The class deriving from redis-py's counterpart of ``cls`` and from ``cls`` (made
    once per class)."""
    counterpart: type[BaseException] = redis.exceptions.RedisError
    for base in cls.__mro__:
        found = getattr(redis.exceptions, base.__name__.replace("Valkey", "Redis"), None)
        if isinstance(found, type) and issubclass(found, _REDIS_ERRORS):
            counterpart = found
            break
    return type(cls.__name__, (counterpart, cls), {"__module__": cls.__module__})


LIBRARIES: Final = {"redis": "redis-py", "valkey": "valkey-py"}
"""The client libraries asynclock works with: their packages' names, and what they are
called."""


class Family:
    """The classes asynclock builds its own pools and clients from, of the library a
    client is from (redis-py or valkey-py): a pool of one library's connections must be
    of the same library. The command line makes its clients from them too."""

    def __init__(self, root: str) -> None:
        asyncio_ = importlib.import_module(f"{root}.asyncio")
        connection = importlib.import_module(f"{root}.asyncio.connection")
        sentinel = importlib.import_module(f"{root}.asyncio.sentinel")
        self.client: Any = asyncio_.Valkey if root == "valkey" else asyncio_.Redis
        self.cluster: Any = asyncio_.ValkeyCluster if root == "valkey" else asyncio_.RedisCluster
        self.parse_url: Any = connection.parse_url
        self.pool: Any = connection.ConnectionPool
        self.blocking_pool: Any = connection.BlockingConnectionPool
        self.sentinel_pool: type[Any] = sentinel.SentinelConnectionPool
        self.sentinel_connection: type[Any] = sentinel.SentinelManagedConnection
        self._root = root

    def no_retry(self) -> Any:
        """A ``Retry`` that makes no second attempt."""
        retry = importlib.import_module(f"{self._root}.asyncio.retry")
        backoff = importlib.import_module(f"{self._root}.backoff")
        return retry.Retry(backoff.NoBackoff(), 0)


def family_of(client: object) -> Family:
    """The :class:`Family` of ``client`` (a redis-py or valkey-py asyncio client)."""
    return family_named("valkey" if type(client).__module__.startswith("valkey.") else "redis")


@functools.cache
def family_named(root: str) -> Family:
    """The :class:`Family` of the library ``root`` (a key of :data:`LIBRARIES`), its
    modules imported at the first call (``ImportError`` if it is not installed)."""
    return Family(root)


def sentinel_classes() -> tuple[tuple[type[Any], ...], tuple[type[Any], ...]]:
    """The Sentinel pool classes and Sentinel connection classes of redis-py, and of
    valkey-py once its Sentinel module is imported (a valkey-py Sentinel client exists
    only then)."""
    families = [family_named("redis")]
    if "valkey.asyncio.sentinel" in sys.modules:
        families.append(family_named("valkey"))
    return (
        tuple(f.sentinel_pool for f in families),
        tuple(f.sentinel_connection for f in families),
    )
