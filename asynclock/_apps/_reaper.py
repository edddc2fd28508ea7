"""The dead man's switch of ``asynclock run``: a small process that stops the command at
the lease's safe deadline, whatever becomes of the supervisor.

Design note. The supervisor (``asynclock run``, ``_runner.py``) stops its command itself
when renewals fail, but it cannot while it is stopped (``SIGSTOP``), killed or its event
loop blocked, and the lease then expires under a running command. So, before it starts
the command, the supervisor starts this module as a script (``python -I -S _reaper.py
GRACE``: the standard library only, no import of the package, in a session of its own so
that signals to the supervisor's process group do not reach it), waits for its ``ready``
and tells it, one line at a time on its stdin:

- ``<deadline>``: the ``time.monotonic()`` second by which the command must be gone (the
  lease's safe deadline; CLOCK_MONOTONIC is system-wide on Linux), first before the
  command starts, then moved forward at each confirmed renewal;
- ``pid <N>``, right after the command started: the reaper takes a pidfd of it
  (``pidfd_send_signal``: never a reused pid), if it is the supervisor's child;
- ``done``, once the command has exited.

Until told a later deadline, the reaper sends the command ``SIGTERM`` at ``deadline -
grace`` and ``SIGKILL`` at ``deadline - MARGIN`` (:func:`signal_times`, the one owner of
that rule: the supervisor reads the same to tell a command the switch stopped). EOF on
stdin means the supervisor died: ``SIGTERM`` at once, ``SIGKILL`` after the grace, never
later than ``deadline - MARGIN``. A supervisor stopped between the command's start and
its ``pid`` line (the nemesis of ``python -m chaos --jobs run`` found that window) is
covered too: when a signal is due and no pid was told, the reaper takes the supervisor's
child other than itself (a stopped process's children stay listed, and keep their pid
until it reaps them); if the supervisor has none yet, it looks again every
``_LOOK_AGAIN`` seconds, so that a command started after the deadline is stopped at once.

Each signal goes to the command (by its pidfd) and then, as the command leads a process
group of its own (the supervisor starts it in a new session), to that group: the
command's children too. A command that exits while being stopped has what is left of its
group killed when ``SIGKILL`` is due (:meth:`_Switch.after_exit`).

The reaper never outlives the command for long: it exits as soon as the command has
exited (the pidfd turns readable) and its group is dealt with, on ``done``, at EOF when
it knows no command, and at most ``_AFTER_KILL`` seconds after its ``SIGKILL``; it waits
on its stdin and the pidfd only. Left open: a supervisor *killed* between the command's
start and its ``pid`` line (its child is then reparented, and the reaper cannot tell it
from others).
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
from pathlib import Path
from typing import Final

__all__ = ["GROUP_POLL", "MARGIN", "READY", "Reaper", "group_alive", "signal_group", "signal_times"]

MARGIN: Final = 0.1
"""Seconds before the safe deadline by which the command is killed (``SIGKILL``)."""

READY: Final = b"ready\n"
"""What the reaper says on its stdout once it runs."""

DONE: Final = b"done\n"
"""The line telling the reaper that the command exited: nothing more to do."""

_AFTER_KILL: Final = 5.0  # seconds the reaper waits for the command to die after SIGKILL
_LOOK_AGAIN: Final = 0.2  # seconds between two looks for a command it was not told of
_CLOSE_WAIT: Final = 2.0  # seconds the supervisor waits for its reaper to exit when told
_READY_WAIT: Final = 10.0  # seconds the supervisor waits for its reaper to say "ready"


def signal_times(deadline: float, grace: float) -> tuple[float, float]:
    """When the reaper sends ``SIGTERM`` and ``SIGKILL`` for a command that must be gone
    by ``deadline`` (``time.monotonic()`` seconds), ``grace`` seconds between them at
    most: ``(deadline - grace, deadline - MARGIN)``, the first never after the second."""
    kill_at = deadline - MARGIN
    return min(deadline - grace, kill_at), kill_at


# --------------------------------------------------------------------------------------
# The supervisor's side
# --------------------------------------------------------------------------------------


class Reaper:
    """The supervisor's handle on its reaper process (see the module's design note)."""

    def __init__(self, process: asyncio.subprocess.Process, grace: float) -> None:
        self._process = process
        self._grace = grace
        self._deadline = -math.inf  # (the last deadline told, time.monotonic() seconds)
        self._fired = False  # (a SIGTERM came due before a later deadline was told)

    @classmethod
    async def start(cls, grace: float, deadline: float) -> Reaper:
        """Start a reaper for a command about to start, which must be gone by
        ``deadline`` (event-loop seconds), ``grace`` seconds between its ``SIGTERM`` and
        ``SIGKILL``; returns once it runs.

        Raises:
            OSError: no pidfd on this system (Linux 5.3 or later is needed), or the
                reaper could not be started or did not say it was ready (in
                ``_READY_WAIT`` seconds; it is killed then).
        """
        if not hasattr(os, "pidfd_open"):
            raise OSError("no pidfd on this system (Linux 5.3 or later is needed)")
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", __file__, repr(grace),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        reaper = cls(process, grace)
        await reaper._ready()
        reaper.move(deadline)
        return reaper

    async def _ready(self) -> None:
        """Wait for the reaper's ``ready``.

        Raises:
            OSError: it did not say it within ``_READY_WAIT`` seconds (it is killed).
        """
        said = b""
        if self._process.stdout is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_READY_WAIT):
                    said = await self._process.stdout.readline()
        if said != READY:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._process.wait()
            raise OSError(f"the reaper did not start (it said {said!r})")

    def _tell(self, line: bytes) -> None:
        if self._process.stdin is not None:
            with contextlib.suppress(OSError, RuntimeError):  # (it died: nothing to do)
                self._process.stdin.write(line)

    def watch(self, pid: int) -> None:
        """Tell the reaper the command's pid (call it at once after the start)."""
        self._tell(f"pid {pid}\n".encode())

    def move(self, deadline: float) -> None:
        """Tell the reaper the command may run until ``deadline`` (event-loop seconds,
        the lease's ``safe_until``), if that is later than the last deadline told."""
        deadline += time.monotonic() - asyncio.get_running_loop().time()
        if deadline > self._deadline:
            self._fired = self.fired()  # (a renewal confirmed late: it may have fired)
            self._deadline = deadline
            self._tell(f"{deadline!r}\n".encode())

    def fired(self) -> bool:
        """Whether the reaper's ``SIGTERM`` has come due (the lease came within the grace
        of its deadline unrenewed), by now or before a later deadline was told."""
        due = (
            self._deadline > -math.inf
            and time.monotonic() >= signal_times(self._deadline, self._grace)[0]
        )
        return self._fired or due

    async def close(self, command_exited: bool) -> None:
        """End the reaper: ``done`` if the command has exited (or never started), else
        EOF (the reaper then stops the command as if we had died). Waits up to
        ``_CLOSE_WAIT`` seconds (plus the grace) for it to exit, then kills it."""
        if command_exited:
            self._tell(DONE)
        if self._process.stdin is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self._process.stdin.close()
        try:
            async with asyncio.timeout(_CLOSE_WAIT + (0.0 if command_exited else self._grace)):
                await self._process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._process.wait()


# --------------------------------------------------------------------------------------
# The reaper process
# --------------------------------------------------------------------------------------


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (None if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def _children_of(pid: int) -> list[int]:
    """The children of ``pid`` (from ``/proc``; a scan where the kernel lists none)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        found = (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
        return [child for child in found if _parent_of(child) == pid]


class _Switch:
    """The reaper's state: the deadline, the command, whether the supervisor is gone."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.supervisor = os.getppid()
        self.pidfd: int | None = None
        self.pid: int | None = None  # (the command's, once its pidfd is taken)
        self.deadline = math.inf  # (none told yet: nothing is due but at EOF)
        self.orphaned_at: float | None = None  # when stdin reached EOF
        self.sent: set[int] = set()
        self.killed_at: float | None = None
        self.over = False  # (nothing left to do: exit)

    def watch(self, pid: int) -> bool:
        """Take a pidfd of ``pid`` if it is the supervisor's child; False if it is not
        (it has exited, and its pid may even be another's now)."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        if _parent_of(pid) != self.supervisor:
            os.close(pidfd)
            return False
        self.pidfd = pidfd
        self.pid = pid
        return True

    def _find(self) -> bool:
        """Take the supervisor's child other than us, when not told its pid."""
        me = os.getpid()
        return any(self.watch(c) for c in _children_of(self.supervisor) if c != me)

    def due(self) -> tuple[float, float]:
        """When ``SIGTERM`` and ``SIGKILL`` are due (monotonic seconds)."""
        term_at, kill_at = signal_times(self.deadline, self.grace)
        if self.orphaned_at is not None:  # the supervisor died: stop the command now
            term_at = min(term_at, self.orphaned_at)
            kill_at = min(kill_at, self.orphaned_at + self.grace)
        return term_at, kill_at

    def act(self, now: float) -> float:
        """Send what is due at ``now``; the seconds until something is next due."""
        pending = dict(zip((signal.SIGTERM, signal.SIGKILL), self.due(), strict=True))
        for signum, at in pending.items():
            if at > now or signum in self.sent:
                continue
            if self.pidfd is None and not self._find():
                self.over = self.orphaned_at is not None  # (its child is out of reach)
                return _LOOK_AGAIN
            self.sent.add(signum)
            self._send(signum)
        if signal.SIGKILL in self.sent:
            self.killed_at = self.killed_at or now
            self.over = now >= self.killed_at + _AFTER_KILL
            return max(0.0, self.killed_at + _AFTER_KILL - now)
        return max(0.0, min(at for s, at in pending.items() if s not in self.sent) - now)

    def _send(self, signum: int) -> None:
        assert self.pidfd is not None
        try:
            signal.pidfd_send_signal(self.pidfd, signum)
        except ProcessLookupError:  # (it has exited already)
            return
        if self.pid is not None:  # (alive, so its pid is its group's: its children too)
            signal_group(self.pid, signum)
        what = "supervisor is gone" if self.orphaned_at is not None else "lease runs out"
        name = signal.Signals(signum).name
        print(f"asynclock run: the {what}; sent {name} to the command", file=sys.stderr)

    def after_exit(self) -> None:
        """The command exited. If it was being stopped (``SIGTERM`` sent, not yet
        ``SIGKILL``), what is left of its process group (children that outlived it)
        gets ``SIGKILL`` when it is due. An id that leads a live group is never given
        to a new process, so the group is still the command's while it has members."""
        if self.pid is None or signal.SIGTERM not in self.sent or signal.SIGKILL in self.sent:
            return
        kill_at = self.due()[1]
        while group_alive(self.pid) and time.monotonic() < kill_at:
            time.sleep(GROUP_POLL)
        signal_group(self.pid, signal.SIGKILL)

    def told(self, line: bytes) -> bool:
        """Take one line from the supervisor; False when there is nothing left to do."""
        if line == DONE:
            return False
        if line.startswith(b"pid "):
            return self.watch(int(line[4:]))
        try:
            deadline = float(line)
        except ValueError:
            return True  # (not a line of ours: ignored)
        if self.deadline == math.inf or deadline > self.deadline:
            self.deadline = deadline
        return True


def signal_group(pgid: int, signum: int) -> None:
    """``signum`` to the process group ``pgid`` (the command leads one: ``run`` starts it
    in a session of its own); nothing if the group is empty."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


GROUP_POLL: Final = 0.02  # seconds between looks at a stopped command's group


def _serve(switch: _Switch) -> None:
    """The reaper's loop: until the command exits, ``done``, or nothing is left to do."""
    stdin = sys.stdin.fileno()
    poller = select.poll()
    poller.register(stdin, select.POLLIN)
    watched: int | None = None
    pending = b""
    while not switch.over:
        wait = switch.act(time.monotonic())
        if switch.pidfd is not None and watched is None:
            watched = switch.pidfd
            poller.register(watched, select.POLLIN)
            continue  # (it may have exited already)
        timeout_ms = None if math.isinf(wait) else math.ceil(wait * 1000)
        for fd, _ in poller.poll(timeout_ms):
            if fd == watched:
                switch.after_exit()
                return  # the command has exited
            chunk = os.read(stdin, 4096)
            if not chunk:
                switch.orphaned_at = time.monotonic()
                poller.unregister(stdin)
                switch.over = switch.pidfd is None and switch.deadline == math.inf
                continue
            *lines, pending = (pending + chunk).split(b"\n")
            if not all(switch.told(line + b"\n") for line in lines):
                return


def main(argv: list[str]) -> int:
    """``_reaper.py GRACE`` (seconds between ``SIGTERM`` and ``SIGKILL``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the supervisor decides; EOF ends us)
    switch = _Switch(float(argv[0]))
    os.write(sys.stdout.fileno(), READY)
    _serve(switch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
