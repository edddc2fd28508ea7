"""The Lua scripts that make every lease operation one atomic round trip.

Layout of one lock named ``N`` under prefix ``P`` (all keys share the hash tag ``{N}`` so
they live in one Redis Cluster slot)::

    P{N}                 the lease; value "<token>:<fencing token>", PX = ttl
    P{N}:fence           the last fencing token minted; PX = fence_ttl (max(10 x ttl, 60 s))
    P{N}:void:<token>    tombstone of an abandoned acquire attempt; PX = max(3 x ttl, 10 s)
    P{N}:waiting         hash: origin id of a client with waiters -> "<since>:<until>"
                         (server ms), then ":<token>:<loop time>:<ttl ms>:<at ms>"
                         when the client offers its first waiter's token for a grant
                         (made at <at ms>); written by blocking waits, read by HANDOFF
    P{N}:permit:<i>      permit i of a semaphore (lease(..., limit=L), 0 <= i < L): a
                         lease key as P{N} is (its attempt's void key holds "p<i>")
    P{N}:permits         a semaphore's index: slot -> server ms its permit expires at
    P{N}:limit           the limit a semaphore's permits are held with (kept while they are)
    P{N}:readers         shared leases' holders (lease(..., shared=True)) while more
                         than one holds: sorted set, member "<token>:<fencing token>"
                         -> server ms until which it lives; PX = its longest member's,
                         and P{N} holds the marker "shared" with the same expiry (a
                         reader alone holds P{N} itself: "shared:<token>:<fencing
                         token>", PX = ttl)
    P{N}:released        pub/sub channel; release publishes on it to wake waiters
                         (the releaser's origin id)
    P{N}:released:<id>   pub/sub channel of the client with origin id <id>: a grant
                         of the lock to one of its waiters is published on it

The value carries the fencing token so that an acquire retried after a lost reply can
answer with the same token it minted the first time. Every owner check compares the
``<token>:`` prefix (the token is 32 hex digits, so no other holder's value can match).

Scripts run with EVALSHA and fall back to EVAL on NOSCRIPT: a restarted or failed-over
server has an empty script cache, which is not a lost lease.

Each script's header (its KEYS, ARGV and replies) is the comment above its definition;
rules that several scripts follow (the server's time, minting a fencing token, the
fencing token in a lease's value, a registration as waiting, a permit's expiry, a
reader's way out) are Lua fragments written once and spliced into their sources. The
scripts are kept to the commands an uncontended cycle needs (server µs per cycle:
``benchmarks/server.py``): a mutex cycle runs 7 commands in its 2 scripts (MGET, TIME,
SET ... GET of the counter, SET ... GET of the lease; GET, DEL, PUBLISH), and an
uncontended ACQUIRE returns before the code of its registration as waiting runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar, cast

from redis.asyncio import Redis
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoScriptError,
    OutOfMemoryError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._base._shield import cancel_dropped, cancelling
from ._cluster import is_sharded
from ._lane import Lane, encoding_of, exchange, mark_not_sent, reply_text
from ._refusals import explain, is_refusal

__all__ = [
    "ABANDON",
    "ACQUIRE",
    "ACQUIRE_JOB",
    "ASKING",
    "FAIR_ACQUIRE",
    "FAIR_LEAVE",
    "HANDOFF",
    "IS_OURS",
    "PERMIT_RELEASE",
    "PERMIT_RENEW",
    "PERMIT_RENEW_HEAD",
    "RELEASE",
    "RENEW",
    "RENEW_HEAD",
    "SEAL",
    "SEMAPHORE_ABANDON",
    "SEMAPHORE_ACQUIRE",
    "SET_IF_EQUAL_HEAD",
    "SHARED_ABANDON",
    "SHARED_ACQUIRE",
    "SHARED_IS_OURS",
    "SHARED_RELEASE",
    "SHARED_RENEW",
    "SHARED_RENEW_HEAD",
    "STATISTICS",
    "STORE",
    "UNKNOWN_OUTCOME",
    "Arg",
    "Script",
    "has_set_if_equal",
    "pack",
    "pack_args",
    "persisting",
    "refused_as_command",
    "renewed",
    "run_idempotent",
    "unpack_arg",
]

log = logging.getLogger("asynclock")

T = TypeVar("T")

Arg = str | int | float | bytes

_pack_command: Callable[[tuple[Arg, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # (redis-py without its hiredis extra)
    _pack_command = None
else:
    _pack_command = cast(Callable[[tuple[Arg, ...]], bytes], _hiredis_pack)

_UNAUTHENTICATED: Final = "Protocol error: unauthenticated"

UNKNOWN_OUTCOME = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)
"""Errors after which a command's outcome is unknown: it may or may not have run."""

_REFUSED_FOR_GOOD: Final = (AuthenticationError, AuthorizationError)
"""Connection errors (by redis-py's classes) that another try would get again."""
_PERSIST_PAUSE: Final = 0.05
"""Seconds before ``persisting`` makes its call again the first time."""
_PERSIST_PAUSE_MAX: Final = 0.4
"""The longest pause (seconds) between its tries."""
_PERSIST_TRY_FLOOR: Final = 0.25
"""The least time (seconds) each of its tries is given: half the time left, or this."""


def pack(args: Sequence[Arg], encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """One command in RESP, its arguments encoded as redis-py would encode them."""
    if _pack_command is not None and encoding == "utf-8" and errors == "strict":
        # hiredis packs in C what the loop below does in Python, byte for byte (text as
        # strict UTF-8, numbers as str() writes them): packing was about a quarter of a
        # lease's pure-Python time per cycle. It takes a tuple of str, int, float and
        # bytes only; anything else goes the Python way. (try, not contextlib.suppress:
        # that builds a context manager per command.)
        try:
            return _pack_command(tuple(args))  # (a tuple is passed through as it is)
        except TypeError:
            pass
    return b"".join(_packed([b"*%d\r\n" % len(args)], args, encoding, errors))


def pack_args(args: Sequence[Arg], encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """Arguments of a command in RESP, without the header that counts them."""
    return b"".join(_packed([], args, encoding, errors))


def _packed(parts: list[bytes], args: Sequence[Arg], encoding: str, errors: str) -> list[bytes]:
    """``parts`` with each argument appended in RESP (one join per command, on the hot
    path of every acquire and release)."""
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode(encoding, errors)
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return parts


def unpack_arg(packed: bytes, index: int) -> bytes:
    """Argument ``index`` (from 0) of arguments packed by :func:`pack_args`."""
    start = 0
    while True:
        end = packed.index(b"\r\n", start)
        size = int(packed[start + 1 : end])
        if index == 0:
            return packed[end + 2 : end + 2 + size]
        start, index = end + 2 + size + 2, index - 1


_PUBLISH: Final = "redis.call('PUBLISH', "
_SPUBLISH: Final = "redis.call('SPUBLISH', "


class Script:
    """A Lua script run by SHA1 with a transparent fallback to its source on NOSCRIPT."""

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.sharded = self
        """The script run through a client of a cluster node: its twin that publishes
        with ``SPUBLISH`` (to the subscribers of the lock's slot only), if it publishes."""
        if _PUBLISH in source:
            self.sharded = Script(f"{name} (sharded)", source.replace(_PUBLISH, _SPUBLISH))

    async def __call__(
        self,
        target: Redis | Lane,
        keys: Sequence[str],
        args: Sequence[Arg],
        deadline: float | None = None,
        *,
        asking: bool = False,
    ) -> object:
        """Run the script on a client or a client's lane (one round trip, two after a
        NOSCRIPT). Every exchange ends by ``deadline`` (loop time), if given. ``asking``:
        send ``ASKING`` before it (on a cluster node importing the lock's slot).

        Raises the server's error reply (``ResponseError`` and its subclasses; a refusal
        by the ACL as a ``NoPermissionError`` that names the missing rule), or the
        connection error, timeout or cancellation that interrupted the exchange.
        """
        # (a lane looked its client's encoding up once: the hot path)
        if isinstance(target, Lane):
            encoding, sharded = target.encoding, target.sharded
        else:
            encoding, sharded = encoding_of(target), is_sharded(target)
        script = self.sharded if sharded else self
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        reply = await _send(target, pack(command, *encoding), deadline, asking)
        if isinstance(reply, NoScriptError):
            command = ("EVAL", script.source, len(keys), *keys, *args)
            reply = await _send(target, pack(command, *encoding), deadline, asking)
        if isinstance(reply, BaseException):
            if isinstance(reply, ResponseError) and str(reply).startswith(_UNAUTHENTICATED):
                # (the server refuses a long command before AUTH, and says only this)
                error = AuthenticationError(f"Authentication required (the server said: {reply})")
                mark_not_sent(error)
                raise error from reply
            if is_refusal(reply):  # (by the ACL: the error names the missing rule)
                raise explain(reply, f"asynclock's {script.name} script", script.source)
            raise reply
        return reply


async def _send(
    target: Redis | Lane, packed: bytes, deadline: float | None, asking: bool = False
) -> object:
    if asking:  # (ASKING's own reply is OK: the script's is the last)
        packed = ASKING + packed
    count = 2 if asking else 1
    # (isinstance against Redis is slow: redis-py's client classes derive from a Protocol)
    if isinstance(target, Lane):
        reply = await target.call(packed, deadline, count)
        return cast(list[object], reply)[-1] if asking else reply
    async with asyncio.timeout_at(deadline):  # (None: no limit)
        replies = await exchange(target, packed, count)
    return replies[-1]


ASKING: Final = pack(("ASKING",), "utf-8", "strict")
"""``ASKING`` in RESP: the next command may touch a key of a slot the node imports."""


async def run_idempotent(
    script: Script,
    client: Redis | Lane,
    fallback: Callable[[], Redis],
    keys: Sequence[str],
    args: Sequence[Arg],
    *,
    until: float | None = None,
) -> object:
    """Run an idempotent script on ``client``, or else once more on ``fallback()``; with
    ``until`` (loop time), again and again on ``fallback()`` until Redis answers or
    ``until`` passes (see ``persisting``).

    The caller's pool may be exhausted (redis-py 8 raises at once) or hand out a
    connection the server has closed; the fallback is asynclock's own pool.

    Raises:
        ResponseError: Redis refused the script (never tried again).
        Exception: one of ``UNKNOWN_OUTCOME`` when the last run failed too (with
            ``until``, ``TimeoutError`` once it passed).
    """
    try:
        return await script(client, keys, args)
    except UNKNOWN_OUTCOME as exc:
        log.debug("%s failed on the caller's client (%r), retrying", script.name, exc)
    if until is None:
        return await script(fallback(), keys, args)
    return await persisting(lambda: script(fallback(), keys, args), script.name, until)


async def persisting(call: Callable[[], Awaitable[T]], what: str, until: float) -> T:
    """``call()``, made again after a pause (50 ms, doubling up to ``_PERSIST_PAUSE_MAX``)
    for as long as its outcome is unknown (one of ``UNKNOWN_OUTCOME``, or no answer
    within half the time left, at least ``_PERSIST_TRY_FLOOR``) and loop time ``until``
    has not come: for an idempotent cleanup that others wait on (a release, the
    undoing of an abandoned acquire), which a blip of the network (connections reset and
    refused for a moment, a server restarting) must not leave undone. ``what`` names the
    call in debug logs.

    Raises:
        TimeoutError: ``until`` came with the outcome still unknown (the caller bounds a
            call in flight itself).
        asyncio.CancelledError: the task was cancelled while a call was in flight, and
            the call turned the cancellation into a connection error (see
            ``_shield.cancel_dropped``).
        Exception: an error reply (``ResponseError``) or a refused password or command
            (``AuthenticationError``, ``AuthorizationError``), at once: another try
            would get the same.
    """
    loop = asyncio.get_running_loop()
    before = cancelling()
    pause = _PERSIST_PAUSE
    while True:
        try:
            # (each try within half the time left: one that hangs silently, as a connect
            # can after a reset on some Pythons, does not take the whole bound)
            async with asyncio.timeout(max(_PERSIST_TRY_FLOOR, (until - loop.time()) / 2)):
                return await call()
        except _REFUSED_FOR_GOOD:
            raise
        except UNKNOWN_OUTCOME as exc:
            if cancel_dropped(before):
                raise asyncio.CancelledError from exc
            left = until - loop.time()
            if left <= 0:
                raise TimeoutError(f"{what}: Redis did not answer in time") from exc
            log.debug("%s failed (%r), trying again in %.2fs", what, exc, pause)
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, _PERSIST_PAUSE_MAX)


# -- Lua fragments ------------------------------------------------------------------------
# Each rule that several scripts follow is written once here and spliced into their
# source (text, not Lua functions: a function is a closure made at every run). A
# script's header (its KEYS, ARGV and replies) is the comment above its definition.

# `t` the server's TIME reply, `now` the server's time in ms (_NOW_MS: from `t`).
_NOW_MS = "tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"
_NOW = f"""local t = redis.call('TIME')
local now = {_NOW_MS}
"""


def _mint_fence(last: str, again: str = "") -> str:
    """Lua: the next fencing token, max(last + 1, server TIME in microseconds), into
    ``fence`` (declared by the script) as a decimal string, from the TIME reply ``t`` and
    the last token, which the Lua expression ``last`` reads from the counter at KEYS[2];
    ``again`` runs in the rare case that the clock gave no more than the last token.

    The token is made from TIME's own digits (seconds, then microseconds padded to 6),
    and the last token, a decimal the scripts wrote, is compared with it as text first:
    a shorter one, or one as long and smaller, is below it. Only a last token not below
    is read as a number (``tonumber`` is ``strtod``: three of them cost as much as a
    ``redis.call``), and ``string.format`` then writes the next. A script that returns
    the token alone returns this string; in a table, ``tonumber(fence)``, an integer."""
    return f"""fence = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
local last = {last}
if last and #last >= #fence and (#last > #fence or last >= fence) then
  local number = tonumber(last)
  if number and number >= tonumber(fence) then
    fence = string.format('%d', number + 1)
{again}  end
end
"""


# The next fencing token, the counter only read.
_MINT_FENCE = _mint_fence("redis.call('GET', KEYS[2])")

# The same, written to the counter (PX ARGV[3]) by the command that reads the last one
# (SET ... GET); written again in the rare case that the clock gave no more than the last.
_MINT_AND_STORE_FENCE = _mint_fence(
    "redis.call('SET', KEYS[2], fence, 'PX', ARGV[3], 'GET')",
    "    redis.call('SET', KEYS[2], fence, 'PX', ARGV[3])\n",
)

# The fencing token in a lease's value `current` ("<token>:<fencing token>[:...]").
_FENCE_OF = "tonumber(string.match(current, '^[^:]*:(%d+)'))"


def _held(token: str = "ARGV[1]") -> str:
    """Lua: whether the value ``current`` is a lease's of ``token`` (the owner check by
    the ``<token>:`` prefix: a token is 32 hex digits, no other holder's value matches)."""
    return f"(current and string.sub(current, 1, #{token} + 1) == {token} .. ':')"


def _set_new(value: str, ttl: str) -> str:
    """Lua: the command that writes the lease's key KEYS[1], which the script found absent,
    with ``value`` for ``ttl`` ms. With ``GET``: the reply is then the absent key's nil,
    where a plain ``SET``'s status reply is a table Lua makes and collects (0.6k to 1k
    instructions of the server's per acquisition)."""
    return f"redis.call('SET', KEYS[1], {value}, 'PX', {ttl}, 'GET')\n"


def _register(origin: str, life: str) -> str:
    """Lua: ``register(since, now, offer)``, which writes the entry of the client
    ``origin`` in the waiting hash KEYS[4] (see HANDOFF): waiting since ``since``, until
    ``now`` + ``life`` ms, followed by ``offer`` ('' or ':<token>:<loop time>:<ttl
    ms>:<at ms>'); the hash's expiry is only ever extended. Under maxmemory its writes
    are skipped (pcall), not fatal."""
    return f"""local function register(since, now, offer)
  redis.pcall('HSET', KEYS[4], {origin}, string.format('%d:%d', since, now + {life}) .. offer)
  if redis.call('PTTL', KEYS[4]) < tonumber({life}) then
    redis.pcall('PEXPIRE', KEYS[4], {life})
  end
end
"""


def _no_permits(index: str, stem: str, forget: str) -> str:
    """Lua: return {-2, ``held_with``} while a permit of a semaphore held with the limit
    ``held_with`` (a Lua variable, as the script read it) may be held (a slot's score in
    its index ``index`` not passed, or, the index lost, a permit key ``stem`` .. slot
    left); else delete ``forget`` (keys: the semaphore's left-overs) and go on. Runs only
    when the semaphore's limit key exists and is not the caller's: one name, one limit
    (its ``EXISTS`` names up to 1,000 keys, once per change)."""
    return f"""do
  local t = redis.call('TIME')
  if redis.call('ZCOUNT', {index}, {_NOW_MS}, '+inf') > 0 then
    return {{-2, held_with}}
  end
  local permits = {{}}
  for slot = 0, math.min(tonumber(held_with) or 1000, 1000) - 1 do
    permits[slot + 1] = {stem} .. slot
  end
  if #permits > 0 and redis.call('EXISTS', unpack(permits)) > 0 then
    return {{-2, held_with}}
  end
  redis.call('DEL', {forget})
end
"""


# A semaphore's limit key, its index and the stem of its permit keys, named from the lock's
# key KEYS[1] by the scripts of the kinds of limit 1 (``LeaseOptions.limit_key``,
# ``permits_key``, ``permit``: the same names; the lock's hash tag, so the same Cluster
# slot), which refuse the lock while permits are held (see _no_permits).
_LIMIT_KEY = "KEYS[1] .. ':limit'"
_PERMITS_OF_LOCK = _no_permits(
    "KEYS[1] .. ':permits'", "KEYS[1] .. ':permit:'", f"{_LIMIT_KEY}, KEYS[1] .. ':permits'"
)

# The start of an acquire of the lock's key KEYS[1] (ACQUIRE, SHARED_ACQUIRE, FAIR_ACQUIRE):
# one MGET reads this attempt's tombstone KEYS[3] (there: the attempt was abandoned), the
# lock's key and a semaphore's limit into `found`.
_FOUND = f"""local found = redis.call('MGET', KEYS[3], KEYS[1], {_LIMIT_KEY})  -- (the tombstone,
if found[1] then  -- the lease, a semaphore's limit)
  return {{-1, 0}}
end
"""


# -- the plain lock (mutex) ---------------------------------------------------------------
# ACQUIRE: KEYS[1] lease key, KEYS[2] fence counter, KEYS[3] this attempt's tombstone,
# KEYS[4] the lock's waiting hash (see HANDOFF)
# ARGV[1] token, ARGV[2] lease ttl (ms), ARGV[3] fence counter ttl (ms), ARGV[4] origin id
# of a blocking wait ('' when not waiting): a failed attempt registers it as waiting
# (since when: kept from a live registration, else now), ARGV[5] for how long (ms),
# ARGV[6] what a success does to the registration: 'keep' (more waiters of ours are in
# line: they wait from now on), 'drop' (none: unregister), 'withdraw' (an attempt of a
# waiter in our line: withdraw an offer of its token, if any) or '' (nothing: the token
# was never offered), ARGV[7] the sender's loop time at sending, when the attempt is made
# by the head of its client's line, listening for grants ('' otherwise): a failed attempt
# then also registers ARGV[1], ARGV[2] and ARGV[7], so that another client's releaser may
# grant the lock to this token (HANDOFF); the sender counts a granted lease from ARGV[7],
# which precedes the grant. Otherwise an offer of another token of ours (the head's) stays.
# Returns the fencing token alone when held by this token (new: its decimal string, or a
#           retry of ours: an integer; a reply that is not a table, which saves the
#           server about 0.4 µs),
#         {0, pttl of the holder in ms (-1: no expiry)} when someone else holds it,
#         {-1, 0} when this attempt was abandoned (its tombstone exists),
#         {-2, their limit} when the lock is free but permits of a semaphore of the name
#           may be held (one name, one limit: see _no_permits).
# An attempt outside a blocking wait may send KEYS[1..3] and ARGV[1..3] only (ARGV[4] and
# ARGV[6] absent count as ''). An uncontended success (ARGV[6] '') reads, mints and
# writes, and returns before any of the registration's bookkeeping is even defined.
def _acquire(prologue: str = "", current: str = "", fenced: str = "fence") -> str:
    """ACQUIRE's source; ACQUIRE_JOB's with its Lua ``prologue`` (after the tombstone's
    check), ``current`` (after the lock's key is read into ``current``) and ``fenced``
    (what a success returns, its fencing token in ``fence``)."""
    return (
        _FOUND
        + prologue
        + """local current, held_with = found[2], found[3]
local suffix = ''
"""
        + current
        + f"""local fence
if not current then
  if held_with then
{_PERMITS_OF_LOCK}  end
  local t = redis.call('TIME')
"""
        + _MINT_AND_STORE_FENCE
        + _set_new("ARGV[1] .. ':' .. fence .. suffix", "ARGV[2]")
        + f"""elseif {_held()} then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  fence = {_FENCE_OF}
elseif (ARGV[4] or '') == '' then
  return {{0, redis.call('PTTL', KEYS[1])}}
end
if fence and (ARGV[6] or '') == '' then
  return {fenced}
end
"""
        + _register("ARGV[4]", "ARGV[5]")
        + """local function kept(old)  -- an offer of another token of ours (our line's head)
  local offer = old and string.match(old, '^%d+:%d+(:.*)$')
  if offer and not string.find(offer, ':' .. ARGV[1] .. ':', 1, true) then
    return offer
  end
  return ''
end
if fence then
  if ARGV[6] == 'keep' then
"""
        + _NOW
        + f"""    register(now, now, kept(redis.call('HGET', KEYS[4], ARGV[4])))
  elseif ARGV[6] == 'drop' then
    redis.call('HDEL', KEYS[4], ARGV[4])
  else  -- (withdraw: no longer offer this token to other clients' releasers)
    local entry = redis.call('HGET', KEYS[4], ARGV[4])
    if entry and string.find(entry, ':' .. ARGV[1] .. ':', 1, true) then
      redis.call('HDEL', KEYS[4], ARGV[4])
    end
  end
  return {fenced}
end
"""
        + _NOW
        + """local entry = redis.call('HGET', KEYS[4], ARGV[4])
local s, u = string.match(entry or '', '^(%d+):(%d+)')
local since = (s and tonumber(u) > now) and tonumber(s) or now
if ARGV[7] ~= '' then
  register(since, now, ':' .. ARGV[1] .. ':' .. ARGV[7] .. ':' .. ARGV[2] .. ':' .. now)
else
  register(since, now, kept(entry))
end
return {0, redis.call('PTTL', KEYS[1])}
"""
    )


ACQUIRE = Script("acquire", _acquire())

# ACQUIRE_JOB: ACQUIRE for a job of once(); KEYS[5] its result hash {v: payload, f:
# fingerprint}, or {e: why the result was not stored, f} for a job that ran without it,
# ARGV[8] the caller's fingerprint digest ('' checks nothing), kept in the lease's value
# as '<token>:<fence>:<digest>' while the job runs. Returns also {2, payload} when a
# result is stored, {4, why} when the job ran but its result could not be stored, {3, the
# other digest} for a fingerprint that is not the caller's, and {5, fencing token} instead
# of the fencing token alone when the key, held by this token, holds no digest (a releaser
# handed or granted it: its value is '<token>:<fence>', which the lease must renew and
# release as it is).
ACQUIRE_JOB = Script(
    "acquire_job",
    _acquire(
        prologue="""local stored = redis.call('HMGET', KEYS[5], 'v', 'f', 'e')
if stored[1] or stored[3] then
  if ARGV[8] ~= '' and stored[2] and stored[2] ~= ARGV[8] then
    return {3, stored[2]}
  end
  if stored[1] then
    return {2, stored[1]}
  end
  return {4, stored[3]}
end
""",
        current=f"""local bare = false  -- (ours, but handed over: no digest in the key)
if ARGV[8] ~= '' then
  suffix = ':' .. ARGV[8]
  local running = current and string.match(current, '^[^:]*:%d+:(.+)$')
  if running and running ~= ARGV[8] then
    return {{3, running}}
  end
  bare = not running and {_held()}
end
""",
        fenced="bare and {5, tonumber(fence)} or fence",
    ),
)

# STORE: the end of a successful job of once(): store its result and release the lease
# in one owner-checked step (a holder that lost its lease stores nothing).
# KEYS[1] lease key, KEYS[2] result hash; ARGV[1] the lease's full value, ARGV[2] the
# payload (or why it could not be stored), ARGV[3] the result's ttl (ms), ARGV[4] the
# fingerprint digest ('' none), ARGV[5] the field ARGV[2] goes to ('v' a payload, 'e' the
# marker of a job whose result could not be stored), ARGV[6] the release channel,
# ARGV[7] the releasing client's origin id.
# Returns 1 when stored (the lease deleted, waiters notified), 0 when not ours.
STORE = Script(
    "store",
    """if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[2])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[5], ARGV[2], 'f', ARGV[4])
else
  redis.call('HSET', KEYS[2], ARGV[5], ARGV[2])
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[6], ARGV[7])
return 1
""",
)

# IS_OURS: KEYS[1] lease key; ARGV[1] the lease's full value. Returns 1 when the key holds
# it, else 0 (``is_held(verify=True)``; nothing written). Compared in Redis: whatever bytes
# the key holds, the reply is an integer, which a client of any decode mode reads.
IS_OURS = Script("is_ours", "if redis.call('GET', KEYS[1]) == ARGV[1] then return 1 end return 0")

# RENEW: KEYS[1] lease key; ARGV[1] the lease's full value, ARGV[2] ttl (ms).
# Returns 1 when the key still holds our value (its TTL is now exactly ttl), else 0.
RENEW = Script(
    "renew",
    """if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
""",
)

RENEW_HEAD: Final = b"*6\r\n" + pack_args(("EVALSHA", RENEW.sha, 1))
"""The start of a packed RENEW command; the lease's key, value and ttl (ms) follow."""

SET_IF_EQUAL_HEAD: Final = b"*7\r\n" + pack_args(("SET",))
"""The start of RENEW as one command, where the server has it (Valkey >= 8.1): ``SET key
value IFEQ value PX ttl`` sets the value it compares equal (so, the same) with the new
expiry, and neither when the key is gone or holds another value. About a quarter of the
script's server time (1.4 against 5.6 µs on Valkey 9.1: benchmarks/history.md)."""

_RENEWED: Final = frozenset((1, b"OK", "OK"))
_SET_IF_EQUAL_SINCE: Final = {"valkey": (8, 1)}  # (server, first version with SET ... IFEQ)


async def has_set_if_equal(client: Redis) -> bool | None:
    """Whether the server ``client`` talks to has ``SET ... IFEQ`` (by the name and
    version its ``HELLO`` gives; within 2 s). False when it does not say, or refuses:
    renewals then go by script, as on every server before; None when it did not answer
    (a connection error, the time limit, the caller's pool exhausted)."""
    try:
        async with asyncio.timeout(2.0):
            (reply,) = await exchange(client, pack(("HELLO",), *encoding_of(client)), 1)
    except Exception as exc:  # (a background task's: nothing may go unretrieved)
        log.debug("could not ask the server its name: %r", exc)
        return None
    if isinstance(reply, list):  # (RESP2: name, value, ...)
        reply = dict(zip(reply[::2], reply[1::2], strict=True))
    if not isinstance(reply, dict):
        return False
    said = {reply_text(name): reply_text(value) for name, value in reply.items()}
    since = _SET_IF_EQUAL_SINCE.get(said.get("server", ""))
    version = tuple(int(part) for part in said.get("version", "").split(".")[:2] if part.isdigit())
    return since is not None and version >= since


def renewed(reply: object) -> bool:
    """Whether a renewal's reply says renewed: a renew script's 1, ``SET ... IFEQ``'s OK
    (its nil, or a script's 0: the key is not ours)."""
    return isinstance(reply, int | bytes | str) and reply in _RENEWED


def refused_as_command(reply: object) -> bool:
    """Whether ``reply`` to a ``SET ... IFEQ`` renewal says that the server will not take
    the renewal as that command, where RENEW would do: ``maxmemory`` reached under
    ``noeviction`` (``SET`` is refused, the script's ``PEXPIRE`` is not), an ACL without
    ``+set``, or a server that does not know ``IFEQ`` (a syntax error: after a failover
    to an older one, say). Anything else (a redirection, READONLY, LOADING, NOREPLICAS,
    WRONGTYPE...) says the same to the script. By class or by text: a valkey-py client's
    errors are classes of their own, deriving from redis-py's (``_valkey``)."""
    if not isinstance(reply, ResponseError):
        return False
    if isinstance(reply, OutOfMemoryError) or is_refusal(reply):
        return True
    return str(reply).removeprefix("ERR ").startswith("syntax error")


# RELEASE: KEYS[1] lease key; ARGV[1] the lease's full value, ARGV[2] the release channel,
# ARGV[3] the releasing client's origin id (published, so that client can ignore its own
# notification), ARGV[4] (optional, hold_at_least) ms to keep the key for, instead of
# deleting it. Returns 1 when our key was deleted or kept (and waiters notified), 0 when
# not ours.
RELEASE = Script(
    "release",
    """if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[4] then
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
  else
    redis.call('DEL', KEYS[1])
  end
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
return 0
""",
)

# HANDOFF: the release of a lock that has a waiter in the releasing client's own line.
# The key goes straight to that waiter's token (with a new fencing token) in the same
# round trip, unless a waiter of another client has been registered for at least the
# patience (ms). Then the longest registered of those is served instead: if its client
# offers a token (see ACQUIRE's ARGV[7]), the key goes to that token and the grant is
# published for its client to pick up, on that client's grant channel for the lock
# ("<release channel>:<its origin id>": no other client reads it); else it is a plain
# release that lets every client's waiters compete (and the releasing client's own head
# stands back, see WaitingRoom.wake_with_others).
# KEYS[1] lease key, KEYS[2] fence counter, KEYS[3] the next holder's tombstone, KEYS[4]
# the lock's waiting hash: origin id -> "<since ms>:<until ms>" (server time), followed by
# ":<token>:<loop time>:<ttl ms>:<at ms>" when that client offers a token (made at <at
# ms>, server time), KEYS[5] the tombstone of the waiter behind the next holder
# ARGV[1] our full value, ARGV[2] the next holder's token, ARGV[3] its ttl (ms), ARGV[4]
# fence counter ttl (ms), ARGV[5] the release channel, ARGV[6] our origin id, ARGV[7]
# 'keep' if our line still has waiters behind the next holder, else 'drop', ARGV[8]
# registration lifetime (ms), ARGV[9] patience (ms), ARGV[10] our loop time at sending,
# ARGV[11] the token of the waiter behind the next holder ('' if none) and ARGV[12] its
# ttl (ms): our registration offers the next holder's token when the key does not go to
# it, else ARGV[11] (neither if its tombstone exists: it gave up), ARGV[13] how old (ms)
# an offer may be to be granted, at most (and never more than a third of the offered
# TTL): an older one gets a plain release instead, which wakes its waiter to try (and
# offer anew). A waiter that died leaves an offer behind; this bounds how long after its
# last attempt a grant can still give it the key. ARGV[14] '1' if our client listens for
# grants (WaitingRoom.listening), else '': then our registration offers no token (a grant
# it missed would idle the lock).
# An offered token is never tombstoned: ABANDON withdraws the offer when it writes the
# tombstone, and ACQUIRE and this script offer no tombstoned token, so a grant needs no
# look at the granted token's tombstone (a key this script was not given).
# Returns {1, fencing token} when the key now belongs to the next token,
#         {3, fencing token} when it already did (the next holder took it by an attempt of
#           its own, or this is a retry after our handoff landed); its expiry is renewed,
#           so the caller's send time is a valid start for the next holder,
#         {5, fencing token} when granted to another client's waiter (published on
#           "<ARGV[5]>:<its origin>" as
#           "<our origin>:<its origin>:<token>:<fencing token>:<its loop time>"),
#         {2, 0} when released as RELEASE does because another client's waiter is due,
#         {4, 0} when released as RELEASE does because the next holder gave up,
#         {0, 0} when the key was not ours.
# Every branch writes first with a command that maxmemory never refuses (DEL, HDEL or
# PEXPIRE), so that under noeviction the writes after it are not refused either: Redis
# lets a script that has already written go on writing. (Script flags would end this.)
HANDOFF = Script(
    "handoff",
    f"""local current = redis.call('GET', KEYS[1])
if {_held("ARGV[2]")} then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {{3, {_FENCE_OF}}}
end
if current ~= ARGV[1] then
  return {{0, 0}}
end
"""
    + _NOW
    + _register("ARGV[6]", "ARGV[8]")
    + """local function offer(token, ttl)  -- our line's offer of `token` ('' offers none)
  if token == '' then
    return ''
  end
  return ':' .. token .. ':' .. ARGV[10] .. ':' .. ttl .. ':' .. now
end
local due, due_since, due_entry = nil, 0, nil  -- the longest registered other client
local waiting = redis.call('HGETALL', KEYS[4])
for i = 1, #waiting, 2 do
  local s, u = string.match(waiting[i + 1], '^(%d+):(%d+)')
  if not s or tonumber(u) <= now then
    redis.call('HDEL', KEYS[4], waiting[i])
  elseif waiting[i] ~= ARGV[6] and now - tonumber(s) >= tonumber(ARGV[9])
      and (due == nil or tonumber(s) < due_since) then
    due, due_since, due_entry = waiting[i], tonumber(s), waiting[i + 1]
  end
end
local abandoned = redis.call('EXISTS', KEYS[3]) == 1
local function keep_registered()  -- our line after the key went elsewhere
  if not abandoned then
    register(now, now, offer(ARGV[14] ~= '' and ARGV[2] or '', ARGV[3]))
  elseif ARGV[7] == 'keep' then
    register(now, now, '')
  else
    redis.call('HDEL', KEYS[4], ARGV[6])
  end
end
local fence
if due then
  local token, loop_time, ttl, at =
    string.match(due_entry, '^%d+:%d+:(%x+):([^:]+):(%d+):(%d+)$')
  if token and now - tonumber(at) <= math.min(tonumber(ARGV[13]), tonumber(ttl) / 3) then
"""
    + _MINT_FENCE
    + """    redis.call('DEL', KEYS[1])  -- (a write that maxmemory never refuses; see above)
    redis.call('HDEL', KEYS[4], due)  -- its client offers its next token anew
    redis.call('SET', KEYS[1], token .. ':' .. fence, 'PX', ttl)
    -- (the counter kept as long as for our own successor, and at least the lease)
    redis.call('SET', KEYS[2], fence, 'PX', math.max(tonumber(ARGV[4]), tonumber(ttl)))
    keep_registered()
    redis.call('PUBLISH', ARGV[5] .. ':' .. due,
      ARGV[6] .. ':' .. due .. ':' .. token .. ':' .. fence .. ':' .. loop_time)
    return {5, tonumber(fence)}
  end
end
if due or abandoned then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[5], ARGV[6])
  keep_registered()
  return {abandoned and not due and 4 or 2, 0}
end
"""
    + _MINT_FENCE
    + """redis.call('DEL', KEYS[1])  -- (a write that maxmemory never refuses; see above)
redis.call('SET', KEYS[1], ARGV[2] .. ':' .. fence, 'PX', ARGV[3])
redis.call('SET', KEYS[2], fence, 'PX', ARGV[4])
if ARGV[7] ~= 'keep' then
  redis.call('HDEL', KEYS[4], ARGV[6])
elseif ARGV[11] ~= '' and redis.call('EXISTS', KEYS[5]) == 1 then
  register(now, now, '')
else
  register(now, now, offer(ARGV[11], ARGV[12]))
end
return {1, tonumber(fence)}
""",
)

# ABANDON: KEYS[1] lease key, KEYS[2] the attempt's tombstone, KEYS[3] the lock's waiting
# hash; ARGV[1] token, ARGV[2] tombstone ttl (ms), ARGV[3] the release channel, ARGV[4]
# the client's origin id.
# Deletes the key if the abandoned attempt already landed (or another client's releaser
# granted it to this token), withdraws the token's offer from the client's registration
# (see HANDOFF), and leaves a tombstone so that the attempt, should it reach Redis after
# this script, sets nothing, and no releaser grants the key to the token.
# Returns 1 if it deleted. Under maxmemory the tombstone may be refused (pcall): an
# attempt arriving later would then be refused by the same limit.
ABANDON = Script(
    "abandon",
    f"""local entry = redis.call('HGET', KEYS[3], ARGV[4])
if entry and string.find(entry, ':' .. ARGV[1] .. ':', 1, true) then
  redis.call('HDEL', KEYS[3], ARGV[4])  -- (first: a write that maxmemory never refuses)
  redis.pcall('HSET', KEYS[3], ARGV[4], string.match(entry, '^%d+:%d+'))
end
local current = redis.call('GET', KEYS[1])
local deleted = 0
if {_held()} then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  deleted = 1
end
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then  -- (never shortened)
  redis.pcall('SET', KEYS[2], '1', 'PX', ARGV[2])
end
return deleted
""",
)


# SEAL: the tombstone of an acquire attempt that got no answer, written once its
# acquisition holds the lock, before the lease is handed out (see _engine._seal): the
# attempt, should it reach Redis later, takes nothing. KEYS[1] the attempt's key (its
# tombstone), ARGV[1] tombstone ttl (ms). (A script, not a SET: it goes the way every
# acquire step goes, by the lane or asynclock's own pool when the caller's is full.)
SEAL = Script("seal", "return redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])")


# -- semaphores -------------------------------------------------------------------------
# A permit of a semaphore of N is one of N permit keys, '<lock key>:permit:<i>' (value
# '<token>:<fencing token>', PX = ttl), renewed, lost and released as a lease of its own.
# The index '<lock key>:permits', a sorted set of slot -> server time in ms at which the
# permit key expires (0: released), finds a free permit without looking at the others:
# every script that sets a permit key's expiry sets its score too, so a slot whose score
# has passed is free, and the slots are exactly 0 .. ZCARD-1 (a slot is added once, at the
# end, and never removed; the whole index expires no earlier than its last permit). A
# permit key is named from the lock's key in the script (it is only known there); it
# shares the lock's hash tag, so it is in the same Cluster slot as the declared keys.

# SEMAPHORE_ACQUIRE: a permit of a semaphore: a free slot found in its index (O(log N)),
# its key set with a fencing token from the lock's one counter (so tokens rise per name
# across permits).
# KEYS[1] the limit the permits are held with, KEYS[2] fence counter, KEYS[3] this
# attempt's key: '1' is its tombstone (see SEMAPHORE_ABANDON), 'p<slot>' the slot it took
# (PX ttl: a retry of ours finds its permit there), KEYS[4] the lock's key (held as a
# plain lock; the stem of the permit keys), KEYS[5] the permits' index
# ARGV[1] token, ARGV[2] lease ttl (ms), ARGV[3] fence counter ttl (ms), ARGV[4] limit
# Returns {1, fencing token, slot} when a permit is held by this token (new, or a retry of
# ours), {0, pttl in ms of the permit that expires first} when all are held, {-1, 0} when
# this attempt was abandoned, {-2, the limit they are held with} for another limit while
# a permit of it may be held (else the semaphore takes ARGV[4] from then on), {-3, 0}
# when the lock is held as a plain lock (limit 1).
# (One pass of the loop, unless a permit key disagrees with its score: written from
# outside the scripts; it is then indexed as it is and the next candidate taken, N + 1
# passes at most.)
SEMAPHORE_ACQUIRE = Script(
    "semaphore_acquire",
    """local found = redis.call('MGET', KEYS[3], KEYS[1], KEYS[4])  -- (one read for three)
local attempt, held_with = found[1], found[2]
if attempt == '1' then
  return {-1, 0}
end
if held_with and held_with ~= ARGV[4] then
  -- another limit: refused while a permit of it may be held; once none is, its slots are
  -- dropped and ours are taken from 0
"""
    + _no_permits("KEYS[5]", "KEYS[4] .. ':permit:'", "KEYS[5]")
    + """end
if found[3] then  -- (a plain lock's key holds a string, as a shared lease's marker does)
  return {-3, 0}
end
"""
    + _NOW
    + f"""local ttl = tonumber(ARGV[2])
local stem = KEYS[4] .. ':permit:'
local function index(slot, score)  -- (the index's expiry is never shortened)
  if redis.call('ZADD', KEYS[5], score, slot) == 1 and slot == '0' then
    redis.call('PEXPIRE', KEYS[5], score - now)  -- (new: slot 0 is the first taken)
  else
    redis.call('PEXPIRE', KEYS[5], score - now, 'GT')
  end
end
if attempt then  -- a retry of ours: the permit it took, if still ours
  local slot = string.sub(attempt, 2)
  local current = redis.call('GET', stem .. slot)
  if {_held()} then
    redis.call('PEXPIRE', stem .. slot, ttl)
    redis.call('PEXPIRE', KEYS[3], ttl)
    redis.call('PEXPIRE', KEYS[1], ARGV[3], 'GT')
    -- (XX: a slot joins the index at its end only, by the search below; one the index
    -- lost, from outside, is added back when a search reaches it)
    redis.call('ZADD', KEYS[5], 'XX', now + ttl, slot)
    redis.call('PEXPIRE', KEYS[5], ttl, 'GT')
    return {{1, {_FENCE_OF}, tonumber(slot)}}
  end
end
local limit = tonumber(ARGV[4])
local fence
for _ = 0, limit do
  local first = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
  local slot
  if first[1] and tonumber(first[2]) <= now then
    slot = first[1]  -- released, or expired with its holder
  else
    local count = redis.call('ZCARD', KEYS[5])
    if count >= limit then
      return {{0, tonumber(first[2]) - now}}
    end
    slot = tostring(count)  -- never taken yet
  end
"""
    + _MINT_AND_STORE_FENCE
    + """if redis.call('SET', stem .. slot, ARGV[1] .. ':' .. fence, 'PX', ttl, 'NX') then
    if held_with == ARGV[4] then  -- (never shortened: see _KEEP_PERMIT)
      redis.call('PEXPIRE', KEYS[1], ARGV[3], 'GT')
    else
      redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[3])
    end
    redis.call('SET', KEYS[3], 'p' .. slot, 'PX', ttl)
    index(slot, now + ttl)
    return {1, tonumber(fence), tonumber(slot)}
  end
  -- (-1, no expiry: looked at after a ttl; 0, its last millisecond: a key lives while
  -- the time is not past its expiry, so a score equal to that time may find it held)
  local pttl = redis.call('PTTL', stem .. slot)
  index(slot, now + (pttl >= 0 and pttl + 1 or ttl))
end
return {0, ttl}
""",
)

# SEMAPHORE_ABANDON: undo an acquire attempt of a semaphore's permit that may have
# landed, and stop it from landing later. KEYS[1] the attempt's key (see
# SEMAPHORE_ACQUIRE), KEYS[2] the permits' index, KEYS[3] the lock's key (the stem of the
# permit keys); ARGV[1] token, ARGV[2] tombstone ttl (ms), ARGV[3] the release channel,
# ARGV[4] the client's origin id, ARGV[5] (optional) the slot of the permit the
# acquisition was granted, for an undo after SEAL wrote the tombstone over the attempt's
# 'p<slot>'. Returns how many permits it gave back (0 or 1).
SEMAPHORE_ABANDON = Script(
    "semaphore_abandon",
    f"""local attempt = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], '1', 'PX', ARGV[2])
local slot = ARGV[5]
if attempt and attempt ~= '1' then
  slot = string.sub(attempt, 2)
elseif not slot then
  return 0
end
local key = KEYS[3] .. ':permit:' .. slot
local current = redis.call('GET', key)
if not {_held()} then
  return 0
end
redis.call('DEL', key)
redis.call('ZADD', KEYS[2], 'XX', 0, slot)
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
""",
)

# The permit of PERMIT_RENEW and PERMIT_RELEASE (KEYS[1] '<lock key>:permit:<slot>',
# KEYS[2] the permits' index, KEYS[3] the limit they are held with) kept for ARGV[n] ms
# more, its slot's score with it; the index and the limit live at least as long (their
# expiry is never shortened): a permit renewed past the limit's own expiry (the fence
# counter's ttl from the last acquire) keeps it, so that another limit is still refused.
_KEEP_PERMIT = (
    """redis.call('PEXPIRE', KEYS[1], ARGV[{n}])
"""
    + _NOW
    + """redis.call('ZADD', KEYS[2], 'XX', now + ARGV[{n}], slot)
redis.call('PEXPIRE', KEYS[2], ARGV[{n}], 'GT')
redis.call('PEXPIRE', KEYS[3], ARGV[{n}], 'GT')
"""
)

# PERMIT_RENEW: KEYS[1] the permit's key, KEYS[2] the permits' index, KEYS[3] the limit;
# ARGV[1] the permit's full value, ARGV[2] ttl (ms). Returns 1 when the key still holds our
# value (its TTL, and its slot's score, now exactly ttl from now), else 0.
PERMIT_RENEW = Script(
    "permit_renew",
    """if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local slot = string.match(KEYS[1], '(%d+)$')
"""
    + _KEEP_PERMIT.format(n=2)
    + "return 1\n",
)

PERMIT_RENEW_HEAD: Final = b"*8\r\n" + pack_args(("EVALSHA", PERMIT_RENEW.sha, 3))
"""The start of a packed PERMIT_RENEW command; the permit's key, the index, the limit,
the permit's value and ttl (ms) follow."""

# PERMIT_RELEASE: KEYS[1] the permit's key, KEYS[2] the permits' index, KEYS[3] the limit;
# ARGV[1] the permit's full value, ARGV[2] the release channel, ARGV[3] the releasing
# client's origin id, ARGV[4] (optional, hold_at_least) ms to keep the permit for. Returns
# 1 when our permit was given back (or kept) and waiters notified, 0 when not ours.
PERMIT_RELEASE = Script(
    "permit_release",
    """if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local slot = string.match(KEYS[1], '(%d+)$')
if ARGV[4] then
"""
    + _KEEP_PERMIT.format(n=4)
    + """else
  redis.call('DEL', KEYS[1])
  redis.call('ZADD', KEYS[2], 'XX', 0, slot)  -- free from now on
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
""",
)


# -- fair locks ---------------------------------------------------------------------------
# FAIR_ACQUIRE: a lock taken in the order its waiters came (lease(..., fair=True)). The
# waiters of every client queue in a sorted set (token -> server time of arrival,
# microseconds); each says it is alive by each attempt (a hash: token -> server time in ms
# until which it counts as waiting). The first live waiter in the queue, and nobody else,
# may take the lock when it is free; waiters no longer alive are dropped from the head.
# KEYS[1] lease key, KEYS[2] fence counter, KEYS[3] this attempt's tombstone, KEYS[4] the
# queue, KEYS[5] the waiters' liveness hash; ARGV[1] token, ARGV[2] lease ttl (ms),
# ARGV[3] fence counter ttl (ms), ARGV[4] for how long (ms) a waiter counts as alive after
# an attempt, ARGV[5] 'wait' to join the queue (else a single attempt, which takes the
# lock only when nobody waits).
# Returns the fencing token alone (as ACQUIRE's) when held by this token (new,
#           or a retry of ours),
#         {0, pttl of the holder in ms (0: free, another waiter's turn; -1: no expiry)},
#         {-1, 0} when this attempt was abandoned (its tombstone exists),
#         {-2, their limit} as ACQUIRE's.
FAIR_ACQUIRE = Script(
    "fair_acquire",
    _FOUND
    + f"""local current, held_with = found[2], found[3]
if {_held()} then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {_FENCE_OF}
end
if held_with and not current then
{_PERMITS_OF_LOCK}end
"""
    + _NOW
    + """local head = nil
while true do
  local first = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
  if not first then
    break
  end
  local alive = tonumber(redis.call('HGET', KEYS[5], first))
  if first == ARGV[1] or (alive and alive > now) then
    head = first
    break
  end
  redis.call('ZREM', KEYS[4], first)
  redis.call('HDEL', KEYS[5], first)
end
if not current and (head == nil or head == ARGV[1]) then
  if head then  -- (out of the queue; an empty queue does not hold us, nor the hash)
    redis.call('ZREM', KEYS[4], ARGV[1])
    redis.call('HDEL', KEYS[5], ARGV[1])
  end
  local fence
"""
    + _MINT_AND_STORE_FENCE
    + _set_new("ARGV[1] .. ':' .. fence", "ARGV[2]")
    + """  return fence
end
if ARGV[5] == 'wait' then
  if not redis.call('ZSCORE', KEYS[4], ARGV[1]) then
    redis.call('ZADD', KEYS[4], tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[1])
  end
  redis.call('HSET', KEYS[5], ARGV[1], now + tonumber(ARGV[4]))
  local keep = 2 * tonumber(ARGV[4]) + tonumber(ARGV[2])
  redis.call('PEXPIRE', KEYS[4], keep)
  redis.call('PEXPIRE', KEYS[5], keep)
end
if not current then
  return {0, 0}
end
return {0, redis.call('PTTL', KEYS[1])}
""",
)

# FAIR_LEAVE: a waiter of a fair lock gives up (or its attempt's outcome is unknown): out
# of the queue, the lock deleted if that attempt took it, a tombstone against a late
# arrival, and the waiters woken (the queue's head may have changed).
# KEYS[1] lease key, KEYS[2] the attempt's tombstone, KEYS[3] the queue, KEYS[4] the
# liveness hash; ARGV[1] token, ARGV[2] tombstone ttl (ms), ARGV[3] the release channel,
# ARGV[4] the client's origin id. Returns 1 if it deleted the lock's key.
FAIR_LEAVE = Script(
    "fair_leave",
    f"""redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
local current = redis.call('GET', KEYS[1])
local deleted = 0
if {_held()} then
  redis.call('DEL', KEYS[1])
  deleted = 1
end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return deleted
""",
)


# -- shared (read) leases ----------------------------------------------------------------
# While shared leases hold a lock, its key holds a marker (so an exclusive ACQUIRE finds it
# taken, and waits; no lease's value starts with 'shared', a token being hex digits):
# - one reader alone: 'shared:<token>:<fencing token>' (its full value after 'shared:'),
#   PX = its expiry; the lock's key is its hold, renewed and released as a lease key is
#   (the uncontended cycle touches no other key);
# - several: 'shared', and each reader is a member of the sorted set '<lock key>:readers':
#   its value '<token>:<fencing token>' (what its holder knows: renew and release check
#   ownership by the member itself) -> the server time in ms until which it lives. A
#   reader that comes while another is alone moves that one into the set beside itself.
#   The marker and the set live as long as the longest member, no longer: every script
#   that adds or extends a member extends both to it (never shortens them), and a reader
#   that leaves while it was the longest shortens both to the longest one left. So while
#   the marker is there, the member that expires last has not: the last one out (the only
#   member) knows it is live without reading the clock.
# The last one out deletes the marker (and the set) and announces the release.


def _find_reader(readers: str) -> str:
    """Lua: the member of the token ARGV[1] in the readers' set ``readers`` (a key), if
    any, into ``member``, its expiry (server ms) into ``score``: ZSCAN for
    '<token>:*', O(readers), run only for an acquire sent again after an outcome it did
    not learn and for an abandoned attempt (the token is all they know)."""
    return f"""local member, score = nil, nil
local cursor = '0'
repeat
  local page = redis.call('ZSCAN', {readers}, cursor, 'MATCH', ARGV[1] .. ':*', 'COUNT', 1000)
  cursor = page[1]
  for i = 1, #page[2], 2 do
    member, score = page[2][i], tonumber(page[2][i + 1])
  end
until cursor == '0' or member
"""


# Drop the reader `member` (its value; nil if not in the set) from the readers KEYS[1],
# while the lock's key KEYS[2] holds the marker 'shared'; `top` the two members that
# expire last. Alone in the set, it is ours (the marker lives no longer than the longest
# member: see above); then the marker and the set go in one DEL and the release is
# announced on ARGV[2] (ARGV[3]), as it is when the set holds no member (a marker nobody
# holds). With another member (the clock is read only then) it is ours if it has not
# expired; if a live reader is left, `member` and the expired ones leave, and if `member`
# was the longest the marker and the set are shortened to the longest one left
# (PEXPIREAT: scores are server ms); else the last one out goes as above. Returns 1 when
# `member` was ours (live), else 0.
_SHARED_DROP = f"""local top = redis.call('ZRANGE', KEYS[1], -2, -1, 'WITHSCORES')
local mine, other = nil, nil  -- (our expiry, the longest other's)
for i = #top - 1, 1, -2 do
  if top[i] == member then
    mine = tonumber(top[i + 1])
  elseif not other then
    other = tonumber(top[i + 1])
  end
end
if not other then
  redis.call('DEL', KEYS[2], KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return mine and 1 or 0
end
{_NOW}if member and not mine then
  mine = tonumber(redis.call('ZSCORE', KEYS[1], member))
end
if other > now then
  if mine then
    redis.call('ZREM', KEYS[1], member)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if mine and mine > other then
    redis.call('PEXPIREAT', KEYS[2], other)
    redis.call('PEXPIREAT', KEYS[1], other)
  end
else
  redis.call('DEL', KEYS[2], KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return (mine and mine > now) and 1 or 0
"""

# SHARED_ACQUIRE: KEYS[1] the lock's key, KEYS[2] fence counter, KEYS[3] this attempt's
# tombstone, KEYS[4] the lock's waiting hash (exclusive waiters, see ACQUIRE), KEYS[5] the
# readers; ARGV[1] token, ARGV[2] ttl (ms), ARGV[3] fence ttl (ms), ARGV[4] '1' when an
# earlier attempt with this token may have landed (its outcome unknown, or its grant
# answered too late to use; absent: ''): only then is the token's member looked for in
# the set (a reader alone is found in the lock's key by any attempt); found expired, it
# is removed, so that a token has one member at most (ZSCAN finds any one of several).
# Returns {1, fencing token} when held by this token (new, or a retry of ours: its
#           expiry renewed),
#         {0, pttl in ms to wait at most}: an exclusive holder (its pttl), or an exclusive
#         waiter registered (shared holders let it in first),
#         {-1, 0} when this attempt was abandoned (its tombstone exists),
#         {-2, their limit} as ACQUIRE's.
# The first reader in writes only the lock's key; the second moves the first into a new
# set (scored with its key's expiry) beside itself, and the marker and the set live as
# long as the longer of the two; later ones only ever extend them (and give the set an
# expiry if it had none: made anew by the ZADD, the old one gone beside the marker).
SHARED_ACQUIRE = Script(
    "shared_acquire",
    _FOUND
    + f"""local holder, held_with = found[2], found[3]
local alone = nil  -- (the value of a reader alone in the lock's key)
if holder and holder ~= 'shared' then
  if string.sub(holder, 1, 7) ~= 'shared:' then
    return {{0, redis.call('PTTL', KEYS[1])}}
  end
  alone = string.sub(holder, 8)
  if string.sub(alone, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then  -- (a retry of ours)
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {{1, tonumber(string.sub(alone, #ARGV[1] + 2))}}
  end
end
if held_with and not holder then
{_PERMITS_OF_LOCK}end
"""
    + _NOW
    + """local ttl = tonumber(ARGV[2])
if holder == 'shared' and ARGV[4] == '1' then
"""
    + _find_reader("KEYS[5]")
    + """  if member and score > now then  -- (a retry of ours: renewed as SHARED_RENEW does)
    redis.call('PEXPIRE', KEYS[1], ttl, 'GT')  -- (first: see SHARED_RENEW)
    redis.call('PEXPIRE', KEYS[5], ttl, 'GT')
    redis.call('ZADD', KEYS[5], now + ttl, member)
    return {1, tonumber(string.sub(member, #ARGV[1] + 2))}
  end
  if member then  -- (ours, expired: out, so that a token never has two members to find)
    redis.call('ZREM', KEYS[5], member)
  end
end
local waiting = redis.call('HGETALL', KEYS[4])
for i = 2, #waiting, 2 do
  local until_ms = tonumber(string.match(waiting[i], '^%d+:(%d+)'))
  if until_ms and until_ms > now then
    local pttl = redis.call('PTTL', KEYS[1])
    if pttl < 0 or pttl > 1000 then pttl = 1000 end
    return {0, pttl}
  end
end
local fence
"""
    + _MINT_AND_STORE_FENCE
    + """if not holder then  -- (the first reader in)
"""
    + _set_new("'shared:' .. ARGV[1] .. ':' .. fence", "ttl")
    + """  return {1, tonumber(fence)}
end
if alone then  -- the reader alone in the lock's key joins the set beside us (a set
  -- already there is what a lost marker left: its members hold no more, none revives)
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl < 0 then pttl = ttl end
  redis.call('DEL', KEYS[5])
  redis.call('ZADD', KEYS[5], now + ttl, ARGV[1] .. ':' .. fence, now + pttl, alone)
  local keep = math.max(pttl, ttl)
  redis.call('SET', KEYS[1], 'shared', 'PX', keep)
  redis.call('PEXPIRE', KEYS[5], keep)
else
  redis.call('ZADD', KEYS[5], now + ttl, ARGV[1] .. ':' .. fence)
  redis.call('PEXPIRE', KEYS[1], ttl, 'GT')
  if redis.call('PEXPIRE', KEYS[5], ttl, 'GT') == 0 and redis.call('PTTL', KEYS[5]) == -1 then
    -- (the set was gone beside the marker: our ZADD made it anew, GT leaves it without expiry)
    redis.call('PEXPIRE', KEYS[5], ttl)
  end
end
return {1, tonumber(fence)}
""",
)


def _live_reader(alone: str) -> str:
    """Lua: return 0 unless the reader of value ARGV[1] holds, with the readers' set
    KEYS[1] and the lock's key KEYS[2]; ``alone`` runs (and returns) when it is alone in
    the lock's key. Past it, it is a live member of the set beside the marker, and
    ``now`` is the server's time in ms."""
    return (
        f"""local holder = redis.call('GET', KEYS[2])
if holder == 'shared:' .. ARGV[1] then
{alone}end
if holder ~= 'shared' then
  return 0
end
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return 0
end
"""
        + _NOW
        + """if tonumber(score) <= now then
  return 0
end
"""
    )


# SHARED_RENEW: KEYS[1] the readers, KEYS[2] the lock's key; ARGV[1] the reader's full
# value, ARGV[2] ttl (ms). Returns 1 when still ours: alone in the lock's key (its expiry
# now exactly ttl), or a member that had not expired (it, the set and the marker now live
# >= ttl); else 0 (also when the marker is gone or an exclusive holder got in). The
# expiries are extended before the member's score: PEXPIRE is a write that maxmemory never
# refuses, and Redis lets a script that has written go on writing, so that a held lease
# renews under noeviction out of memory as a plain one does (a ZADD first is refused).
SHARED_RENEW = Script(
    "shared_renew",
    _live_reader("  redis.call('PEXPIRE', KEYS[2], ARGV[2])\n  return 1\n")
    + """local ttl = tonumber(ARGV[2])
redis.call('PEXPIRE', KEYS[1], ttl, 'GT')
redis.call('PEXPIRE', KEYS[2], ttl, 'GT')
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
return 1
""",
)

SHARED_RENEW_HEAD: Final = b"*7\r\n" + pack_args(("EVALSHA", SHARED_RENEW.sha, 2))
"""The start of a packed SHARED_RENEW command; the readers' set, the lock's key, the
reader's value and ttl (ms) follow."""

# SHARED_IS_OURS: KEYS[1] the readers, KEYS[2] the lock's key; ARGV[1] the reader's full
# value. Returns 1 when it holds (alone in the lock's key, or a live member beside the
# marker), else 0. Nothing is written (``Lease.is_held(verify=True)``).
SHARED_IS_OURS = Script("shared_is_ours", _live_reader("  return 1\n") + "return 1\n")


def _leave_alone(ours: str) -> str:
    """Lua, with the lock's key KEYS[2] read into ``marker``: if ``ours`` (a Lua
    condition) finds there a reader alone that is ours, delete the key and announce the
    release on ARGV[2] (ARGV[3]), returning 1; return 0 if the key holds neither that nor
    the marker 'shared' (then the reader is not in the set either)."""
    return f"""if {ours} then
  redis.call('DEL', KEYS[2])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
if marker ~= 'shared' then
  return 0
end
"""


# SHARED_RELEASE: KEYS[1] the readers, KEYS[2] the lock's key; ARGV[1] the reader's full
# value, ARGV[2] the release channel, ARGV[3] our origin id.
# Returns 1 when our hold was given back (the marker deleted and the release announced
# if we were the last), else 0. (A reader alone runs GET, DEL and PUBLISH, as a mutex.)
SHARED_RELEASE = Script(
    "shared_release",
    "local marker = redis.call('GET', KEYS[2])\n"
    + _leave_alone("marker == 'shared:' .. ARGV[1]")
    + "local member = ARGV[1]\n"
    + _SHARED_DROP,
)

# SHARED_ABANDON: undo a shared acquire attempt that may have landed, and stop it from
# landing later. KEYS[1] the readers, KEYS[2] the lock's key, KEYS[3] the attempt's
# tombstone; ARGV[1] token, ARGV[2] the release channel, ARGV[3] our origin id, ARGV[4]
# tombstone ttl (ms). Returns 1 if it gave a shared hold back. (It writes first with a
# DEL, which maxmemory never refuses, so that out of memory the tombstone is written too.)
SHARED_ABANDON = Script(
    "shared_abandon",
    """redis.call('DEL', KEYS[3])  -- (first: see above)
redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
local marker = redis.call('GET', KEYS[2])
"""
    + _leave_alone("marker and string.sub(marker, 1, #ARGV[1] + 8) == 'shared:' .. ARGV[1] .. ':'")
    + _find_reader("KEYS[1]")
    + """if not member then
  return 0
end
"""
    + _SHARED_DROP,
)


# STATISTICS: what holds a lock, and who waits for it, read in one step (nothing is
# written). KEYS[1] the lock's key, KEYS[2] its readers, KEYS[3] its permits' limit,
# KEYS[4] its waiting hash, KEYS[5] its fair queue, KEYS[6] the queue's liveness hash,
# KEYS[7] its permits' index (see SEMAPHORE_ACQUIRE).
# Returns {pttl of the lock's key (-2: none), 1 if it holds a shared marker, live
# readers (a reader alone in the lock's key counted), the permits' limit (0: none),
# permits held, clients registered waiting, live queued waiters}.
STATISTICS = Script(
    "statistics",
    _NOW
    + """local pttl = redis.call('PTTL', KEYS[1])
local shared = 0
local readers = redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf')
if pttl ~= -2 then
  local value = redis.call('GET', KEYS[1])
  if value == 'shared' then
    shared = 1
  elseif value and string.sub(value, 1, 7) == 'shared:' then  -- (a reader alone)
    shared, readers = 1, readers + 1
  end
end
local limit = tonumber(redis.call('GET', KEYS[3]) or '0')
local permits = redis.call('ZCOUNT', KEYS[7], '(' .. now, '+inf')
local function live(hash, pattern)  -- entries of `hash` whose time (ms) is still ahead
  local count, entries = 0, redis.call('HGETALL', hash)
  for i = 2, #entries, 2 do
    local until_ms = tonumber(string.match(entries[i], pattern))
    if until_ms and until_ms > now then
      count = count + 1
    end
  end
  return count
end
return {pttl, shared, readers, limit, permits, live(KEYS[4], '^%d+:(%d+)'),
  live(KEYS[6], '^([^:]+)$')}
""",
)
