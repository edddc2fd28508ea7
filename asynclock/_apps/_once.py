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
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, ParamSpec, Protocol, TypeVar, runtime_checkable

from .._base._exceptions import IdempotencyConflict, LockLost, LossReason
from .._base._options import MAX_TTL, Client, LeaseOptions, _positive
from .._kinds._mutex import Job, JobConflict, JobDone
from .._lifecycle._take import take
from .._redis._lane import encoding_of

__all__ = ["Serializer", "forget", "idempotent", "once"]

P = ParamSpec("P")
T = TypeVar("T")

_RESULT_SUFFIX = ":result"


@runtime_checkable
class Serializer(Protocol):
    """How ``once()`` stores results: ``dumps(obj) -> bytes | str`` and
    ``loads(data: bytes) -> obj``."""

    def dumps(self, obj: Any, /) -> bytes | str: ...

    def loads(self, data: bytes, /) -> Any: ...


class _Json:
    """The default serializer: what ``json`` round-trips."""

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
    result; a duplicate call returns the stored result instead of running it again.

    - A result stored for ``key`` is returned at once (one round trip), deserialized.
    - Otherwise the caller takes the lease ``key`` (watchdog, safe deadline, loss
      cancels ``func``) and runs ``func``; on success the result is stored (for
      ``result_ttl`` seconds) and the lease released in one owner-checked step.
    - Duplicates that arrive meanwhile, in any process, wait, are woken when the result is
      stored (or the lease given back), and return the stored result.
    - ``func`` raises: its caller gets the exception, nothing is stored, and a waiting
      duplicate runs ``func`` in turn (at least once until one succeeds).
    - The holder's process dies: a duplicate runs ``func`` once its lease expires (within
      ``ttl``). The job may then have run twice in part: effects that must happen exactly
      once need the fencing token checked where they are written.

    Args:
        key: the job's name (a lock name: non-empty, not starting with ``}``).
        ttl: the lease's time to live, seconds, renewed every ttl/3 while ``func`` runs.
        result_ttl: seconds the result is kept.
        fingerprint: a digest of the job's payload (``str`` or ``bytes``); a call for the
            same key with another fingerprint, while the job runs or once it finished,
            raises ``IdempotencyConflict``. None checks nothing.
        blocking_timeout: the most seconds to wait for a result or the lease; None waits.
        serializer: JSON by default; any object with ``dumps(obj) -> bytes | str`` and
            ``loads(data: bytes) -> obj``. With a ``decode_responses=True`` client the
            payload must be text in the client's encoding.

    Raises:
        IdempotencyConflict: another fingerprint was stored for ``key``; ``func`` not run.
        AcquireTimeout: neither a result nor the lease came within ``blocking_timeout``.
        LockLost: the lease was lost while ``func`` ran (it was cancelled), or before its
            result could be stored: nothing was stored.
        TypeError: the result cannot be serialized (nothing stored, the lease given
            back), or an argument has the wrong type (before any I/O, as ``ValueError``).
        redis.exceptions.RedisError: Redis refused or could not be reached.
        Whatever ``func`` raised.
    """
    options = LeaseOptions.cached(redis, key, ttl, True, blocking_timeout, 2.0, prefix)
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    result_ms = _result_ttl_ms(result_ttl)
    digest = _digest(fingerprint)
    codec = _codec(serializer)
    job = Job(options.key + _RESULT_SUFFIX, digest)
    try:
        held = await take(redis, options, None, job)
    except JobDone as done:
        return codec.loads(_as_bytes(done.payload, redis))  # type: ignore[no-any-return]
    except JobConflict:
        raise IdempotencyConflict(key) from None
    held._start(None)
    try:
        async with held.guard():
            result = await func(*args)
        payload = _dumps(codec, result)
    except BaseException:
        await held.release()  # (a loss is the error in flight's note, or LockLost)
        raise
    stored = await held._store_and_release(
        [options.key, job.result_key], [payload, result_ms, digest]
    )
    if stored is False:
        raise LockLost(key, LossReason.NOT_OWNER, "the result was not stored")
    return result


def idempotent(
    redis: Client,
    *,
    key: Callable[..., str],
    fingerprint: Callable[..., str | bytes | None] | None = None,
    ttl: float | timedelta = 30.0,
    result_ttl: float | timedelta = 86400.0,
    blocking_timeout: float | timedelta | None = None,
    prefix: str = "asynclock:",
    serializer: Serializer | None = None,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
    """``@idempotent(redis, key=lambda order: f"charge:{order.id}")``: every call of the
    decorated coroutine function goes through :func:`once`, keyed by ``key(*args,
    **kwargs)`` (and fingerprinted by ``fingerprint(*args, **kwargs)`` if given); the
    other options are ``once()``'s, checked here, before any I/O.
    """
    if not callable(key):
        raise TypeError(f"key must be a callable of the function's arguments, not {key!r}")
    if fingerprint is not None and not callable(fingerprint):
        raise TypeError(f"fingerprint must be a callable or None, not {fingerprint!r}")
    LeaseOptions.cached(redis, "idempotent", ttl, True, blocking_timeout, 2.0, prefix)
    _result_ttl_ms(result_ttl)
    _codec(serializer)

    def decorate(func: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        @functools.wraps(func)
        async def run(*args: P.args, **kwargs: P.kwargs) -> T:
            bound: Callable[..., Awaitable[T]] = (
                functools.partial(func, **kwargs) if kwargs else func
            )
            return await once(
                redis,
                key(*args, **kwargs),
                bound,
                *args,
                ttl=ttl,
                result_ttl=result_ttl,
                fingerprint=None if fingerprint is None else fingerprint(*args, **kwargs),
                blocking_timeout=blocking_timeout,
                prefix=prefix,
                serializer=serializer,
            )

        return run

    return decorate


async def forget(redis: Client, key: str, *, prefix: str = "asynclock:") -> bool:
    """Delete the result stored for ``key`` by :func:`once`, so that the next call runs
    the job again (reprocessing on purpose). Returns whether there was one. A job that is
    running is not stopped: it stores its result when it ends.
    """
    options = LeaseOptions.cached(redis, key, 10.0, True, None, 2.0, prefix)
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
    try:
        payload = codec.dumps(result)
    except Exception as exc:
        raise TypeError(
            f"the result of the job cannot be serialized ({exc}); nothing was stored"
        ) from exc
    if not isinstance(payload, bytes | str):
        raise TypeError(
            f"the serializer's dumps() returned {type(payload).__name__}, not bytes or str"
        )
    return payload


def _as_bytes(payload: object, redis: Client) -> bytes:
    """A stored payload as bytes (a ``decode_responses=True`` client decoded it)."""
    if isinstance(payload, bytes):
        return payload
    encoding, errors = encoding_of(redis)
    return str(payload).encode(encoding, errors)
