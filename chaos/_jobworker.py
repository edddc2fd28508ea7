"""The worker processes of the job sub-modes (``--jobs fenced``, ``--jobs every``,
``--jobs run``): one process per slot, restarted by the parent after a ``SIGKILL``.

Started as ``python -c "from chaos._jobworker import main; ..."`` with one JSON argument
(a :class:`JobWorkerConfig`), in a session of its own (so that the parent can stop it and
its children at once). Every process appends what it did to one shared JSON-lines file
(:class:`Records`: one ``write()`` per line on an ``O_APPEND`` descriptor, so the lines of
several processes never interleave, and a line written before a ``SIGKILL`` stays), each
line with ``time.monotonic()`` seconds in ``t`` (the clock every process of the machine
shares). On stdout it tells the parent ``ready`` and ``busy`` (a job, a tick or a command
running now, or not), which the nemesis aims at. It stops when stdin reaches EOF, and
dies with the parent (``PR_SET_PDEATHSIG``).

- ``fenced``: contenders call ``once()`` for the job keys of the moment; the job applies
  its effect to the shared :class:`~asynclock.testing.FencedStore` through the fence:
  claim ``effect:<key>`` with the lease's fencing token, read it, and write the run's
  id unless an earlier run's effect is there already; the job returns
  ``<the run whose effect is there>@<its own run id>``.
  ``once()`` does not hand the job its lease, so the token comes from the process's
  event hook: the ``acquired`` event is reported in the caller's task just before the
  job runs, and the hook keeps its token in a context variable of that task.
- ``every``: one ``every()`` per process, its wall clock moved by ``skew`` seconds
  (``time-machine``); the job records the tick it runs, read from the claim that
  ``every()`` set on its client in the same task (a ``Redis`` subclass keeps it).
- ``run``: a machine: a loop running ``python -m asynclock run NAME -- python -c
  COMMAND``, like a crontab entry, whose command records its own start, heartbeats every
  40 ms and end; a share of the commands ignore ``SIGTERM``. It tells the parent the pid
  of ``asynclock run`` while one runs (``supervisor``, 0 once it exited), which
  ``supervisor_stop`` and ``supervisor_kill`` aim at.

``sabotage`` (the negative controls): ``fenced`` jobs ignore their lease's loss and write
their effect without the fence or a look; ``every`` is replaced by the old recipe (a
``lease(blocking=False)`` at each tick of the process's clock, no claim); ``run``'s
commands fork into the background, so ``asynclock run`` sees them exit at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import math
import os
import random
import signal
import sys
import time
from typing import Any, Final

import anyio
import anyio.to_thread
from redis.asyncio import Redis
from redis.exceptions import RedisError

import asynclock
from asynclock import instrumentation
from asynclock.testing import FencedStore

from ._worker import _client, _die_with_parent, _Reporter, _wait_for_eof

__all__ = ["COMMAND", "JobWorkerConfig", "Records", "effect_key", "main"]

GENERATION: Final = 3.0  # TTLs of wall time a generation of fenced job keys lasts
KEYS: Final = 4  # fenced job keys per generation
_STEPS: Final = (2, 5)  # sleeps before and after a fenced job's effect
_STEP: Final = (0.05, 0.2)  # TTLs each of them lasts
_WRITE_PAUSE: Final = (0.002, 0.02)  # seconds between the effect's read and write
_RESULT_TTL: Final = 600.0  # seconds a fenced job's result is kept
_TICK_JOB: Final = (0.05, 0.15)  # seconds an every() job lasts
EVERY_JOBS: Final = 3  # every() jobs per process, a third of a period apart
_COMMAND_LENGTH: Final = (0.5, 4.0)  # TTLs a command of the run mode lasts (past its TTL)
_IGNORING: Final = 0.5  # share of those commands that ignore SIGTERM
_BETWEEN: Final = (0.0, 0.3)  # TTLs between two rounds, or two commands of a machine
_BUSY_EXIT: Final = 3  # asynclock run's --busy-exit: another machine had the lock

COMMAND: Final = r"""
import json, os, signal, sys, time
path, cid, ignore, seconds, detach = sys.argv[1:6]
if ignore == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if detach == "1" and os.fork():
    os._exit(0)
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def record(event):
    line = {"e": event, "id": cid, "t": time.monotonic(), "ignores_term": ignore == "1"}
    os.write(fd, (json.dumps(line) + "\n").encode())
record("cmd-start")
end = time.monotonic() + float(seconds)
while time.monotonic() < end:
    time.sleep(0.04)
    record("cmd-beat")
record("cmd-end")
"""
"""The command ``--jobs run`` runs under ``asynclock run``: it records its own start,
a heartbeat every 40 ms and its end (arguments: records file, command id, ``1`` to
ignore ``SIGTERM``, seconds, ``1`` to fork into the background first: the sabotage)."""

_TOKEN: contextvars.ContextVar[tuple[str, int]] = contextvars.ContextVar("chaos_token")
_TICK: contextvars.ContextVar[tuple[int, float]] = contextvars.ContextVar("chaos_tick")


def _offsets(period: float) -> list[float]:
    """The offsets of the ``every()`` jobs of ``--jobs every``: three, a third of a
    period apart (three samples of the race per period)."""
    return [period * k / EVERY_JOBS for k in range(EVERY_JOBS)]


def effect_key(key: str) -> str:
    """The key of the fenced store that job ``key`` applies its effect to."""
    return f"effect:{key}"


@dataclasses.dataclass(frozen=True, slots=True)
class JobWorkerConfig:
    """What a worker process is told (JSON on its command line). Times in seconds."""

    kind: str
    """``fenced``, ``every`` or ``run``."""
    name: str
    url: str
    records: str
    store: str
    ttl: float
    seed: int
    parent_pid: int
    tasks: int = 2
    skew: float = 0.0
    """``every``: seconds this process's wall clock is moved by."""
    period: float = 3.0
    """``every``: seconds between ticks."""
    sabotage: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


class Records:
    """Appends JSON lines to the shared records file, one ``write()`` each."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, event: str, /, **fields: Any) -> None:
        line = json.dumps({"e": event, "t": time.monotonic(), **fields}, separators=(",", ":"))
        os.write(self._fd, line.encode() + b"\n")

    def close(self) -> None:
        os.close(self._fd)


def _remember_token(event: asynclock.LeaseEvent) -> None:
    """The process's event hook: the token of a lease just acquired, for the job that
    the same task runs next (see the module doc)."""
    if event.kind is asynclock.LeaseEventKind.ACQUIRED:
        _TOKEN.set((event.name, event.fencing_token))


class _TickSpy(Redis):
    """A client that keeps, in the calling task, the tick ``every()`` claimed last (its
    ms) and when the claim was sent (``time.monotonic()`` seconds: the claim cannot have
    existed before)."""

    async def set(self, name: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        sent = time.monotonic()
        answer = await super().set(name, value, *args, **kwargs)
        text = name.decode() if isinstance(name, bytes) else str(name)
        if answer and ":tick:" in text:
            _TICK.set((int(text.rpartition(":")[2]), sent))
        return answer


class _Fenced(Exception):
    """A fenced job's claim or write was refused: a newer run holds the effect's key."""


class _Process:
    """One worker process: its records, store, reporter, and what it runs."""

    def __init__(self, config: JobWorkerConfig) -> None:
        self.config = config
        self.records = Records(config.records)
        self.report = _Reporter()
        self.rng = random.Random(f"{config.seed}:{config.name}")
        self.busy = 0

    def started(self) -> None:
        """A job (a tick, a command) began here: tell the parent, whose nemesis aims at
        busy processes."""
        self.busy += 1
        self.report("busy", on=self.busy)

    def ended(self) -> None:
        """A job ended here (see :meth:`started`)."""
        self.busy -= 1
        self.report("busy", on=self.busy)

    async def run(self) -> int:
        """Run the process's kind until stdin reaches EOF; the exit status (0)."""
        stop = asyncio.Event()
        watcher = asyncio.create_task(_wait_for_eof(stop))
        self.report("ready", pid=os.getpid())
        body = {"fenced": self._fenced, "every": self._every, "run": self._machine}
        try:
            await body[self.config.kind](stop)
        finally:
            watcher.cancel()
            await asyncio.wait({watcher})
            self.records.close()
            self.report("final")
        return 0

    # -- fenced ---------------------------------------------------------------------------

    async def _fenced(self, stop: asyncio.Event) -> None:
        instrumentation.set_hooks([_remember_token])
        client = _client(self.config.url, self.config.ttl)
        store = FencedStore(self.config.store, busy_timeout=10.0)
        try:
            async with asyncio.TaskGroup() as group:
                for task in range(self.config.tasks):
                    group.create_task(
                        self._caller(client, store, f"{self.config.name}/t{task}", stop)
                    )
        finally:
            await client.aclose()
            store.close()

    async def _caller(
        self, client: Redis, store: FencedStore, who: str, stop: asyncio.Event
    ) -> None:
        ttl = self.config.ttl
        rng = random.Random(f"{self.config.seed}:{who}")
        runs = 0
        while not stop.is_set():
            generation = math.floor(time.time() / (GENERATION * ttl))
            key = f"job-{generation}-{rng.randrange(KEYS)}"
            runs += 1
            job = _FencedJob(self, store, key, f"{who}#{runs}", rng)
            await self._call_once(client, key, who, job)
            await asyncio.sleep(rng.uniform(*_BETWEEN) * ttl)

    async def _call_once(self, client: Redis, key: str, who: str, job: _FencedJob) -> None:
        asked = time.monotonic()
        result = error = None
        try:
            result = await asynclock.once(
                client,
                key,
                job,
                ttl=self.config.ttl,
                blocking_timeout=3 * self.config.ttl,
                result_ttl=_RESULT_TTL,
            )
        except (asynclock.LockError, RedisError, OSError, _Fenced) as exc:
            error = type(exc).__name__
        self.records(
            "round", key=key, who=who, asked=asked, result=result, ran=job.ended, error=error,
            run=job.run_id if job.began else None,
        )  # fmt: skip

    # -- every ----------------------------------------------------------------------------

    async def _every(self, stop: asyncio.Event) -> None:
        import time_machine  # (the test extra; only this mode needs it)

        config = self.config
        client = _TickSpy.from_url(config.url, socket_timeout=max(1.0, 2 * config.ttl))
        body = self._old_recipe if config.sabotage else self._ticks
        with time_machine.travel(time.time() + config.skew, tick=True):
            runner = asyncio.create_task(body(client))
            stopped = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({runner, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if runner.done():  # (every() never returns: it failed; the process dies)
                    runner.result()
            finally:
                for task in (runner, stopped):
                    task.cancel()
                await asyncio.wait({runner, stopped})
                await client.aclose()

    async def _ticks(self, client: Redis) -> None:
        config = self.config
        async with asyncio.TaskGroup() as group:
            for index, offset in enumerate(_offsets(config.period)):
                group.create_task(
                    asynclock.every(
                        client, f"tick-job-{index}", config.period, self._tick_job,
                        f"tick-job-{index}", offset=offset, ttl=config.ttl,
                    )
                )  # fmt: skip

    async def _tick_job(self, job: str, tick: int | None = None) -> None:
        claimed = time.monotonic()  # (the sabotage's own ticks have no claim)
        if tick is None:
            tick, claimed = _TICK.get((-1, claimed))
        self.started()
        try:
            self.records(
                "tick", job=job, tick=tick, who=self.config.name, clock=time.time(), claim=claimed
            )
            await asyncio.sleep(self.rng.uniform(*_TICK_JOB))
            self.records("tick-end", job=job, tick=tick, who=self.config.name)
        finally:
            self.ended()

    async def _old_recipe(self, client: Redis) -> None:
        """The sabotage: a lease taken without waiting at each tick of this clock, the
        recipe ``every()`` replaced (a late clock finds the lock free again)."""
        async with asyncio.TaskGroup() as group:
            for index, offset in enumerate(_offsets(self.config.period)):
                group.create_task(self._old_ticks(client, f"tick-job-{index}", offset))

    async def _old_ticks(self, client: Redis, job: str, offset: float) -> None:
        period, ttl = self.config.period, self.config.ttl
        while True:
            tick = (math.floor((time.time() - offset) / period) + 1) * period + offset
            await asyncio.sleep(max(0.0, tick - time.time()))
            try:
                async with asynclock.lease(client, job, ttl=ttl, blocking=False):
                    await self._tick_job(job, round(tick * 1000))
            except (asynclock.LockError, RedisError, OSError):
                continue

    # -- run ------------------------------------------------------------------------------

    async def _machine(self, stop: asyncio.Event) -> None:
        config = self.config
        count = 0
        while not stop.is_set():
            count += 1
            cid = f"{config.name}#{count}"
            ignores = self.rng.random() < _IGNORING
            seconds = self.rng.uniform(*_COMMAND_LENGTH) * config.ttl
            argv = [
                sys.executable, "-m", "asynclock", "run", "cron-job", "--url", config.url,
                "--ttl", f"{config.ttl:g}", "--busy-exit", str(_BUSY_EXIT), "--",
                sys.executable, "-c", COMMAND, config.records, cid, "1" if ignores else "0",
                f"{seconds:.3f}", "1" if config.sabotage else "0",
            ]  # fmt: skip
            self.started()
            try:
                launched = time.monotonic()
                child = await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
                )
                self.report("supervisor", pid=child.pid)  # (supervisor_stop, _kill aim here)
                try:
                    status = await child.wait()
                finally:
                    self.report("supervisor", pid=0)
            finally:
                self.ended()
            self.records("exit", id=cid, who=config.name, status=status, launched=launched)
            await asyncio.sleep(self.rng.uniform(*_BETWEEN) * config.ttl)


class _FencedJob:
    """The job of one ``once()`` call (a callable, so that it can say whether it ran)."""

    def __init__(
        self, process: _Process, store: FencedStore, key: str, run_id: str, rng: random.Random
    ) -> None:
        self.process = process
        self.store = store
        self.key = key
        self.run_id = run_id
        self.who = run_id.partition("#")[0]
        self.rng = rng
        self.began = False
        """Whether the job was called (``once()`` found no result and got the lease)."""
        self.ended: str | None = None
        """The job's result, once it returned it (None: it did not run to its end)."""

    async def __call__(self) -> str:
        name, token = _TOKEN.get(("", 0))
        if name != self.key:
            raise AssertionError(f"no fencing token for {self.key!r} (the hook saw {name!r})")
        records, process = self.process.records, self.process
        self.began = True
        process.started()
        records("start", key=self.key, who=self.who, run=self.run_id, fence=token)
        try:
            if process.config.sabotage:
                with anyio.CancelScope(shield=True):
                    value = await self._work(token)
            else:
                value = await self._work(token)
        except BaseException as exc:  # (cancelled by the lease's loss, most often)
            records("stop", key=self.key, who=self.who, run=self.run_id, why=type(exc).__name__)
            raise
        finally:
            process.ended()
        result = f"{value}@{self.run_id}"  # (the effect's run, and the one storing it)
        records("end", key=self.key, who=self.who, run=self.run_id, fence=token, value=result)
        self.ended = result
        return result

    async def _work(self, token: int) -> str:
        ttl = self.process.config.ttl
        await self._steps(ttl)
        value = await anyio.to_thread.run_sync(self._apply, token, abandon_on_cancel=True)
        await self._steps(ttl)
        return value

    async def _steps(self, ttl: float) -> None:
        for _ in range(self.rng.randint(*_STEPS)):
            await asyncio.sleep(self.rng.uniform(*_STEP) * ttl)

    def _apply(self, token: int) -> str:
        """The effect, through the fence: the value of the run that applied it."""
        key, who = effect_key(self.key), self.who
        if self.process.config.sabotage:  # no fence, no look: every run applies it
            self.store.write_unfenced(key, self.run_id, holder=who)
            return self.run_id
        if not self.store.claim(key, token, holder=who):
            raise _Fenced(f"{key}: fence {token} refused")
        found = self.store.read(key)
        if found is not None:
            return str(found)
        time.sleep(self.rng.uniform(*_WRITE_PAUSE))
        if not self.store.write(key, self.run_id, token, holder=who):
            raise _Fenced(f"{key}: fence {token} refused")
        return self.run_id


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process; ``argv[0]`` is a :class:`JobWorkerConfig` as JSON."""
    args = sys.argv[1:] if argv is None else argv
    config = JobWorkerConfig(**json.loads(args[0]))
    _die_with_parent(config.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return asyncio.run(_Process(config).run())
