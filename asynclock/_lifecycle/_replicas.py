"""Confirming an acquisition with replicas (``min_replicas``).

Design note. Redis replicates asynchronously: a primary that dies after granting a lease
and before any replica received it is replaced by a replica that never saw the lease, and
that one grants the lock again. ``WAIT n timeout`` makes a connection wait until ``n``
replicas have acknowledged every write it has sent so far. It has to follow a write on
the same connection, and the acquire may have travelled on another one (the lane, the
overflow pool, or a releaser's HANDOFF that handed the lease over), so the confirmation
sends the lease's own renewal (its kind's owner-checked renew script, see the seam in
``docs/architecture.md``) and ``WAIT`` behind it in one write, on one connection. The
replication stream is one ordered log: a replica that acknowledged the renewal has the
acquisition, which came before it.

The watchdog confirms each renewal the same way (one ``WAIT``, and ``WAITAOF``, behind a
batch of renewals); an acquisition that is not confirmed is given back at once (``hold_at_least``
set aside: nobody ran under it) and ``ReplicationTimeout`` raised, so it counts as not
acquired. A cancellation during the confirmation gives the lease back too.

What it does not cover: a replica that acknowledged and then lost the write (it
restarted without persistence before the failover), and a failover that promotes a
replica which did not acknowledge (``min_replicas`` lower than the replicas the failover
may choose from). ``WAIT`` acknowledges memory, not disk: with ``wait_aof`` a
``WAITAOF 0 n`` follows it, which counts only the replicas that have written the writes
to their append-only file (a replica without one never counts).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

from redis.exceptions import MaxConnectionsError, NoScriptError, RedisError, ResponseError

from .._base._exceptions import LockLost, LossReason, ReplicationTimeout
from .._base._options import replicas_confirmed
from .._redis._compat import connection_errors
from .._redis._lane import exchange
from .._redis._scripts import refused_as_command, renewed
from .._session._connections import Companion
from ._release import Wake, after_release, release

if TYPE_CHECKING:
    from ._lease import Tenure

__all__ = ["confirm_replicas"]


async def confirm_replicas(held: Tenure) -> None:
    """Have ``held``'s ``min_replicas`` replicas confirm it, or give it back.

    Raises:
        ReplicationTimeout: fewer replicas confirmed within the wait (or Redis did not
            answer in time, or refused: the error is its ``__cause__``); the lease was
            given back.
        LockLost: the key was not ours any more when it was to be confirmed (deleted or
            expired since the grant: ``not_owner``); nothing to give back.
        asyncio.CancelledError: the caller was cancelled; the lease was given back.
        redis.exceptions.ResponseError: ``wait_aof`` on a server without ``WAITAOF``
            (before 7.2); the lease was given back.
    """
    options = held.options
    wanted = options.min_replicas
    commands = options.confirmation(wanted, options.replica_wait_ms)
    wait_ms = options.replica_wait_ms * options.confirmation_steps  # (the most in all)
    error: BaseException | None = None
    confirmed = -1
    try:  # (whatever fails, a cancellation too, gives the lease back)
        try:
            async with asyncio.timeout(wait_ms / 1000 + options.release_timeout):
                confirmed = await _renew_and_wait(held, commands, wait_ms)
        except (RedisError, OSError, TimeoutError) as exc:
            error = exc
        unknown = isinstance(error, ResponseError) and "unknown command" in str(error).lower()
        if options.wait_aof and unknown:
            raise ResponseError(
                "wait_aof=True needs a server with WAITAOF (Redis or Valkey 7.2 and later): "
                f"{error}"
            ) from error
        if confirmed == _NOT_OURS:  # (the give-back finds it not ours: the lease is lost)
            raise LockLost(options.name, LossReason.NOT_OWNER)
        if confirmed < wanted:
            raise ReplicationTimeout(options.name, wanted, confirmed, wait_ms / 1000) from error
        if held.time_left < options.ttl / 3:
            # Confirmed, but so late that too little of the lease is left to hand it out
            # (as for an acquire answered late): it does not count either.
            raise ReplicationTimeout(options.name, wanted, -1, wait_ms / 1000)
    except BaseException:
        await _give_back(held)
        raise


_NOT_OURS = -2


async def _renew_and_wait(
    held: Tenure, commands: tuple[tuple[str | int, ...], ...], wait_ms: int
) -> int:
    """Renew ``held`` and ``WAIT`` (or ``WAITAOF``) behind it on one connection: the
    replicas that acknowledged, or ``_NOT_OURS`` if the renewal found the key not ours.
    Raises the error reply of either command (READONLY after a failover, say)."""
    companion = held.companion
    waits = b"".join(companion.pack(*c) for c in commands)
    count = 1 + len(commands)

    def packed() -> bytes:
        tail = held.renew_tail()  # (first: it says which head goes before it)
        return held.renew_head + tail + waits

    # (on the lane: its connections stay open while leases come and go, where a pool
    # of our own would be closed with the last lease and reopened by the next)
    replies = await _send(companion, packed(), count, wait_ms)
    if held.by_command and refused_as_command(replies[0]):  # (see Watchdog._send)
        held.renew_by_script()
        replies = await _send(companion, packed(), count, wait_ms)
    if isinstance(replies[0], NoScriptError):  # (a fresh or restarted server)
        with connection_errors():
            await companion.client.script_load(held.renew_script.source)
        replies = await _send(companion, packed(), count, wait_ms)
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    if not renewed(replies[0]):
        return _NOT_OURS
    return replicas_confirmed(replies[-1])


async def _send(companion: Companion, packed: bytes, count: int, wait_ms: int) -> list[object]:
    """The renewal and WAIT (``count`` replies), on the lane, or asynclock's own pool
    when the caller's is exhausted (nothing was sent then); on the renewals' connections
    (no socket time limit: the caller's is the bound) when the lane's socket time limit
    would end the exchange before WAIT does."""
    limit = companion.settings.get("socket_timeout")
    if limit is not None and limit < wait_ms / 1000 + _MARGIN:
        return await exchange(companion.renewer(), packed, count)
    try:
        return cast(list[object], await companion.lane.call(packed, None, count, alone=True))
    except MaxConnectionsError:
        return await exchange(companion.overflow(), packed, count)


_MARGIN = 0.5  # seconds beyond WAIT's own for the exchange around it


async def _give_back(held: Tenure) -> None:
    """Release ``held`` at once, shielded, as an acquisition that did not count."""
    held.not_confirmed()
    wake = Wake.OURS
    try:
        wake = await release(held)
    finally:
        await after_release(held, wake)
