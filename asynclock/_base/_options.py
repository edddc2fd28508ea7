"""Validated options of one lease.

Everything a caller passes to :func:`asynclock.lease` is checked here, once, before any
I/O: a bad argument raises ``TypeError`` or ``ValueError`` whose message names it.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

if TYPE_CHECKING:
    # (typing.TypeIs from Python 3.13 on: the type checker's own stubs; valkey-py's
    # clients too, for a type checker that has valkey-py)
    from typing_extensions import TypeIs
    from valkey.asyncio import Valkey
    from valkey.asyncio.cluster import ValkeyCluster

    Client = Redis | RedisCluster | Valkey | ValkeyCluster
else:
    Client = Redis | RedisCluster
"""What a lock is taken through: a redis-py asyncio client of one server (standalone or a
Sentinel's primary) or of a Redis Cluster, or valkey-py's ``Valkey`` or ``ValkeyCluster``
(the same API), see :func:`is_client`. Inside, every client is used through the
redis-py API it offers (:func:`redis_api`)."""


RedisApi = Redis | RedisCluster
"""A client as asynclock uses it inside: the redis-py API (see :func:`redis_api`)."""


def redis_api(client: Client) -> RedisApi:
    """``client`` as the redis-py API it offers: valkey-py's clients have the same
    methods, and asynclock calls only those (a cast for the type checker; no work)."""
    return cast("RedisApi", client)


__all__ = [
    "MAX_LIMIT",
    "MAX_TTL",
    "MIN_TTL",
    "LeaseOptions",
    "RedisApi",
    "is_client",
    "is_cluster",
    "redis_api",
    "replicas_confirmed",
]


def is_client(value: object) -> bool:
    """Whether ``value`` is a client a lease can be taken through (see ``Client``): a
    ``valkey.asyncio.Valkey`` client too (valkey-py: the Valkey project's fork of
    redis-py, same API; a Sentinel's ``master_for()`` one too). Never imports valkey-py:
    an application with such a client has imported it."""
    if type(value) in _CLIENT_TYPES or isinstance(value, Redis) or is_cluster(value):
        return True
    module = sys.modules.get("valkey.asyncio")
    return module is not None and isinstance(value, module.Valkey)


def is_cluster(value: object) -> TypeIs[RedisCluster]:
    """Whether ``value`` is a cluster client: redis-py's ``RedisCluster`` or valkey-py's
    ``ValkeyCluster`` (the same API, typed as the former). Never imports valkey-py."""
    if isinstance(value, RedisCluster):
        return True
    module = sys.modules.get("valkey.asyncio.cluster")
    return module is not None and isinstance(value, module.ValkeyCluster)


MIN_TTL = 0.03
"""Shortest TTL accepted, in seconds: below it a renewal every ttl/3 (10 ms) cannot be
relied on to travel to Redis and back in time."""

MAX_TTL = 900_000_000_000.0
"""Longest TTL (and ``fence_ttl``) accepted, in seconds (about 28,500 years): every expiry
derived from it (up to 10 x ttl, in milliseconds) stays an integer that Lua's numbers
hold exactly (2**53) and that Redis accepts as an expiry."""

_CLIENT_TYPES: set[type] = set()  # client classes already found to be redis.asyncio.Redis
_BUILT: dict[tuple[object, ...], LeaseOptions] = {}  # see LeaseOptions.cached
_BUILT_MAX = 1024

MAX_LIMIT: Final = 1000
"""The most permits a semaphore may have (an acquire finds a free one in an index, in
O(log N): the bound is for ``inspect()``, which reads every permit's key)."""

MAX_REPLICAS: Final = 64
"""The most replicas ``min_replicas`` may ask to confirm a lease."""


def _number(argument: str, value: object) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{argument} must be a number of seconds or a timedelta, not {type(value).__name__}"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{argument} must be finite, got {value!r}")
    return result


def _positive(argument: str, value: object) -> float:
    result = _number(argument, value)
    if result <= 0:
        raise ValueError(f"{argument} must be positive, got {value!r}")
    return result


def _duration(argument: str, value: object) -> float:
    """A TTL: positive, at least MIN_TTL, at most MAX_TTL seconds."""
    result = _positive(argument, value)
    if result < MIN_TTL:
        raise ValueError(
            f"{argument} must be at least {MIN_TTL}s so the lease can be renewed every "
            f"ttl/3, got {value!r}"
        )
    if result > MAX_TTL:
        raise ValueError(
            f"{argument} must be at most {MAX_TTL:.0f}s (about 28,500 years; Redis and "
            f"its Lua scripts cannot count longer expiries exactly), got {value!r}"
        )
    if argument == "ttl" and not isinstance(value, timedelta) and result % 1000 == 0:
        warnings.warn(
            f"{argument}={value!r} is {result / 3600:.1f} hours: asynclock takes seconds "
            f"(did you mean {argument}={result / 1000:g}, milliseconds given as seconds?); "
            "pass a timedelta to say it is meant",
            UserWarning,
            stacklevel=_caller_level(),
        )
    return result


_PACKAGE = str(Path(__file__).resolve().parent.parent)  # (asynclock/)


def _caller_level() -> int:
    """The ``stacklevel`` of a warning about the caller's arguments: that of the first
    frame outside asynclock (the call of ``lease()``, ``once()``, ...), however deep
    inside the package the check runs."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _optional_timeout(argument: str, value: object) -> float | None:
    if value is None:
        return None
    result = _number(argument, value)
    if result < 0:
        raise ValueError(f"{argument} must not be negative, got {value!r}")
    return result


class _Named:
    """A name of one lock's (one of its keys, or its channel): the lock's base key and
    ``suffix``, made when asked for (see ``LeaseOptions``)."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def __get__(self, options: LeaseOptions, owner: object = None) -> str:
        return options.base_key + self.suffix


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
    fence_ttl: float = 0.0
    """How long the fencing counter outlives its last write, seconds (0: the default)."""
    hold_at_least: float = 0.0
    """Seconds from the acquisition before which a release keeps the key (0: none)."""
    max_hold: float = 0.0
    """Seconds from the acquisition after which the lease is taken away (0: never)."""
    limit: int = 1
    """How many leases may hold the lock at once (1: a mutex; more: a semaphore)."""
    fair: bool = False
    """Waiters take the lock in the order they came, across processes (see ``_fair``)."""
    shared: bool = False
    """Many shared holders at once, none beside an exclusive one (see ``_shared``)."""
    min_replicas: int = 0
    """Replicas that must confirm (``WAIT``) an acquisition and each renewal (0: none)."""
    wait_aof: bool = False
    """``min_replicas`` counts replicas that wrote the lease to their append-only file
    (``WAITAOF``), not only received it (``WAIT``)."""
    slot: int = -1
    """For a permit of a semaphore held: which of its ``limit`` keys holds it (else -1)."""
    reader: str = ""
    """For a shared lease held: its token (it is a member of the lock's readers' set,
    which is its ``key``)."""
    base_key: str = field(init=False)
    """``<prefix>{<name>}``: the lock's key, and the stem of all its keys."""
    key: str = field(init=False)
    """The Redis key of the lease: ``<prefix>{<name>}`` (one cluster slot per lock); a
    semaphore's permit ``slot``: ``<prefix>{<name>}:permit:<slot>``."""
    ttl_ms: int = field(init=False)
    """The TTL in whole milliseconds (at least 1), as sent to Redis."""
    fence_ttl_ms: int = field(init=False)
    """The fencing counter's retention in whole milliseconds, as sent to Redis."""
    _permits: dict[int, LeaseOptions] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """A semaphore's options for each of its permits held so far, by slot (``permit``)."""

    def __post_init__(self) -> None:
        base = f"{self.prefix}{{{self.name}}}"
        object.__setattr__(self, "base_key", base)
        key = base if self.slot < 0 else f"{base}:permit:{self.slot}"
        if self.reader:
            key = base + ":readers"  # (see readers_key)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "ttl_ms", max(1, round(self.ttl * 1000)))
        # Unless given, the fencing counter outlives its last acquisition by 10 x ttl, and
        # at least a minute. It only adds to the server's clock, by which tokens are
        # floored (see the ACQUIRE script): it keeps tokens increasing should that clock
        # step back while it lives. A long retention costs one small key per finished
        # name (a lock per job).
        fence_ttl = self.fence_ttl or max(10 * self.ttl, 60.0)
        object.__setattr__(self, "fence_ttl", fence_ttl)
        object.__setattr__(self, "fence_ttl_ms", max(self.ttl_ms, round(fence_ttl * 1000)))

    fence_key = _Named(":fence")
    """The key of the lock's fencing counter (shared by a semaphore's permits)."""

    channel = _Named(":released")
    """The pub/sub channel on which releases of the lock (any of its permits) are
    announced."""

    permits_key = _Named(":permits")
    """A semaphore's index of its permits (slot -> server ms at which its key
    expires; see ``SEMAPHORE_ACQUIRE``)."""

    limit_key = _Named(":limit")
    """The limit a semaphore's permits are held with."""

    queue_key = _Named(":queue")
    """A fair lock's queue of waiters (see ``FAIR_ACQUIRE``)."""

    alive_key = _Named(":queue:alive")
    """A fair lock's hash of its queued waiters' liveness (see ``FAIR_ACQUIRE``)."""

    readers_key = _Named(":readers")
    """The sorted set of a lock's shared holders ("<token>:<fencing token>" -> until,
    server ms)."""

    def permit(self, slot: int) -> LeaseOptions:
        """These options for a permit held in ``slot`` (its own key), made once per slot
        and kept with these options (at most ``limit``: a process holding every permit
        of ten semaphores of 1000 keeps 10,000, where one cache for all would churn)."""
        permits = self._permits
        if permits is None:
            permits = {}
            object.__setattr__(self, "_permits", permits)
        found = permits.get(slot)
        if found is None:
            found = permits[slot] = replace(self, slot=slot)
        return found

    waiting_key = _Named(":waiting")
    """The hash in which blocking waits register their client (see ``HANDOFF``)."""

    def attempt_keys(self, token: str, *more: str) -> list[str]:
        """The keys an acquire script's attempt made with ``token`` begins with: the lock's
        key, its fence counter and the attempt's tombstone; then ``more``, the kind's own
        (the mutex's ACQUIRE: the waiting hash)."""
        return [self.key, self.fence_key, self.void_key(token), *more]

    def void_key(self, token: str) -> str:
        """The tombstone key of an abandoned acquire attempt made with ``token``."""
        return f"{self.base_key}:void:{token}"

    @property
    def tombstone_ms(self) -> int:
        """How long (ms) the tombstone of an abandoned acquire attempt lasts: long enough
        that the attempt cannot land after it (3 x ttl, at least 10 s)."""
        return max(10_000, 3 * self.ttl_ms)

    @property
    def replica_wait_ms(self) -> int:
        """How long (ms) a ``WAIT`` for ``min_replicas`` may block (and the ``WAITAOF``
        behind it, with ``wait_aof``): a tenth of the TTL, at least 1 ms (``WAIT`` with
        0 would block for ever) and at most 5 s."""
        return min(5000, max(1, self.ttl_ms // 10))

    @property
    def confirmation_steps(self) -> int:
        """How many commands :meth:`confirmation` sends (each blocks up to its wait)."""
        return 2 if self.wait_aof else 1

    def confirmation(self, wanted: int, wait_ms: int) -> tuple[tuple[str | int, ...], ...]:
        """The commands that block their connection until ``wanted`` replicas confirm
        every write sent on it before, each for at most ``wait_ms`` milliseconds:
        ``WAIT``, and with ``wait_aof`` a ``WAITAOF`` behind it (:func:`replicas_confirmed`
        reads the last reply). A replica tells what its file holds only when asked, and
        asked along with a write it has not written yet (it writes before it next
        sleeps); unasked, it tells once a second. ``WAIT`` returns once the replica has
        the write, so the ``WAITAOF`` asks again after that: a replica that writes its
        file at each write confirms at once, where alone it took a second."""
        wait = ("WAIT", wanted, wait_ms)
        if self.wait_aof:
            return (wait, ("WAITAOF", 0, wanted, wait_ms))
        return (wait,)

    def safe_until(self, t_send: float) -> float:
        """The safe deadline of a lease whose last confirmed command was sent at loop time
        ``t_send``: ``t_send + ttl - drift`` (seconds). The drift, a clock-rate allowance,
        is 1% of the TTL (a server clock running fast relative to ours) and 2 ms (timer
        granularity)."""
        return t_send + self.ttl - (self.ttl * 0.01 + 0.002)

    @classmethod
    def cached(cls, redis: object, name: object, given: Mapping[str, object]) -> LeaseOptions:
        """The options of ``lease(redis, name, **given)``: every argument checked, or
        ``TypeError``/``ValueError`` naming the first bad one (an unknown keyword too);
        those ``given`` leaves out take their defaults (``KEYWORDS``). Options built from
        equal arguments are reused: code that takes the same lock again and again
        validates its arguments once. The arguments' types are part of that comparison
        (``ttl=True`` must not pass for ``ttl=1``)."""
        key: tuple[object, ...] | None = None
        if type(redis) in _CLIENT_TYPES:
            # (this runs at every lease(): a tuple of what was given, types included)
            key = (name, type(name), *given.items(), *map(type, given.values()))
            try:
                return _BUILT[key]
            except KeyError:
                pass
            except TypeError:  # an unhashable argument: built (and reported) uncached
                key = None
        elif is_client(redis):  # (a redis-py or valkey-py client of a server or a cluster)
            _CLIENT_TYPES.add(type(redis))
        else:
            raise TypeError(
                "redis must be a redis.asyncio.Redis or RedisCluster client (redis-py's "
                "asyncio API) or a valkey.asyncio.Valkey or ValkeyCluster client, not "
                f"{type(redis).__module__}.{type(redis).__qualname__}"
            )
        unknown = given.keys() - KEYWORDS.keys()
        if unknown:
            raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
        options = cls(name=_check_name(name), **_checked({**KEYWORDS, **given}))
        if key is not None:
            if len(_BUILT) >= _BUILT_MAX:
                _BUILT.clear()
            _BUILT[key] = options
        return options


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("name must not be empty")
    if name.startswith("}"):
        raise ValueError(
            f"name must not start with '}}', got {name!r}: a lock's keys share the hash "
            "tag {name}, and a tag that closes at once is empty, which would spread "
            "them over Redis Cluster slots"
        )
    return name


def _checked(given: Mapping[str, object]) -> dict[str, Any]:
    """Every option of ``given`` (all of ``KEYWORDS``) checked and converted by its entry
    of ``_OPTIONS`` (seconds as floats, 0 for an option not given), then every rule about
    combining them: the one place they are written."""
    values = {
        argument: check(argument, given[argument]) for argument, (_, check) in _OPTIONS.items()
    }
    ttl, fence = values["ttl"], values["fence_ttl"]
    if fence and fence < ttl:
        raise ValueError(
            f"fence_ttl must be at least ttl ({ttl:g}s): the fencing counter must "
            f"outlive the lease, got {given['fence_ttl']!r}"
        )
    if values["blocking_timeout"] is not None and not values["blocking"]:
        raise ValueError("blocking_timeout can only be given with blocking=True")
    hold, most = values["hold_at_least"], values["max_hold"]
    if most and most < hold:
        raise ValueError(f"max_hold ({most:g}s) must not be shorter than hold_at_least ({hold:g}s)")
    limit = values["limit"]
    if values["fair"] and limit > 1:
        raise ValueError("fair=True is for a plain lock: it cannot be given with limit")
    if values["shared"] and (limit > 1 or values["fair"] or hold):
        raise ValueError(
            "shared=True cannot be given with limit, fair or hold_at_least (a shared "
            "lease is one of many readers of a plain lock)"
        )
    if values["wait_aof"] and not values["min_replicas"]:
        raise ValueError("wait_aof=True needs min_replicas (the replicas that must confirm)")
    return values


def _optional_ttl(argument: str, value: object) -> float:
    """A TTL (``_duration``) that may be left out (0.0: not given)."""
    return 0.0 if value is None else _duration(argument, value)


def _longest(argument: str, value: object) -> float:
    """An optional positive duration of at most ``MAX_TTL`` (0.0: not given)."""
    if value is None:
        return 0.0
    seconds = _positive(argument, value)
    if seconds > MAX_TTL:
        raise ValueError(f"{argument} must be at most {MAX_TTL:.0f}s, got {value!r}")
    return seconds


def _integer(least: int, most: int) -> Callable[[str, object], int]:
    """The check of an int option between ``least`` and ``most``."""

    def check(argument: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{argument} must be an int, not {type(value).__name__}")
        if not least <= value <= most:
            raise ValueError(f"{argument} must be between {least} and {most}, got {value!r}")
        return value

    return check


def _flag(argument: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be a bool, not {type(value).__name__}")
    return value


def _prefix(argument: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    if "{" in value or "}" in value:
        raise ValueError(f"{argument} must not contain '{{' or '}}' (the name is the hash tag)")
    return value


_OPTIONS: Final[Mapping[str, tuple[object, Callable[[str, object], Any]]]] = {
    "ttl": (10.0, _duration),
    "fence_ttl": (None, _optional_ttl),
    "blocking": (True, _flag),
    "blocking_timeout": (None, _optional_timeout),
    "release_timeout": (2.0, _positive),
    "hold_at_least": (None, _longest),
    "max_hold": (None, _longest),
    "limit": (1, _integer(1, MAX_LIMIT)),
    "fair": (False, _flag),
    "shared": (False, _flag),
    "min_replicas": (0, _integer(0, MAX_REPLICAS)),
    "wait_aof": (False, _flag),
    "prefix": ("asynclock:", _prefix),
}
"""The options of a lease (``lease()``'s keyword arguments but ``on_event``, which is not
the lease's but its caller's): their one definition, each with its default and how it is
checked and converted, given its name and value (in the order they are checked)."""

KEYWORDS: Final[Mapping[str, object]] = {
    argument: default for argument, (default, _) in _OPTIONS.items()
}
"""The options of a lease with their defaults (see ``_OPTIONS``)."""


def replicas_confirmed(reply: object) -> int:
    """The replicas that confirmed, from the reply of a :meth:`LeaseOptions.confirmation`
    command (``WAIT``: a count; ``WAITAOF``: the local and the replicas' counts), or -1
    for anything else."""
    if isinstance(reply, list) and len(reply) == 2:
        reply = reply[1]
    return reply if isinstance(reply, int) and not isinstance(reply, bool) else -1
