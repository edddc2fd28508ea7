"""``asynclock run NAME -- CMD ARGS...``: run a command under a lease, for ``crontab``
entries on every machine.

Design note. The command runs as a child process while the lease is held. Its exit
status becomes ours. If the lock is busy the command is not run (exit ``--busy-exit``,
0 by default: another machine has this run). The child must be gone before another
holder could take the lock, so it is stopped ahead of the lease's safe deadline: while
renewals fail (the lease turns SUSPECT), it gets SIGTERM at once and SIGKILL ``grace``
seconds later, or ``margin`` seconds before that deadline if that comes first; once the
lease is lost outright (the key is not ours any more) SIGTERM comes at once and SIGKILL
``grace`` later. The command's exit ends the lease at once. SIGTERM and SIGINT sent to
us are passed on to the child, whose status we then return.

The command leads a session (and process group) of its own, and every signal goes to
that group: a shell script's children are stopped with it. When the command is stopped,
what is left of its group after the grace (children that outlived it) gets SIGKILL.

None of that can happen while we are stopped, killed or our event loop is blocked, so a
reaper process (``_reaper.py``, a dead man's switch) is told the safe deadline, moved at
each confirmed renewal, and stops the command there on its own, or at once if we die.
The command's environment carries the lease: ``ASYNCLOCK_FENCING_TOKEN``,
``ASYNCLOCK_LEASE_KEY`` and ``ASYNCLOCK_LEASE_TTL`` (``command_environment``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from .._base._events import LeaseEvent
from .._base._exceptions import AcquireTimeout, LockBusy, LockLost
from .._base._urls import safe_url
from .._lifecycle._context import lease
from .._lifecycle._lease import Lease, LeaseState
from .._redis._valkey import family_named, valkey_errors
from ._reaper import GROUP_POLL, MARGIN, Reaper, group_alive, signal_group

__all__ = ["EXIT_LOST", "EXIT_UNAVAILABLE", "RunConfig", "command_environment", "run_command"]

EXIT_LOST: Final = 75
"""Exit status when the lease was lost and the command was stopped (EX_TEMPFAIL)."""

EXIT_UNAVAILABLE: Final = 69
"""Exit status when Redis could not be reached or refused us (EX_UNAVAILABLE)."""

_UNREACHABLE: Final = (RedisError, OSError)  # Redis could not be reached, or refused us


@dataclass(frozen=True)
class RunConfig:
    """What ``asynclock run`` was asked to do. Times in seconds."""

    name: str
    command: Sequence[str]
    url: str
    ttl: float = 30.0
    hold_at_least: float | None = None
    wait: float = 0.0
    grace: float | None = None
    busy_exit: int = 0
    prefix: str = "asynclock:"
    client: str = "redis"
    """The client library: ``"redis"`` (redis-py) or ``"valkey"`` (valkey-py)."""

    @property
    def kill_grace(self) -> float:
        """Seconds between SIGTERM and SIGKILL: ``grace``, or ttl / 6 (at most 10)."""
        return self.grace if self.grace is not None else min(10.0, self.ttl / 6)


def _say(message: str) -> None:
    print(f"asynclock run: {message}", file=sys.stderr, flush=True)


def _status(returncode: int) -> int:
    """A child's return code as a shell reports it (128 + N for signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def command_environment(held: Lease) -> dict[str, str]:
    """The command's environment: ours, plus the lease it runs under
    (``ASYNCLOCK_FENCING_TOKEN``: the lease's fencing token, for the command to fence its
    writes; ``ASYNCLOCK_LEASE_KEY``: its Redis key; ``ASYNCLOCK_LEASE_TTL``: its TTL in
    seconds)."""
    return {
        **os.environ,
        "ASYNCLOCK_FENCING_TOKEN": str(held.fencing_token),
        "ASYNCLOCK_LEASE_KEY": held.key,
        "ASYNCLOCK_LEASE_TTL": f"{held.ttl:g}",
    }


async def run_command(config: RunConfig) -> int:
    """Run ``config.command`` under the lease ``config.name``; returns the exit status
    (the command's, ``busy_exit``, ``EXIT_LOST`` or ``EXIT_UNAVAILABLE``)."""
    changed = asyncio.Event()  # set at every renewal, failed renewal and loss

    def on_event(_event: LeaseEvent) -> None:
        changed.set()

    redis: Redis = family_named(config.client).client.from_url(config.url)
    try:
        async with lease(
            redis,
            config.name,
            ttl=config.ttl,
            blocking=config.wait > 0,
            blocking_timeout=config.wait if config.wait > 0 else None,
            hold_at_least=config.hold_at_least,
            prefix=config.prefix,
            on_event=on_event,
        ) as held:
            return await _supervise(config, held, changed)
    except (LockBusy, AcquireTimeout):
        _say(f"{config.name!r} is held by another holder; not running the command")
        return config.busy_exit
    except LockLost as lost:
        _say(f"the lease {config.name!r} was lost ({lost.reason}); the command was stopped")
        return EXIT_LOST
    except _UNREACHABLE + valkey_errors() as exc:  # (valkey-py's: --client valkey)
        _say(f"could not reach Redis at {safe_url(config.url)}: {exc}")
        return EXIT_UNAVAILABLE
    finally:
        with contextlib.suppress(Exception):
            await redis.aclose()


async def _supervise(config: RunConfig, held: Lease, changed: asyncio.Event) -> int:
    """Start the reaper, then the child, and wait for the child, returning as soon as it
    exits; once renewals fail, stop it at once, so that it is gone before the lease's
    safe deadline."""
    reaper = await _start_reaper(config, held)
    exited: asyncio.Future[int] | None = None
    try:
        try:
            child = await asyncio.create_subprocess_exec(
                *config.command, env=command_environment(held), start_new_session=True
            )
        except OSError as exc:
            _say(f"cannot run {config.command[0]!r}: {exc}")
            return 127 if isinstance(exc, FileNotFoundError) else 126
        if reaper is not None:
            reaper.watch(child.pid)
        exited = asyncio.ensure_future(child.wait())
        loop = asyncio.get_running_loop()
        forwarded = _forward_signals(loop, child)
        try:
            return await _watch(config, held, changed, child, exited, reaper)
        finally:
            for signum in forwarded:
                loop.remove_signal_handler(signum)
    finally:
        if reaper is not None:
            with anyio.CancelScope(shield=True):
                await reaper.close(command_exited=exited is None or exited.done())


async def _start_reaper(config: RunConfig, held: Lease) -> Reaper | None:
    """The command's dead man's switch, started before it (None if it cannot be had:
    said; the command then runs without it)."""
    try:
        return await Reaper.start(config.kill_grace, held.safe_until)
    except OSError as exc:
        _say(f"cannot start the reaper, the command runs without it: {exc}")
        return None


async def _watch(
    config: RunConfig,
    held: Lease,
    changed: asyncio.Event,
    child: asyncio.subprocess.Process,
    exited: asyncio.Future[int],
    reaper: Reaper | None,
) -> int:
    """Wait for the child, moving the reaper's deadline at each renewal; stop the child
    once renewals fail (``EXIT_LOST``), or when we are cancelled (then re-raised)."""
    loop = asyncio.get_running_loop()
    stopping = False  # (SIGTERM sent: a loss arriving now kills without more grace)
    try:
        while not exited.done():
            changed.clear()
            if held.state is LeaseState.SUSPECT:
                _say(
                    f"renewals of the lease {config.name!r} are failing; stopping the "
                    "command before the lease's safe deadline"
                )
                stopping = True
                with anyio.CancelScope(shield=True):  # (the deadline bounds it anyway)
                    await _stop(child, exited, _kill_after(config, held, loop))
                return EXIT_LOST
            if reaper is not None:
                reaper.move(held.safe_until)
            notice = asyncio.ensure_future(changed.wait())
            either: set[asyncio.Future[Any]] = {exited, notice}
            try:
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            finally:
                notice.cancel()
        if exited.result() < 0 and reaper is not None and reaper.fired():
            _say(
                f"the lease {config.name!r} came within --grace of its deadline unrenewed; "
                "the reaper stopped the command"
            )
            return EXIT_LOST
        return _status(exited.result())
    except asyncio.CancelledError:
        # The lease was lost (LockLost follows) or we were cancelled: stop the child
        # first, shielded, within the grace (none left once SIGTERM was sent).
        with anyio.CancelScope(shield=True):
            await _stop(child, exited, 0.0 if stopping else config.kill_grace)
        raise


def _kill_after(config: RunConfig, held: Lease, loop: asyncio.AbstractEventLoop) -> float:
    """Seconds from now to SIGKILL: ``--grace``, cut short so that the child is gone
    ``MARGIN`` seconds before the lease's safe deadline."""
    return max(0.0, min(config.kill_grace, held.safe_until - MARGIN - loop.time()))


async def _stop(
    child: asyncio.subprocess.Process, exited: asyncio.Future[int], grace: float
) -> None:
    """SIGTERM to the child's process group, then, after ``grace`` seconds or once the
    group is empty, SIGKILL to what is left of it."""
    if child.returncode is not None:
        return
    loop = asyncio.get_running_loop()
    ends = loop.time() + grace
    _send(child, signal.SIGTERM)
    await asyncio.wait({exited}, timeout=grace)
    while group_alive(child.pid) and loop.time() < ends:  # noqa: ASYNC110 (no event for it)
        await asyncio.sleep(GROUP_POLL)
    signal_group(child.pid, signal.SIGKILL)
    await exited


def _forward_signals(
    loop: asyncio.AbstractEventLoop, child: asyncio.subprocess.Process
) -> list[int]:
    """Pass SIGTERM and SIGINT on to the child (its status is then ours)."""
    forwarded: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, _send, child, signum)
        except (NotImplementedError, RuntimeError):  # (not the main thread, not POSIX)
            continue
        forwarded.append(signum)
    return forwarded


def _send(child: asyncio.subprocess.Process, signum: int) -> None:
    """``signum`` to the child's process group, while the child is not reaped (so its
    pid, the group's id, is not another's)."""
    if child.returncode is None:
        signal_group(child.pid, signum)
