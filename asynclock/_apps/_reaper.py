"""The dead man's switch of ``asynclock run``: a small process that stops the command at
the lease's safe deadline, whatever becomes of the supervisor.

Design note. The supervisor (``asynclock run``, ``_runner.py``) stops its command itself
when renewals fail, but it cannot while it is stopped (``SIGSTOP``), killed or its event
loop blocked, and the lease then expires under a running command. So, once the command
runs, the supervisor starts this module as a script (``python -I -S _reaper.py PIDFD
GRACE``: the standard library only, no import of the package, a session of its own so
that signals to the supervisor's process group do not reach it) and hands it a pidfd of
the command (``pidfd_send_signal``: no risk of signalling a reused pid) and, on its
stdin, one line per change, ``<deadline>\\n``: the ``time.monotonic()`` second by which
the command must be gone (the lease's safe deadline: CLOCK_MONOTONIC is system-wide on
Linux), moved forward at each confirmed renewal, or ``done\\n`` when the command has
exited. Until told a later deadline, the reaper sends the command ``SIGTERM`` at
``deadline - grace`` and ``SIGKILL`` at ``deadline - MARGIN`` (:func:`signal_times`, the
one owner of that rule: the supervisor reads the same to tell a command the switch
stopped). EOF on stdin means the supervisor died: ``SIGTERM`` at once, ``SIGKILL`` after
the grace, never later than ``deadline - MARGIN``.

The reaper never outlives the command for long: it exits as soon as the command has
exited (the pidfd turns readable), on ``done``, and at most ``_AFTER_KILL`` seconds after
its ``SIGKILL``; it never waits on anything but its stdin and the pidfd. It signals the
command's process only (as the supervisor does), not the command's own children. Left
open: the few milliseconds between the command's start and the reaper's, in which a
stopped supervisor has no switch yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import signal
import sys
import time
from typing import Final

__all__ = ["MARGIN", "Reaper", "signal_times"]

MARGIN: Final = 0.1
"""Seconds before the safe deadline by which the command is killed (``SIGKILL``)."""

DONE: Final = b"done\n"
"""The line telling the reaper that the command exited: nothing more to do."""

_AFTER_KILL: Final = 5.0  # seconds the reaper waits for the command to die after SIGKILL
_CLOSE_WAIT: Final = 2.0  # seconds the supervisor waits for its reaper to exit when told


def signal_times(deadline: float, grace: float) -> tuple[float, float]:
    """When the reaper sends ``SIGTERM`` and ``SIGKILL`` for a command that must be gone
    by ``deadline`` (``time.monotonic()`` seconds), ``grace`` seconds between them at
    most: ``(deadline - grace, deadline - MARGIN)``, the first never after the second."""
    kill_at = deadline - MARGIN
    return min(deadline - grace, kill_at), kill_at


class Reaper:
    """The supervisor's handle on its reaper process (see the module's design note)."""

    def __init__(self, process: asyncio.subprocess.Process, grace: float) -> None:
        self._process = process
        self._grace = grace
        self._deadline = -math.inf  # (the last deadline told, time.monotonic() seconds)

    @classmethod
    async def start(cls, pid: int, grace: float, deadline: float) -> Reaper | None:
        """Start the reaper of the command ``pid``, which must be gone by ``deadline``
        (event-loop seconds), ``grace`` seconds between its ``SIGTERM`` and ``SIGKILL``.
        None when the command has exited already.

        Raises:
            OSError: no pidfd on this system (Linux 5.3 or later is needed), or the
                reaper process could not be started.
        """
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", __file__, str(pidfd), repr(grace),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
                pass_fds=(pidfd,), start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(pidfd)
        reaper = cls(process, grace)
        reaper.move(deadline)
        return reaper

    def move(self, deadline: float) -> None:
        """Tell the reaper the command may run until ``deadline`` (event-loop seconds,
        the lease's ``safe_until``), if that is later than the last deadline told."""
        deadline += time.monotonic() - asyncio.get_running_loop().time()
        if deadline <= self._deadline or self._process.stdin is None:
            return
        self._deadline = deadline
        with contextlib.suppress(OSError, RuntimeError):  # (the reaper died: nothing to do)
            self._process.stdin.write(f"{deadline!r}\n".encode())

    def fired(self) -> bool:
        """Whether the reaper's ``SIGTERM`` is due by now (the lease ran out unrenewed)."""
        return time.monotonic() >= signal_times(self._deadline, self._grace)[0]

    async def close(self, command_exited: bool) -> None:
        """End the reaper: ``done`` if the command has exited, else EOF (the reaper then
        stops the command as if we had died). Waits up to ``_CLOSE_WAIT`` seconds for it
        to exit, then kills it."""
        stdin = self._process.stdin
        if stdin is not None:
            with contextlib.suppress(OSError, RuntimeError):
                if command_exited:
                    stdin.write(DONE)
                stdin.close()
        try:
            async with asyncio.timeout(_CLOSE_WAIT + (0.0 if command_exited else self._grace)):
                await self._process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._process.wait()


class _Switch:
    """The reaper's state: the deadline, whether the supervisor is gone, what was sent."""

    def __init__(self, pidfd: int, grace: float) -> None:
        self.pidfd = pidfd
        self.grace = grace
        self.deadline = math.inf  # (no deadline told yet: wait for one, or EOF)
        self.orphaned_at: float | None = None  # when stdin reached EOF
        self.sent: set[int] = set()
        self.killed_at: float | None = None

    def due(self) -> tuple[float, float]:
        """When ``SIGTERM`` and ``SIGKILL`` are due now (monotonic seconds)."""
        term_at, kill_at = signal_times(self.deadline, self.grace)
        if self.orphaned_at is not None:  # the supervisor died: stop the command now
            term_at = min(term_at, self.orphaned_at)
            kill_at = min(kill_at, self.orphaned_at + self.grace)
        return term_at, kill_at

    def act(self, now: float) -> float:
        """Send what is due at ``now``; the seconds until something is next due."""
        term_at, kill_at = self.due()
        for signum, at in ((signal.SIGTERM, term_at), (signal.SIGKILL, kill_at)):
            if at <= now and signum not in self.sent:
                self.sent.add(signum)
                self._send(signum)
                if signum == signal.SIGKILL:
                    self.killed_at = now
        if self.killed_at is not None:
            return max(0.0, self.killed_at + _AFTER_KILL - now)
        pending = [at for signum, at in ((signal.SIGTERM, term_at), (signal.SIGKILL, kill_at))
                   if signum not in self.sent]  # fmt: skip
        return max(0.0, min(pending) - now)

    def _send(self, signum: int) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, signum)
        except ProcessLookupError:  # (it has exited already)
            return
        what = "supervisor is gone" if self.orphaned_at is not None else "lease runs out"
        print(
            f"asynclock run: the {what}; sent {signal.Signals(signum).name} to the command",
            file=sys.stderr,
            flush=True,
        )

    def told(self, line: bytes) -> bool:
        """Take one line from the supervisor; False on ``done``."""
        if line == DONE:
            return False
        try:
            deadline = float(line)
        except ValueError:
            return True  # (not ours: ignore)
        if deadline > self.deadline or self.deadline == math.inf:
            self.deadline = deadline
        return True


def _serve(switch: _Switch) -> None:
    """The reaper's loop: until the command exits, ``done``, or the kill's wait ends."""
    stdin = sys.stdin.fileno()
    poller = select.poll()
    poller.register(switch.pidfd, select.POLLIN)
    poller.register(stdin, select.POLLIN)
    pending = b""
    while True:
        now = time.monotonic()
        wait = switch.act(now)
        if switch.killed_at is not None and wait <= 0:
            return
        timeout_ms = None if math.isinf(wait) else math.ceil(wait * 1000)
        for fd, _ in poller.poll(timeout_ms):
            if fd == switch.pidfd:
                return  # the command has exited
            chunk = os.read(stdin, 4096)
            if not chunk:
                switch.orphaned_at = time.monotonic()
                poller.unregister(stdin)
                continue
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if not switch.told(line + b"\n"):
                    return


def main(argv: list[str]) -> int:
    """``_reaper.py PIDFD GRACE`` (the pidfd inherited, the grace in seconds)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the supervisor decides; EOF ends us)
    switch = _Switch(int(argv[0]), float(argv[1]))
    _serve(switch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
