"""Operating locks: who holds what (``inspect``, ``list_locks``) and releasing by hand
(``force_release``), for the ``asynclock inspect | list | release`` commands.

Design note. Everything here reads or deletes keys from outside the lease lifecycle. A
forced release deletes the lock's holder keys (its key, a semaphore's permits, the shared
holders' set) and announces a release on the lock's channel, so waiters try at
once; it never deletes the fencing counter, so tokens keep rising. A holder finds out at
its next renewal (within a third of its TTL): ``LockLost(not_owner)``, its block
cancelled, as after any loss of its key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final, cast

from .._base._options import Client, LeaseOptions, is_cluster, redis_api
from .._redis._cluster import node_client, primary_clients
from .._redis._lane import reply_text
from .._redis._scripts import Script
from ._statistics import LockStatistics, statistics

__all__ = ["LockInfo", "force_release", "inspect", "list_locks"]


@dataclass(frozen=True, slots=True)
class LockInfo:
    """What holds a lock now (see :func:`inspect`). Times in seconds."""

    name: str
    held: bool
    kind: str
    """``mutex``, ``shared`` (held by shared leases), ``semaphore`` (permits held), or
    ``free``."""
    fencing_token: int | None
    """The exclusive holder's fencing token (the highest held, for a semaphore)."""
    acquired_at: float | None
    """When the holder's fencing token was minted, as UNIX time (seconds): the token is
    the server's clock in microseconds, or a little above it (None if it does not look
    like one)."""
    holder: str | None
    """The first 8 characters of the exclusive holder's token (its lease's ``token``)."""
    time_left: float | None
    """Seconds before the holder's key expires unless renewed (the first to expire, for
    a semaphore); None when not held or the key has no expiry."""
    waiters: int
    """Clients registered waiting for it (any process), plus waiters in its fair queue."""
    shared_holders: int
    permits_in_use: int
    limit: int | None
    """A semaphore's limit, while its permits are held lately; else None."""
    fence_retention: float | None
    """Seconds the fencing counter is kept unless the lock is taken again (None: no
    counter, or no expiry)."""
    last_fencing_token: int | None
    """The last fencing token minted for the lock (by any holder), if the counter lives."""
    retention: dict[str, float | None]
    """The lock's auxiliary keys that exist, by suffix (``fence``, ``waiting``, ``queue``,
    ``queue:alive``, ``readers``, ``limit``, ``permits``, ``result``), each with the
    seconds before it expires (None: no expiry). Short-lived per-holder keys (tombstones,
    tick marks of ``every``) are not listed."""

    def as_dict(self) -> dict[str, Any]:
        """The fields, for JSON."""
        return {field: getattr(self, field) for field in self.__slots__}


def _wall(token: int | None) -> float | None:
    """A fencing token read as the server's clock (µs) at its minting, if it looks like
    one (between 2001 and 2286)."""
    if token is None or not 1e15 <= token < 1e16:
        return None
    return token / 1e6


def _seconds(pttl: int) -> float | None:
    return pttl / 1000 if pttl >= 0 else None


async def inspect(redis: Client, name: str, *, prefix: str = "asynclock:") -> LockInfo:
    """What holds the lock ``name`` and who waits for it: two round trips, nothing
    written. Works for every kind of lock.

    Raises ``TypeError``/``ValueError`` for bad arguments before any I/O, and what the
    client raises when Redis cannot be reached.
    """
    stats = await statistics(redis, name, prefix=prefix)
    options = LeaseOptions.cached(redis, name, {"prefix": prefix})
    node = await node_client(redis, options.base_key) if is_cluster(redis) else redis
    limit = stats.limit or 0
    base = options.base_key
    async with node.pipeline(transaction=False) as pipe:
        pipe.get(options.key)
        pipe.get(options.fence_key)
        for suffix in _AUXILIARY:
            pipe.pttl(f"{base}:{suffix}")
        for key in _permits(options, limit):
            pipe.get(key)
            pipe.pttl(key)
        replies = await pipe.execute()
    value, last = replies[0], replies[1]
    start = 2 + len(_AUXILIARY)
    retention = {
        suffix: _seconds(int(pttl))
        for suffix, pttl in zip(_AUXILIARY, replies[2:start], strict=True)
        if int(pttl) != -2  # (-2: no such key)
    }
    permits = [(replies[i], int(replies[i + 1])) for i in range(start, len(replies), 2)]
    held_permits = [(v, p) for v, p in permits if v is not None]
    holder, fencing_token = _exclusive_holder(value)
    time_left = stats.time_left
    if held_permits:
        fencing_token, time_left = _permit_holders(held_permits)
    kind = _kind(stats)
    return LockInfo(
        name=name,
        held=kind != "free",
        kind=kind,
        fencing_token=fencing_token,
        acquired_at=_wall(fencing_token),
        holder=holder,
        time_left=time_left if kind != "free" else None,
        waiters=stats.waiting_clients + stats.queued,
        shared_holders=stats.shared_holders,
        permits_in_use=stats.permits_in_use,
        limit=stats.limit,
        fence_retention=retention.get("fence"),  # (one PTTL read: the two agree)
        last_fencing_token=int(reply_text(last)) if last is not None else None,
        retention=retention,
    )


def _exclusive_holder(value: object) -> tuple[str | None, int | None]:
    """The holder (its token's first 8 hex digits) and fencing token that the lock's key
    holds, ``<token>:<fencing token>[:...]``; (None, None) for none (or ``shared``)."""
    if value is None:
        return None, None
    text = reply_text(value)
    if text == "shared" or text.startswith("shared:"):  # (shared holders: see SHARED_ACQUIRE)
        return None, None
    token, _, rest = text.partition(":")
    fence = rest.partition(":")[0]
    return token[:8], int(fence) if fence.isdigit() else None


def _permit_holders(held: list[tuple[object, int]]) -> tuple[int | None, float | None]:
    """The highest fencing token of the permits ``held`` (value, pttl in ms), and the
    seconds left of the one that expires first (None: none expires)."""
    tokens = [reply_text(value).split(":")[1] for value, _ in held]
    fencing_token = max((int(t) for t in tokens if t.isdigit()), default=None)
    live = [pttl for _, pttl in held if pttl >= 0]
    return fencing_token, min(live) / 1000 if live else None


def _kind(stats: LockStatistics) -> str:
    """``mutex``, ``shared``, ``semaphore`` or ``free``, by what holds the lock now."""
    if stats.exclusive:
        return "mutex"
    if stats.shared_holders:
        return "shared"
    return "semaphore" if stats.permits_in_use else "free"


# The suffixes of a lock's auxiliary keys after ``<prefix>{name}:`` (``once``'s result
# key too: the lease key of a mutex is the base key).
_AUXILIARY = (
    "fence",
    "waiting",
    "queue",
    "queue:alive",
    "readers",
    "limit",
    "permits",
    "result",
)


def _permits(options: LeaseOptions, limit: int) -> list[str]:
    base = options.base_key
    return [f"{base}:permit:{slot}" for slot in range(limit)]


async def list_locks(
    redis: Client,
    pattern: str = "*",
    *,
    prefix: str = "asynclock:",
    time_limit: float = 5.0,
    held_only: bool = True,
) -> tuple[list[LockInfo], bool]:
    """The locks whose names match the glob ``pattern``, found by ``SCAN`` (never
    ``KEYS``) on the server, or on every primary of a cluster, within ``time_limit``
    seconds. Returns (their :class:`LockInfo`, sorted by name; whether the scan was
    complete). ``held_only``: leave out locks nothing holds (their fencing counter or
    waiting keys alone remain).
    """
    if not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")
    deadline = time.monotonic() + time_limit
    nodes = await primary_clients(redis) if is_cluster(redis) else [redis]
    names: set[str] = set()
    complete = True
    match = f"{_glob_escape(prefix)}{{{pattern}}}*"
    for node in nodes:
        cursor: int | None = None
        while cursor != 0:
            if time.monotonic() >= deadline:
                complete = False
                break
            cursor, keys = await node.scan(cursor or 0, match=match, count=500)
            for key in keys:
                found = _name_of(reply_text(key), prefix)
                if found is not None:
                    names.add(found)
    infos = []
    for found in sorted(names):
        if time.monotonic() >= deadline:
            complete = False
            break
        info = await inspect(redis, found, prefix=prefix)
        if info.held or not held_only:
            infos.append(info)
    return infos, complete


def _name_of(key: str, prefix: str) -> str | None:
    """The lock name of one of its keys (``<prefix>{name}`` plus a suffix), or None."""
    if not key.startswith(prefix + "{"):
        return None
    rest = key[len(prefix) + 1 :]
    end = rest.find("}")
    if end <= 0:
        return None
    return rest[:end]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


async def force_release(
    redis: Client,
    name: str,
    *,
    prefix: str = "asynclock:",
    fencing_token: int | None = None,
) -> int | None:
    """Release the lock ``name`` by hand, whoever holds it: delete its holders' keys
    (never its fencing counter) and wake its waiters. The holders lose their leases at
    their next renewal (``LockLost(not_owner)``). Returns how many keys were deleted.

    With ``fencing_token`` (the holder's, as :func:`inspect` showed it), only that
    holder is released: if the lock's key holds another token by then (the holder
    released it and another took it), nothing is deleted and None is returned. The
    check and the deletion are one step in Redis.
    """
    redis = redis_api(redis)
    info = await statistics(redis, name, prefix=prefix)
    options = LeaseOptions.cached(redis, name, {"prefix": prefix})
    node = await node_client(redis, options.base_key) if is_cluster(redis) else redis
    keys = [options.key, options.readers_key]
    keys += _permits(options, info.limit or 0)
    keys.append(options.permits_key)  # (with every permit: slots are taken from 0 again)
    readers = await node.zrange(options.readers_key, 0, -1)
    # (and the keys of readers left by a version that gave each its own key)
    keys += [f"{options.key}:reader:{reply_text(r).partition(':')[0]}" for r in readers]
    expected = "" if fencing_token is None else str(fencing_token)
    # (a cluster node's client runs the script's sharded twin: SPUBLISH, see Script)
    args = [expected, options.channel, "asynclock-cli"]
    deleted = int(cast(int, await _FORCE_RELEASE(node, keys, args)))
    return None if deleted < 0 else deleted


# KEYS: the lock's key first, then its other holder keys; ARGV: the fencing token the
# key must hold ('' for any), the channel, the message.
_FORCE_RELEASE: Final = Script(
    "force_release",
    """
if ARGV[1] ~= '' then
  local value = redis.call('GET', KEYS[1])
  if not value or string.sub(value, 1, 6) == 'shared'
      or string.match(value, '^[^:]*:(%d+)') ~= ARGV[1] then
    return -1
  end
end
local deleted = redis.call('DEL', unpack(KEYS))
redis.call('PUBLISH', ARGV[2], ARGV[3])
return deleted
""",
)
