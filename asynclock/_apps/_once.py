"""Jobs that run once: ``once()``, the ``idempotent()`` decorator and ``forget()``.

Design note. A job is a lease whose acquire script first looks for the job's stored
result (``ACQUIRE_JOB``): one round trip answers "here is the result", "another
fingerprint", "the lease is yours", or "held: wait" (the lease's own wait, woken by
releases). The caller that gets the lease awaits ``func`` under a guard of it (a loss
cancels it), and on success one owner-checked script stores the result and deletes the
lease (``STORE``): a caller that lost its lease stores nothing, and no duplicate can find
the lease free before the result is there. Waiters are woken by that release and find
the result at their next attempt; nothing is handed to them. If ``func`` raises, the
lease is released as any other (a waiting duplicate may be handed it and run ``func``):
a failure is never stored. The result lives in the hash ``<prefix>{key}:result``
(``v``: the payload, ``f``: the fingerprint's digest); while the job runs, the digest is
kept in the lease's value too, so a conflicting duplicate is refused at once.

A job that ran must not run again because its result could not be stored. Before the
payload is stored, it is read back as a duplicate would read it (``loads`` of what the
client returns), and that is what the caller gets: a payload that would break every
duplicate is found here, after the job but before anything is written. Then, instead of
the result, the STORE script keeps a marker (``e``: why) in the same hash, and every call
raises ``ResultNotStored`` until it expires or is forgotten (a job whose effects ran is
never run twice on that account).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, ParamSpec, Protocol, TypeVar, runtime_checkable

from .._base._exceptions import IdempotencyConflict, LockLost, LossReason, ResultNotStored
from .._base._options import MAX_TTL, Client, LeaseOptions, RedisApi, _positive, redis_api
from .._kinds._mutex import Job, JobConflict, JobDone, JobUnstored
from .._lifecycle._context import begin
from .._lifecycle._lease import Lease
from .._redis._lane import encoding_of
from ._current import running_under
from ._template import (
    ClientSource,
    KeyTemplate,
    checked_source,
    is_template,
    key_maker,
    resolver,
)

__all__ = ["Serializer", "forget", "idempotent", "once"]

P = ParamSpec("P")
T = TypeVar("T")

_RESULT_SUFFIX = ":result"
_MAX_CAUSE = 500  # characters of a marker's cause kept (an error may quote a large object)
_READ_BACK_LEAST = 0.1
"""The least share of ``release_timeout`` the read-back of a result whose store got no
answer is given, if the store used up the rest: one try at a server that answers again."""


@runtime_checkable
class Serializer(Protocol):
    """How ``once()`` stores results: ``dumps(obj) -> bytes | str`` and
    ``loads(data: bytes) -> obj``."""

    def dumps(self, obj: Any, /) -> bytes | str: ...

    def loads(self, data: bytes, /) -> Any: ...


class _Json:
    """The default serializer: JSON, without NaN or infinities. What ``loads`` gives back:
    ``dict`` (its keys as ``str``: ``{1: x}`` comes back as ``{"1": x}``), ``list`` for a
    ``list`` or a ``tuple``, ``str``, ``int``, ``float``, ``bool``, ``None``, nested as
    deep as ``json`` goes. Anything else (``datetime``, ``Decimal``, ``set``, ``bytes``, a
    dataclass, NaN) cannot be encoded."""

    def dumps(self, obj: Any, /) -> str:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False)

    def loads(self, data: bytes, /) -> Any:
        return json.loads(data)


_JSON = _Json()


async def once(
    redis: Client,
    key: str,
    func: Callable[..., Awaitable[T]],
    *args: Any,
    ttl: float | timedelta = 30.0,
    result_ttl: float | timedelta = 86400.0,
    fingerprint: str | bytes | None = None,
    blocking_timeout: float | timedelta | None = None,
    prefix: str = "asynclock:",
    serializer: Serializer | None = None,
) -> T:
    """Run ``await func(*args)`` once for ``key`` across every process, and return its
    result as stored; a duplicate call returns the stored result instead of running it
    again.

    - A result stored for ``key`` is returned at once (one round trip), deserialized.
    - Otherwise the caller takes the lease ``key`` (watchdog, safe deadline, loss
      cancels ``func``) and runs ``func``; on success the result is stored (for
      ``result_ttl`` seconds) and the lease released in one owner-checked step.
    - Every caller, the one that ran ``func`` included, gets the stored result as the
      serializer reads it back (``loads(dumps(result))``), not the object ``func``
      returned: with the default JSON serializer a ``tuple`` comes back as a ``list`` and
      ``dict`` keys as ``str`` to all of them alike, so the code that handles the result
      is tested by its first run, and a result the serializer cannot read back is found
      before it is stored.
    - The result cannot be stored (the serializer refuses it, cannot read its own output
      back, or returns bytes a ``decode_responses=True`` client cannot decode): a marker
      that the job ran is stored instead, for ``result_ttl`` seconds, and this call and
      every later one for ``key`` raise ``ResultNotStored`` naming the cause; ``func`` is
      not run again until the marker expires or :func:`forget` deletes it.
    - Duplicates that arrive meanwhile, in any process, wait, are woken when the result is
      stored (or the lease given back), and return the stored result.
    - ``func`` raises: its caller gets the exception, nothing is stored, and a waiting
      duplicate runs ``func`` in turn (at least once until one succeeds).
    - The holder's process dies: a duplicate runs ``func`` once its lease expires (within
      ``ttl``). The job may then have run twice in part: effects that must happen exactly
      once need the fencing token checked where they are written.

    Args:
        key: the job's name (a lock name: non-empty, not starting with ``}``), or a key
            template like ``"charge:{order_id}"``: a ``str.format`` template filled from
            ``args`` bound to ``func``'s signature (defaults applied; ``{order.id}``
            and ``{ctx[job]}`` reach attributes and items). A field naming no parameter
            of ``func`` raises ``ValueError`` before any I/O. A key with no field (or a
            lone brace) is taken as it is; ``{{`` and ``}}`` are literal braces in a
            template.
        ttl: the lease's time to live, seconds, renewed every ttl/3 while ``func`` runs.
        result_ttl: seconds the result is kept.
        fingerprint: a digest of the job's payload (``str`` or ``bytes``); a call for the
            same key with another fingerprint, while the job runs or once it finished,
            raises ``IdempotencyConflict``. None checks nothing.
        blocking_timeout: the most seconds to wait for a result or the lease; None waits.
        serializer: JSON by default (what it returns: a ``list`` for a ``tuple``, ``str``
            keys; ``datetime``, ``Decimal``, ``set``, ``bytes`` and the like cannot be
            encoded); any object with ``dumps(obj) -> bytes | str`` and
            ``loads(data: bytes) -> obj``, checked before any I/O. With a
            ``decode_responses=True`` client the payload must be text in the client's
            encoding.

    Raises:
        IdempotencyConflict: another fingerprint was stored for ``key``; ``func`` not run.
        ResultNotStored: the job ran (in this call or an earlier one) but its result could
            not be stored; ``cause`` says why. Also a ``TypeError``.
        AcquireTimeout: neither a result nor the lease came within ``blocking_timeout``.
        LockLost: the lease was lost while ``func`` ran (it was cancelled), or before its
            result could be stored: nothing was stored; or Redis did not answer whether
            it stored the result, and it could not be read back: rather than a result no
            other caller would be given, this error (a later call may run the job again
            once the lease's key has expired).
        TypeError: an argument has the wrong type (before any I/O, as ``ValueError``),
            or ``args`` do not fit ``func``'s signature when ``key`` is a template.
        ValueError: a bad argument; a template field that names no parameter of
            ``func`` or could not be filled.
        redis.exceptions.RedisError: Redis refused or could not be reached.
        Exception: whatever ``func`` raised.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    if isinstance(key, str) and is_template(key):
        key = KeyTemplate(key, func).render(args, {})
    return await _run_once(
        redis,
        key,
        func,
        args,
        ttl,
        result_ttl,
        fingerprint,
        blocking_timeout,
        prefix,
        serializer,
    )


async def _run_once(
    redis: Client,
    key: str,
    func: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
    ttl: float | timedelta,
    result_ttl: float | timedelta,
    fingerprint: str | bytes | None,
    blocking_timeout: float | timedelta | None,
    prefix: str,
    serializer: Serializer | None,
) -> T:
    """``once()`` for a key already made (never read as a template)."""
    redis = redis_api(redis)
    options = LeaseOptions.cached(
        redis, key, {"ttl": ttl, "blocking_timeout": blocking_timeout, "prefix": prefix}
    )
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    result_ms = _result_ttl_ms(result_ttl)
    digest = _digest(fingerprint)
    codec = _codec(serializer)
    job = Job(options.key + _RESULT_SUFFIX, digest)
    try:
        tenure = await begin(redis, options, None, job)
    except JobUnstored as marker:
        raise ResultNotStored(key, _text(marker.payload, redis)) from None
    except JobDone as done:
        return codec.loads(_as_bytes(done.payload, redis))  # type: ignore[no-any-return]
    except JobConflict:
        raise IdempotencyConflict(key) from None
    held = Lease(tenure)
    try:
        async with held.guard():
            with running_under(held):
                result = await func(*args)
    except BaseException:
        await held.release()  # (a loss is the error in flight's note, or LockLost)
        raise
    # From here on the job has run: whatever happens, it must not run again.
    unstored: Exception | None = None
    try:
        payload = _dumps(codec, result)
        value = codec.loads(_read_back(payload, redis))
    except Exception as exc:  # (a duplicate could not read it: keep a marker instead)
        unstored = exc
        cause = f"{type(exc).__name__}: {exc}"[:_MAX_CAUSE]
        payload, field = cause, "e"
    else:
        field = "v"
    # (the store and, if its outcome is unknown, its read-back end within one
    # release_timeout, at least its tenth given to the read-back)
    loop = asyncio.get_running_loop()
    ends = loop.time() + options.release_timeout
    stored = await tenure.give_back(
        ([options.key, job.result_key], [payload, result_ms, digest, field])
    )
    if stored is False:
        raise LockLost(key, LossReason.NOT_OWNER, "the result was not stored")
    if stored is None:  # (Redis did not answer: it may, or may not, have stored it)
        least = loop.time() + _READ_BACK_LEAST * options.release_timeout
        stored_value = await _stored_result(redis, key, job.result_key, codec, max(ends, least))
        return stored_value  # type: ignore[no-any-return]
    if unstored is not None:
        raise ResultNotStored(key, cause) from unstored
    return value  # type: ignore[no-any-return]


async def _stored_result(
    redis: RedisApi, key: str, result_key: str, codec: Serializer, deadline: float
) -> Any:
    """What every caller of the job ``key`` is given, once the store's outcome is unknown:
    the result read back (or its marker's error) if it was stored; else ``LockLost``
    rather than a value nobody else will see (a later call may then run the job again,
    once the lease's key has expired). ``deadline``: loop time the read-back ends by.

    Raises:
        ResultNotStored: the marker of a result that could not be stored was stored.
        LockLost: the result could not be read back (``deadline``: Redis did not answer
            in time), or was not stored (``not_owner``).
    """
    try:
        async with asyncio.timeout_at(deadline):
            found, marker = await redis.hmget(result_key, ["v", "e"])
    except Exception as exc:  # (any failure leaves it unknown)
        raise LockLost(
            key, LossReason.DEADLINE, "Redis did not answer whether the result was stored"
        ) from exc
    if found is not None:
        return codec.loads(_as_bytes(found, redis))
    if marker is not None:
        raise ResultNotStored(key, _text(marker, redis))
    raise LockLost(key, LossReason.NOT_OWNER, "the result was not stored")


def idempotent(
    redis: ClientSource,
    *,
    key: str | Callable[..., str],
    fingerprint: Callable[..., str | bytes | None] | None = None,
    ttl: float | timedelta = 30.0,
    result_ttl: float | timedelta = 86400.0,
    blocking_timeout: float | timedelta | None = None,
    prefix: str = "asynclock:",
    serializer: Serializer | None = None,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
    """``@idempotent(redis, key="charge:{order.id}")``: every call of the decorated
    coroutine function goes through :func:`once`, keyed by the template filled from the
    call's arguments (or by ``key(*args, **kwargs)`` for a callable), and fingerprinted
    by ``fingerprint(*args, **kwargs)`` if given.

    Args:
        redis: a client; or a zero-argument callable returning one, called at each call
            (a client made in FastAPI's ``lifespan``); or :func:`client_from` (arq's
            ``client_from("ctx[redis]")``).
        key: a template whose fields name the function's parameters (see
            :func:`once`), or a callable of the function's arguments returning the key.
        fingerprint, ttl, result_ttl, blocking_timeout, prefix, serializer: as
            :func:`once` takes them (``fingerprint`` called with the call's arguments).

    Raises:
        TypeError, ValueError: a bad option, or (when decorating) a template field or
            ``client_from`` field that names no parameter of the function; before any
            I/O.
    """
    if not isinstance(key, str) and not callable(key):
        raise TypeError(
            f"key must be a template (str) or a callable of the function's arguments, not {key!r}"
        )
    if fingerprint is not None and not callable(fingerprint):
        raise TypeError(f"fingerprint must be a callable or None, not {fingerprint!r}")
    checked = checked_source(redis)
    LeaseOptions.cached(
        checked, "idempotent", {"ttl": ttl, "blocking_timeout": blocking_timeout, "prefix": prefix}
    )
    _result_ttl_ms(result_ttl)
    _codec(serializer)

    def decorate(func: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        if not callable(func):
            raise TypeError(f"idempotent() decorates a coroutine function, not {func!r}")
        make_key = key_maker(key, func)
        client_of = resolver(redis, func)

        @functools.wraps(func)
        async def run(*args: P.args, **kwargs: P.kwargs) -> T:
            name = make_key(args, kwargs)
            bound: Callable[..., Awaitable[T]] = (
                functools.partial(func, **kwargs) if kwargs else func
            )
            return await _run_once(
                client_of(args, kwargs),
                name,
                bound,
                args,
                ttl,
                result_ttl,
                None if fingerprint is None else fingerprint(*args, **kwargs),
                blocking_timeout,
                prefix,
                serializer,
            )

        return run

    return decorate


async def forget(redis: Client, key: str, *, prefix: str = "asynclock:") -> bool:
    """Delete the result stored for ``key`` by :func:`once`, so that the next call runs
    the job again (reprocessing on purpose). Returns whether there was one. A job that is
    running is not stopped: it stores its result when it ends.
    """
    options = LeaseOptions.cached(redis, key, {"prefix": prefix})
    return bool(await redis.delete(options.key + _RESULT_SUFFIX))


def _result_ttl_ms(value: object) -> int:
    seconds = _positive("result_ttl", value)
    if seconds > MAX_TTL:
        raise ValueError(f"result_ttl must be at most {MAX_TTL:.0f}s, got {value!r}")
    return max(1, round(seconds * 1000))


def _digest(fingerprint: object) -> str:
    """The fingerprint's SHA-256 (hex), kept in Redis; '' for None."""
    if fingerprint is None:
        return ""
    if isinstance(fingerprint, str):
        fingerprint = fingerprint.encode()
    if not isinstance(fingerprint, bytes):
        raise TypeError(f"fingerprint must be str, bytes or None, not {type(fingerprint).__name__}")
    return hashlib.sha256(fingerprint).hexdigest()


def _codec(serializer: object) -> Serializer:
    if serializer is None:
        return _JSON
    if not isinstance(serializer, Serializer):
        raise TypeError(
            "serializer must have dumps(obj) -> bytes | str and loads(data: bytes) -> obj, "
            f"not {type(serializer).__name__}"
        )
    return serializer


def _dumps(codec: Serializer, result: object) -> bytes | str:
    """``codec.dumps(result)``, checked.

    Raises:
        TypeError: ``dumps`` returned neither ``bytes`` nor ``str``.
        Whatever ``dumps`` raised (``TypeError``, ``ValueError``, ...).
    """
    payload = codec.dumps(result)
    if not isinstance(payload, bytes | str):
        raise TypeError(
            f"the serializer's dumps() returned {type(payload).__name__}, not bytes or str"
        )
    return payload


def _read_back(payload: bytes | str, redis: RedisApi) -> bytes:
    """The bytes a duplicate's ``loads()`` would get for ``payload``: as the client
    encodes it for Redis and, with ``decode_responses=True``, decodes it on the way back.

    Raises:
        UnicodeError: the payload cannot be encoded, or read back, in the client's
            encoding (a ``decode_responses=True`` client reading bytes that are not text).
    """
    encoding, errors = encoding_of(redis)
    data = payload if isinstance(payload, bytes) else payload.encode(encoding, errors)
    if redis.get_encoder().decode_responses:
        data = data.decode(encoding, errors).encode(encoding, errors)
    return data


def _text(payload: object, redis: RedisApi) -> str:
    """A marker's cause, as text (whatever the client's ``decode_responses``)."""
    if isinstance(payload, bytes):
        return payload.decode(encoding_of(redis)[0], "replace")
    return str(payload)


def _as_bytes(payload: object, redis: RedisApi) -> bytes:
    """A stored payload as bytes (a ``decode_responses=True`` client decoded it)."""
    if isinstance(payload, bytes):
        return payload
    encoding, errors = encoding_of(redis)
    return str(payload).encode(encoding, errors)
