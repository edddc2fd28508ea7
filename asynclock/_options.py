"""Validated options of one lease.

Everything a caller passes to :func:`asynclock.lease` is checked here, once, before any
I/O: a bad argument raises ``TypeError`` or ``ValueError`` whose message names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from redis.asyncio import Redis

__all__ = ["MIN_TTL", "LeaseOptions", "drift_for"]

MIN_TTL = 0.03
"""Shortest TTL accepted, in seconds: below it a renewal every ttl/3 (10 ms) cannot be
relied on to travel to Redis and back in time."""


def drift_for(ttl: float) -> float:
    """Clock-rate allowance subtracted from a lease's validity, in seconds.

    1% of the TTL covers a server clock running fast relative to ours; the 2 ms floor
    covers timer granularity.
    """
    return ttl * 0.01 + 0.002


_CLIENT_TYPES: set[type] = set()  # client classes already found to be redis.asyncio.Redis
_BUILT: dict[tuple[object, ...], LeaseOptions] = {}  # see LeaseOptions.cached
_BUILT_MAX = 1024


def _number(argument: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number of seconds, not {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{argument} must be finite, got {value!r}")
    return result


def _positive(argument: str, value: object) -> float:
    result = _number(argument, value)
    if result <= 0:
        raise ValueError(f"{argument} must be positive, got {value!r}")
    return result


def _optional_timeout(argument: str, value: object) -> float | None:
    if value is None:
        return None
    result = _number(argument, value)
    if result < 0:
        raise ValueError(f"{argument} must not be negative, got {value!r}")
    return result


@dataclass(frozen=True, slots=True)
class LeaseOptions:
    """The validated settings of one :func:`asynclock.lease` call. Times in seconds.

    Of the names derived from ``prefix`` and ``name`` only the lease's key is kept (every
    acquire, renewal and release uses it); the others are computed when asked for: a
    process may hold ten thousand leases, each with its options.
    """

    name: str
    ttl: float
    blocking: bool
    blocking_timeout: float | None
    release_timeout: float
    prefix: str
    key: str = field(init=False)
    """The Redis key of the lease: ``<prefix>{<name>}`` (one cluster slot per lock)."""
    ttl_ms: int = field(init=False)
    """The TTL in whole milliseconds (at least 1), as sent to Redis."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.prefix}{{{self.name}}}")
        object.__setattr__(self, "ttl_ms", max(1, round(self.ttl * 1000)))

    @property
    def fence_key(self) -> str:
        """The key of the lock's fencing counter."""
        return self.key + ":fence"

    @property
    def channel(self) -> str:
        """The pub/sub channel on which releases of the lock are announced."""
        return self.key + ":released"

    @property
    def waiting_key(self) -> str:
        """The hash in which blocking waits register their client (see ``HANDOFF``)."""
        return self.key + ":waiting"

    def acquire_keys(self, token: str) -> list[str]:
        """The ACQUIRE script's keys for an attempt made with ``token``: the lease, the
        fence counter, the attempt's tombstone and the waiting hash (one format of the key)."""
        key = self.key
        return [key, key + ":fence", f"{key}:void:{token}", key + ":waiting"]

    def void_key(self, token: str) -> str:
        """The tombstone key of an abandoned acquire attempt made with ``token``."""
        return f"{self.key}:void:{token}"

    def safe_until(self, t_send: float) -> float:
        """The safe deadline of a lease whose last confirmed command was sent at loop time
        ``t_send``: ``t_send + ttl - drift`` (seconds)."""
        return t_send + self.ttl - drift_for(self.ttl)

    @classmethod
    def cached(
        cls,
        redis: object,
        name: object,
        ttl: object,
        blocking: object,
        blocking_timeout: object,
        release_timeout: object,
        prefix: object,
        /,
    ) -> LeaseOptions:
        """The options of ``lease(redis, name, ...)``: every argument checked, or
        ``TypeError``/``ValueError`` naming the first bad one. Options built from equal
        arguments are reused: code that takes the same lock again and again validates its
        arguments once. The arguments' types are part of that comparison (``ttl=True``
        must not pass for ``ttl=1``)."""
        key: tuple[object, ...] | None = None
        if type(redis) in _CLIENT_TYPES:
            # (built in one expression: this runs at every lease())
            key = (
                name,
                ttl,
                blocking,
                blocking_timeout,
                release_timeout,
                prefix,
                type(name),
                type(ttl),
                type(blocking),
                type(blocking_timeout),
                type(release_timeout),
                type(prefix),
            )
            try:
                return _BUILT[key]
            except KeyError:
                pass
            except TypeError:  # an unhashable argument: built (and reported) uncached
                key = None
        elif not isinstance(redis, Redis):  # (isinstance against Redis is slow: once)
            raise TypeError(
                "redis must be a redis.asyncio.Redis client (redis-py's asyncio API), "
                f"not {type(redis).__module__}.{type(redis).__qualname__}"
            )
        else:
            _CLIENT_TYPES.add(type(redis))
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        if not name:
            raise ValueError("name must not be empty")
        ttl_s = _positive("ttl", ttl)
        if ttl_s < MIN_TTL:
            raise ValueError(
                f"ttl must be at least {MIN_TTL}s so the lease can be renewed every ttl/3, "
                f"got {ttl!r}"
            )
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be a bool, not {type(blocking).__name__}")
        wait = _optional_timeout("blocking_timeout", blocking_timeout)
        if wait is not None and not blocking:
            raise ValueError("blocking_timeout can only be given with blocking=True")
        release = _positive("release_timeout", release_timeout)
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        if "{" in prefix or "}" in prefix:
            raise ValueError("prefix must not contain '{' or '}' (the name is the hash tag)")
        options = cls(
            name=name,
            ttl=ttl_s,
            blocking=blocking,
            blocking_timeout=wait,
            release_timeout=release,
            prefix=prefix,
        )
        if key is not None:
            if len(_BUILT) >= _BUILT_MAX:
                _BUILT.clear()
            _BUILT[key] = options
        return options
