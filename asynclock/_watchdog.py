"""The watchdog: renews a held lease every ttl/3 until its block exits.

Design note. A lease is valid until ``safe_until = t_send + ttl - drift``, where ``t_send``
is the loop time just before the last *confirmed* acquire or renew command was sent:
Redis set the key's expiry after it received that command, so the key cannot expire
before ``t_send + ttl`` unless the server's clock runs fast, which ``drift`` allows for.

Renewing every ttl/3 (from the last confirmed ``t_send``) leaves two thirds of the TTL
to confirm a renewal: a slow or failed attempt is retried, with a short backoff, while
time remains. Each attempt has its own time limit (at most ttl/3, never past the
deadline), so one hung connection cannot hold the watchdog past the deadline.

The watchdog does not declare the deadline loss itself: a loop timer armed at
``safe_until`` does (see ``Lease._arm``), so the body is cancelled at the deadline even
while a renewal command is still in flight. A reply of 0 means the key no longer holds
our token: lost at once, no retry can bring it back. Any other failure (timeout,
connection error, NOSCRIPT handled by the script runner, a failover's READONLY/LOADING)
leaves the outcome unknown: the lease turns SUSPECT and the deadline does not move.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from ._exceptions import LossReason

if TYPE_CHECKING:
    from ._lease import Lease

__all__ = ["report_stall", "watch"]

log = logging.getLogger("asynclock")


def report_stall(lease: Lease, due: float, now: float, what: str) -> None:
    """Log a warning if a timer of ``lease`` ran much later than ``due`` (loop times).

    Lateness means the event loop (or the whole process) was stalled: a blocking call in
    a coroutine, a long CPU-bound stretch, a GC pause, SIGSTOP. Code that does not await
    cannot be cancelled, so the guarded work may have run past the lease's deadline.
    """
    late = now - due
    if late > max(0.1, lease.ttl / 6):
        log.warning(
            "asynclock: event loop stall of %.3fs detected (%s of lease %r ran late); "
            "nothing that does not await can be interrupted, so the guarded work may have "
            "overlapped another holder: rely on the fencing token",
            late,
            what,
            lease.name,
        )


async def watch(lease: Lease) -> None:
    """Renew ``lease`` until it ends. Never raises except ``CancelledError``."""
    loop = asyncio.get_running_loop()
    try:
        while lease._active:
            due = lease._last_send + lease.ttl / 3
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
                report_stall(lease, due, loop.time(), "the renewal")
            backoff = min(lease.ttl / 30, 0.05)
            while lease._active:
                remaining = lease.safe_until - loop.time()
                if remaining <= 0:
                    return  # the deadline timer declares the loss
                try:
                    renewed = await lease._renew_once(min(remaining, lease.ttl / 3))
                except (RedisError, OSError, TimeoutError) as exc:
                    if not lease._active:
                        return
                    lease._suspect(exc)
                    pause = backoff * random.uniform(0.5, 1.0)
                    await asyncio.sleep(min(pause, max(lease.safe_until - loop.time(), 0)))
                    backoff = min(backoff * 2, lease.ttl / 10, 1.0)
                    continue
                if not renewed:
                    return
                break
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        lease._lose(LossReason.WATCHDOG_FAILED, exc)
