"""``every()``: a scheduled job that runs once per tick across servers, whatever their
clocks say.

Design note. Every server calls ``every()`` with the same name; each computes the ticks by
its own wall clock (``time.time()``). At each tick it first claims the tick,
``SET <prefix>{name}:tick:<tick ms> NX``: only the server whose claim landed goes on, the
others return quietly (losing that race is the normal case, logged at debug level). The
claimant then takes the job's lease without waiting and runs the job under it, so runs
never overlap: if the lease is held, a run of an earlier tick still goes on somewhere,
and the tick is skipped with a warning (every holder of the lease claimed a tick first,
so this warning means a real overlap, never a lost race). A server whose clock is late
fires the same tick later, finds the claim, and skips it: the claim is kept for a period
(the gap to the next tick, for cron), so a clock late by less than half a period never
runs a tick twice (the claim outlives any such late firing, and a later tick has a claim
of its own). Ticks missed while a run lasted, or while the process slept, are not caught
up: a server that wakes for its tick more than half a period late (stopped, or its event
loop stalled) skips it, since the claim of a server that ran it in time may have expired
by then; a tick whose claim Redis did not answer is skipped too (logged), and the
schedule goes on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from redis.exceptions import RedisError

from .._base._exceptions import LockBusy, LockLost
from .._base._optional import import_optional
from .._base._options import MAX_TTL, Client, LeaseOptions, _number, _positive
from .._lifecycle._context import lease
from .._redis._valkey import valkey_errors
from ._current import running_under

__all__ = ["every"]

log = logging.getLogger("asynclock")

_DEFAULT_TTL = 30.0


async def every(
    redis: Client,
    name: str,
    period: float | timedelta | None,
    func: Callable[..., Awaitable[object]],
    *args: Any,
    offset: float | timedelta = 0.0,
    ttl: float | timedelta | None = None,
    cron: str | None = None,
    prefix: str = "asynclock:",
) -> NoReturn:
    """Run ``await func(*args)`` at every tick, on exactly one of the servers that call
    this with the same ``name``; runs until cancelled.

    Ticks are ``offset + k * period`` seconds of the Unix epoch by the wall clock (so
    ``period=3600, offset=900`` is a quarter past every hour, UTC), or the times of the
    ``cron`` expression (UTC; needs the ``asynclock[cron]`` extra) with ``period=None``.
    A tick stays marked done for a period, so a server whose clock is late by less than
    half a period skips it. Runs never overlap: a tick whose previous run is still going
    on (on any server) is skipped and logged; missed ticks are not caught up. An exception
    of ``func``, or a lost lease (the run is cancelled), is logged and the schedule goes on.

    Args:
        period: seconds between ticks, or None with ``cron``.
        offset: seconds added to each multiple of ``period``.
        ttl: the lease's time to live while a run lasts (renewed every ttl/3); default
            30 s.
        cron: a cron expression (5 fields, UTC) instead of ``period``.

    Raises:
        TypeError, ValueError: bad arguments, before any I/O.
        ModuleNotFoundError: ``cron`` without the ``asynclock[cron]`` extra (``croniter``;
            the message says ``pip install 'asynclock[cron]'``), before any I/O.
    """
    ticks = _ticks(period, offset, cron)
    lease_ttl = _DEFAULT_TTL if ttl is None else _positive("ttl", ttl)
    LeaseOptions.cached(
        redis, name, {"ttl": lease_ttl, "blocking": False, "prefix": prefix}
    )  # (checked now)
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    while True:
        tick, until_next = ticks(time.time())
        await asyncio.sleep(max(0.0, tick - time.time()))
        late = time.time() - tick
        if late > until_next / 2:  # (past the claim's promise: see the design note)
            log.warning(
                "skipped the tick of %r at %s: woke %.3fs after it (a stopped process or a "
                "stalled event loop); missed ticks are not caught up",
                name,
                _at(tick),
                late,
            )
            continue
        await _run_tick(redis, name, tick, until_next, func, args, lease_ttl, prefix)


_UNANSWERED: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
"""What a claim that Redis did not answer raises (a refusal too: ``RedisError``)."""


async def _run_tick(
    redis: Client,
    name: str,
    tick: float,
    keep: float,
    func: Callable[..., Awaitable[object]],
    args: tuple[Any, ...],
    ttl: float,
    prefix: str,
) -> None:
    """Run the tick at ``tick`` (Unix time) here, unless another server did or a run
    still goes on; its done mark is kept ``keep`` seconds."""
    mark = f"{prefix}{{{name}}}:tick:{round(tick * 1000)}"
    try:
        claimed = await redis.set(mark, "claimed", nx=True, px=_ms(keep))
    except _UNANSWERED + valkey_errors() as exc:  # (Redis unreachable a moment: go on)
        log.warning("could not claim the tick of %r at %s, skipped: %r", name, _at(tick), exc)
        return
    if not claimed:
        log.debug("the tick of %r at %s runs on another server", name, _at(tick))
        return
    try:
        async with lease(redis, name, ttl=ttl, blocking=False, prefix=prefix) as held:
            try:
                with running_under(held):
                    await func(*args)
            except Exception:
                log.exception("the run of %r for the tick at %s failed", name, _at(tick))
    except LockBusy:
        log.warning(
            "skipped the tick of %r at %s: its previous run is still going on",
            name,
            _at(tick),
        )
    except LockLost as lost:
        log.error("the run of %r for the tick at %s was stopped: %s", name, _at(tick), lost)
    except Exception:
        log.exception("the tick of %r at %s could not be run", name, _at(tick))


def _ticks(period: object, offset: object, cron: object) -> Callable[[float], tuple[float, float]]:
    """``ticks(now)``: the next tick after ``now`` (Unix time) and the gap after it."""
    if cron is not None:
        if period is not None:
            raise ValueError("give period or cron, not both (period=None with cron)")
        if not isinstance(cron, str):
            raise TypeError(f"cron must be a str, not {type(cron).__name__}")
        return _cron_ticks(cron)
    if period is None:
        raise ValueError("period must be given (seconds), or cron with period=None")
    step = _positive("period", period)
    if step > MAX_TTL:
        raise ValueError(f"period must be at most {MAX_TTL:.0f}s, got {period!r}")
    shift = _number("offset", offset) % step

    def ticks(now: float) -> tuple[float, float]:
        return (math.floor((now - shift) / step) + 1) * step + shift, step

    return ticks


def _cron_ticks(expression: str) -> Callable[[float], tuple[float, float]]:
    croniter = import_optional("croniter", "cron", "every(cron=...)").croniter
    if not croniter.is_valid(expression):
        raise ValueError(f"cron is not a valid cron expression: {expression!r}")

    def ticks(now: float) -> tuple[float, float]:
        start = datetime.fromtimestamp(now, UTC)
        times = croniter(expression, start)
        tick = float(times.get_next(float))
        return tick, float(times.get_next(float)) - tick

    return ticks


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _at(tick: float) -> str:
    return datetime.fromtimestamp(tick, UTC).isoformat(timespec="milliseconds")
