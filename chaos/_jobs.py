"""The job sub-modes of the chaos run: ``--jobs fenced``, ``--jobs every``, ``--jobs run``.

Design note. A run of its own beside the lock modes' (``_run``), for what they cannot
do: the nemesis here kills processes (``runner_kill``: ``SIGKILL`` of a process running a
job, started again at once under a new name, ``w<slot>.<generation>``) and stops whole
process groups (``runner_stop``: a worker, or a machine of ``--jobs run`` with its
``asynclock run`` and its command, for 2.5-6 TTLs), and in ``--jobs run`` stops or kills
the ``asynclock run`` process alone, its command running on (``supervisor_stop``,
``supervisor_kill``: its reaper must stop the command by the lease's deadline, no
overlap excused); its other faults are the ordinary
nemesis's (``chaos._nemesis.Nemesis``), on a private server with one
:class:`~asynclock.testing.FaultProxy` per slot. The workers (``chaos._jobworker``) tell
the parent when a job is running (``busy``), which the nemesis aims at; everything else
is in the shared records file, which the checks (``chaos._jobcheck``) read at the end.
Each slot is a session of its own, so that stopping or killing it reaches its children;
they are all killed by process group at the end, whatever they became (the sabotaged
commands of ``--jobs run`` fork into the background).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

from asynclock.testing import (
    Attempt,
    FaultProxy,
    FencedStore,
    FencedWriteViolation,
    History,
    RedisServer,
    check_fenced_writes,
)

from . import _jobcheck as check
from ._jobworker import JobWorkerConfig
from ._nemesis import Fault, FaultKind, Injection, Nemesis, Target
from ._summary import Summary

if TYPE_CHECKING:
    from ._run import ChaosConfig

__all__ = ["PERIOD_TTLS", "run_job_mode", "skews"]

PERIOD_TTLS: Final = 4.0  # ``--jobs every``: the period, in TTLs
_SKEW: Final = (0.1, 0.24)  # ... and each process's clock skew, in periods (either sign)
_READY: Final = 30.0  # seconds for a worker to start
_STOP_GRACE: Final = 10.0  # seconds (plus 4 TTLs) for the workers to stop when told
_BUSY_WAIT: Final = 1.0  # TTLs runner_kill/runner_stop wait for a busy process
_SUPERVISOR_FAULTS: Final = (FaultKind.SUPERVISOR_STOP, FaultKind.SUPERVISOR_KILL)
_SUPERVISOR_WAIT: Final = 4.0  # TTLs they wait for an asynclock run whose command runs
_WORKER_CODE: Final = "import sys; from chaos._jobworker import main; sys.exit(main())"
_ROOT: Final = str(Path(__file__).resolve().parents[1])


def skews(seed: int, workers: int, period: float) -> list[float]:
    """The clock skew of each process of ``--jobs every`` (seconds, seeded), alternately
    early and late, all within a quarter period of the true time (so any two differ by
    less than half a period: what ``every()`` promises to absorb)."""
    rng = random.Random(f"{seed}:skews")
    return [(-1) ** i * rng.uniform(*_SKEW) * period for i in range(workers)]


@dataclasses.dataclass(slots=True)
class _Slot:
    """A worker process of slot ``index`` (its generation's name, what it reports)."""

    index: int
    proc: asyncio.subprocess.Process
    name: str
    busy: int = 0
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stderr: deque[str] = dataclasses.field(default_factory=lambda: deque(maxlen=20))
    killed: bool = False
    supervisor: int = 0  # (``--jobs run``: the pid of its ``asynclock run``, 0: none now)
    tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)


class _JobRun:
    """One run of a job sub-mode; see the module's design note."""

    def __init__(
        self,
        config: ChaosConfig,
        server: RedisServer,
        proxies: Sequence[FaultProxy],
        workdir: Path,
    ) -> None:
        self.config = config
        self.server = server
        self.proxies = tuple(proxies)
        self.records = workdir / "records.jsonl"
        self.store_path = workdir / "store.sqlite"
        self.slots: list[_Slot] = []
        self.generations = [0] * config.workers
        self.died: list[str] = []
        self.stopping = False
        self.busy_changed = asyncio.Event()
        self.period = PERIOD_TTLS * config.ttl
        self.skews = skews(config.seed, config.workers, self.period)

    # -- processes ------------------------------------------------------------------------

    async def _spawn(self, index: int) -> _Slot:
        config = self.config
        name = f"w{index}.{self.generations[index]}"
        worker = JobWorkerConfig(
            kind=config.jobs_mode,
            name=name,
            url=self.proxies[index].url,
            records=str(self.records),
            store=str(self.store_path),
            ttl=config.ttl,
            seed=config.seed,
            parent_pid=os.getpid(),
            tasks=config.tasks,
            skew=self.skews[index],
            period=self.period,
            sabotage=config.sabotage,
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WORKER_CODE, worker.to_json(),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
        )  # fmt: skip
        slot = _Slot(index, proc, name)
        slot.tasks = [
            asyncio.create_task(self._read_reports(slot)),
            asyncio.create_task(self._read_stderr(slot)),
        ]
        try:
            async with asyncio.timeout(_READY):
                await slot.ready.wait()
        except TimeoutError:
            raise RuntimeError(f"worker {name} not ready within {_READY:g} s") from None
        return slot

    async def _read_reports(self, slot: _Slot) -> None:
        assert slot.proc.stdout is not None
        while line := await slot.proc.stdout.readline():
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if message.get("k") == "ready":
                    slot.ready.set()
                elif message.get("k") == "busy":
                    slot.busy = int(message["on"])
                    self.busy_changed.set()
                elif message.get("k") == "supervisor":
                    slot.supervisor = int(message["pid"])
                    self.busy_changed.set()
        if not (self.stopping or slot.killed):
            self.died.append(f"{slot.name} died (exit status {await slot.proc.wait()})")

    async def _read_stderr(self, slot: _Slot) -> None:
        assert slot.proc.stderr is not None
        while line := await slot.proc.stderr.readline():
            slot.stderr.append(line.decode(errors="replace").rstrip())

    def _targets(self, busy_only: bool) -> list[Target]:
        return [Target(s.name, s.proc.pid, s.index) for s in self.slots if s.busy or not busy_only]

    async def _runner(self, pick: float) -> _Slot:
        """A slot running a job (waits up to a TTL for one; else any), chosen by ``pick``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_BUSY_WAIT * self.config.ttl):
                while not any(s.busy for s in self.slots):
                    self.busy_changed.clear()
                    await self.busy_changed.wait()
        among = [s for s in self.slots if s.busy] or self.slots
        return among[min(int(pick * len(among)), len(among) - 1)]

    async def _supervisor(self, pick: float) -> _Slot:
        """A slot whose ``asynclock run`` has children (its reaper, its command: often
        struck as they start), polled every 20 ms for up to ``_SUPERVISOR_WAIT`` TTLs;
        else any. Chosen by ``pick``."""
        until = time.monotonic() + _SUPERVISOR_WAIT * self.config.ttl
        while True:
            among = [s for s in self.slots if s.supervisor and _has_children(s.supervisor)]
            if among or time.monotonic() >= until:
                break
            await asyncio.sleep(0.02)
        among = among or self.slots
        return among[min(int(pick * len(among)), len(among) - 1)]

    def _signal(self, slot: _Slot, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(slot.proc.pid, signum)

    # -- faults ---------------------------------------------------------------------------

    async def _inject(self, nemesis: Nemesis, injection: Injection) -> None:
        """A fault of this mode's own (``runner_kill``, ``runner_stop``,
        ``supervisor_stop``, ``supervisor_kill``)."""
        fault = injection.fault
        injection.start, injection.start_wall = time.monotonic(), time.time()
        supervising = fault.kind in _SUPERVISOR_FAULTS
        pick = self._supervisor if supervising else self._runner
        slot = await pick(fault.pick)
        injection.target = slot.name
        injection.start = time.monotonic()
        try:
            if supervising:
                injection.outcome = await self._supervisor_fault(slot, fault)
            elif fault.kind is FaultKind.RUNNER_KILL:
                slot.killed = True
                self._signal(slot, signal.SIGKILL)
                await slot.proc.wait()
                self.generations[slot.index] += 1
                self.slots[slot.index] = await self._spawn(slot.index)
            else:
                self._signal(slot, signal.SIGSTOP)
                try:
                    await asyncio.sleep(fault.duration)
                finally:
                    self._signal(slot, signal.SIGCONT)
        finally:
            injection.end, injection.end_wall = time.monotonic(), time.time()
        nemesis.injections.append(injection)

    async def _supervisor_fault(self, slot: _Slot, fault: Fault) -> str:
        """``SIGSTOP`` (then ``SIGCONT``) or ``SIGKILL`` of a machine's ``asynclock run``
        alone, its command running on; the injection's outcome."""
        pid = slot.supervisor
        if not pid:
            return "skipped: no asynclock run running"
        stop = fault.kind is FaultKind.SUPERVISOR_STOP
        try:
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGKILL)
        except ProcessLookupError:
            return "skipped: asynclock run exited"
        if stop:
            try:
                await asyncio.sleep(fault.duration)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        return "done"

    async def _nemesis(self, nemesis: Nemesis, t0: float) -> None:
        until = t0 + self.config.seconds
        for fault in self.config.schedule():
            await asyncio.sleep(max(0.0, t0 + fault.at - time.monotonic()))
            if time.monotonic() >= until:
                return
            if fault.kind in (FaultKind.RUNNER_KILL, FaultKind.RUNNER_STOP, *_SUPERVISOR_FAULTS):
                await self._inject(nemesis, Injection(fault))
            else:
                await nemesis.inject(fault)

    # -- the run --------------------------------------------------------------------------

    async def run(self) -> tuple[Summary, float]:
        config = self.config
        FencedStore(self.store_path).close()  # (the schema, before any worker runs)
        started = time.monotonic()
        nemesis = Nemesis(
            self.server,
            self.proxies,
            History(),
            lambda: self._targets(busy_only=True),
            [Target(f"w{i}", 0, i) for i in range(config.workers)],
            config.ttl,
        )
        try:
            for index in range(config.workers):
                self.slots.append(await self._spawn(index))
            t0 = time.monotonic()
            task = asyncio.create_task(self._nemesis(nemesis, t0))
            try:
                await asyncio.sleep(config.seconds)
            finally:
                if not task.done():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(4 * config.ttl + 5.0):
                            await asyncio.shield(task)
                    task.cancel()
                    await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                raise RuntimeError("the nemesis failed") from task.exception()
            await nemesis.heal_all()
            await self._stop()
        finally:
            await nemesis.heal_all()
            self._kill_all()
        until = time.monotonic()
        self._save(nemesis.injections)
        hits = [_hit(i) for i in nemesis.injections]
        summary = self._summarize(hits, until, nemesis.injections)
        return summary, until - started

    async def _stop(self) -> None:
        self.stopping = True
        for slot in self.slots:
            if slot.proc.stdin is not None:
                slot.proc.stdin.close()
        waits = [asyncio.create_task(s.proc.wait()) for s in self.slots]
        await asyncio.wait(waits, timeout=_STOP_GRACE + 4 * self.config.ttl)
        for slot in self.slots:
            if slot.proc.returncode is None:
                self.died.append(f"{slot.name} did not stop in time (killed)")
            await asyncio.wait(slot.tasks, timeout=5.0)

    def _kill_all(self) -> None:
        self.stopping = True
        for slot in self.slots:  # (the whole group: a machine's commands, gone or not)
            self._signal(slot, signal.SIGCONT)
            self._signal(slot, signal.SIGKILL)

    def _save(self, injections: Sequence[Injection]) -> None:
        """What the nemesis did, beside the records (kept with them when the run fails)."""
        with open(self.records.with_name("injections.jsonl"), "w") as file:
            for injection in injections:
                file.write(json.dumps(injection.to_json()) + "\n")

    def _load(self) -> list[dict[str, Any]]:
        if not self.records.exists():
            return []
        lines = self.records.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def _summarize(
        self, hits: list[check.Hit], until: float, injections: Sequence[Injection]
    ) -> Summary:
        records = self._load()
        mode = self.config.jobs_mode
        if mode == "fenced":
            with FencedStore(self.store_path) as store:
                attempts, stale = store.attempts(), check_fenced_writes(store)
            own = _fenced_figures(records, attempts, stale, hits, until, self.config.ttl)
        elif mode == "every":
            own = _every_figures(records, hits, until, self.config.ttl, self.period, self.skews)
        else:
            own = _run_figures(records, hits, self.config.ttl)
        return _summary(self.config, own, injections, self.died, self.slots)


def _has_children(pid: int) -> bool:
    """Whether process ``pid`` has children now: an ``asynclock run`` that got the lease
    (its reaper, then its command, run), not one about to exit busy."""
    try:
        return bool(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except OSError:  # the process is gone, or this kernel keeps no ``children`` file
        return Path(f"/proc/{pid}").exists()


def _hit(injection: Injection) -> check.Hit:
    """What the checks need of an injection."""
    return check.Hit(
        str(injection.fault.kind),
        injection.start,
        injection.end,
        injection.target,
        injection.outcome,
        injection.data_loss,
    )


# --------------------------------------------------------------------------------------
# Figures: each mode's lines, must-be-0 failures and data
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Figures:
    """A sub-mode's summary lines, failures (with details) and JSON figures."""

    lines: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    details: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def must_be_0(self, label: str, found: Sequence[object], what: str) -> None:
        """A line ``label  N`` for a must-be-0 figure; a failure and details if not 0."""
        self.lines.append(f"  {label:<20} {len(found)} ({what}: must be 0)")
        if found:
            self.failures.append(f"{label}: {len(found)}")
            self.details += [f"{label}: {_pair(item)}" for item in found[:5]]


def _pair(item: object) -> str:
    if isinstance(item, tuple):
        return " and ".join(str(x) for x in item)
    return str(item)


def _listing(counts: Counter[str]) -> str:
    """``"a 1, b 2"`` (sorted by key), or ``"none"``."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _overlap_lines(
    figures: _Figures, runs: Sequence[check.Run], hits: Sequence[check.Hit], ttl: float
) -> None:
    found = check.overlaps(runs, hits, ttl)
    figures.must_be_0("overlap, not paused", found.unexcused, "two runs of one key at once")
    figures.lines.append(
        f"  allowed overlap after data loss: {len(found.after_loss)} pairs, max "
        f"{check.longest(found.after_loss) * 1000:.0f} ms; of paused runners (excused): "
        f"{len(found.paused)} pairs, max {check.longest(found.paused) * 1000:.0f} ms"
    )
    figures.data["overlap"] = {
        "unpaused": {"count": len(found.unexcused)},
        "after_data_loss": {"count": len(found.after_loss)},
        "paused": {"count": len(found.paused)},
    }


def _fenced_figures(
    records: list[dict[str, Any]],
    attempts: Sequence[Attempt],
    stale: Sequence[FencedWriteViolation],
    hits: list[check.Hit],
    until: float,
    ttl: float,
) -> _Figures:
    figures = _Figures()
    rounds = [r for r in records if r["e"] == "round"]
    runs = check.fenced_runs(records, hits, until)
    outcomes = Counter(r["error"] or "result" for r in rounds)
    again = check.runs_again(runs, hits)
    figures.lines += [
        f"  once() calls         {len(rounds)}: {_listing(outcomes)}",
        f"  job runs             {len(runs)} on {len({r.key for r in runs})} keys; run again: "
        + _listing(again),
    ]
    _overlap_lines(figures, runs, hits, ttl)
    twice = check.effects_applied_twice(attempts)
    applied = sum(1 for a in attempts if a.accepted and a.op in ("write", "unfenced"))
    refused = sum(1 for a in attempts if not a.accepted)
    figures.lines.append(
        f"  effects applied      {applied}; fenced claims/writes refused {refused}"
    )
    figures.must_be_0("effect applied twice", [(k, *w) for k, w in twice.items()], "effect keys")
    figures.must_be_0("stale accepted", stale, "fenced writes with a stale token")
    differ = check.effects_differ(rounds)
    figures.must_be_0("effects differ", differ, "callers of one key given two effects")
    changes = check.stored_results(records, hits)
    stored = [c for c in changes if not c.after_data_loss]
    figures.must_be_0("result stored twice", stored, "no data loss between")
    restored = len(changes) - len(stored)
    figures.lines.append(f"  stored again after a data loss: {restored} (by design)")
    figures.data.update(
        {
            "acquisitions": {"total": len(runs)},
            "fenced_writes": {"stale_accepted": len(stale), "refused": refused, "applied": applied},
            "jobs": {
                "calls": dict(outcomes),
                "runs": len(runs),
                "runs_again": dict(again),
                "stored_twice": len(stored) + len(twice) + len(differ),
                "effects_applied_twice": len(twice),
                "effects_differ": len(differ),
                "stored_again_after_data_loss": restored,
            },
        }
    )
    return figures


def _every_figures(
    records: list[dict[str, Any]],
    hits: list[check.Hit],
    until: float,
    ttl: float,
    period: float,
    clock_skews: Sequence[float],
) -> _Figures:
    figures = _Figures()
    runs = check.tick_runs(records, until)
    ticks = {r.label for r in runs}
    due = sum(_due(runs, job, period) for job in {r.key for r in runs})
    figures.lines += [
        "  clocks               skewed "
        + ", ".join(f"{s:+.2f}" for s in clock_skews)
        + f" s; period {period:g} s",
        f"  ticks run            {len(runs)} runs of {len(ticks)} ticks "
        f"({due} due from the first to the last)",
    ]
    unlabelled = [r for r in runs if r.label.endswith("@-1")]
    figures.must_be_0("ticks unknown", unlabelled, "runs whose tick the job did not see")
    twice, after_loss = check.ticks_run_twice(runs, hits, period)
    figures.must_be_0("tick run twice", twice, "no data loss explains it")
    figures.lines.append(f"  run again after a data loss: {len(after_loss)} (claim forgotten)")
    _overlap_lines(figures, runs, hits, ttl)
    figures.data.update(
        {
            "acquisitions": {"total": len(runs)},
            "jobs": {
                "ticks": len(ticks),
                "ticks_due": due,
                "runs": len(runs),
                "stored_twice": len(twice) + len(unlabelled),
                "ticks_run_twice": len(twice),
                "run_again_after_data_loss": len(after_loss),
                "skews": [round(s, 3) for s in clock_skews],
            },
        }
    )
    return figures


def _due(runs: Sequence[check.Run], job: str, period: float) -> int:
    """The ticks of ``job`` due from its first run's to its last's."""
    ticks = sorted(int(r.label.rpartition("@")[2]) for r in runs if r.key == job)
    ticks = [t for t in ticks if t >= 0]
    return round((ticks[-1] - ticks[0]) / (period * 1000)) + 1 if ticks else 0


def _run_figures(records: list[dict[str, Any]], hits: list[check.Hit], ttl: float) -> _Figures:
    figures = _Figures()
    runs = check.command_runs(records)
    exits = [r for r in records if r["e"] == "exit"]
    statuses = Counter(str(r["status"]) for r in exits)
    ended = {r["id"] for r in records if r["e"] == "cmd-end"}
    ignoring = {r["id"] for r in records if r["e"] == "cmd-start" and r["ignores_term"]}
    stopped = Counter(
        "ignoring SIGTERM" if r.label in ignoring else "on SIGTERM"
        for r in runs
        if r.label not in ended
    )
    figures.lines += [
        f"  asynclock run        {len(exits)} launched; exit status {_listing(statuses)} "
        "(3: busy, 75: lease lost, 69: Redis unreachable, -9: killed by the nemesis)",
        f"  commands             {len(runs)} started, {len(ended)} ended by themselves, "
        f"stopped: {_listing(stopped)}",
    ]
    _overlap_lines(figures, runs, hits, ttl)
    figures.data.update(
        {
            "acquisitions": {"total": len(runs)},
            "jobs": {
                "launched": len(exits),
                "exit_status": dict(statuses),
                "commands": len(runs),
                "stopped": dict(stopped),
                "stored_twice": 0,
            },
        }
    )
    return figures


def _summary(
    config: ChaosConfig,
    figures: _Figures,
    injections: Sequence[Injection],
    died: Sequence[str],
    slots: Sequence[_Slot],
) -> Summary:
    done = Counter(str(i.fault.kind) for i in injections if i.done)
    other = [f"{i.fault.kind}: {i.outcome}" for i in injections if not i.done]
    lines = [
        f"  faults injected      {sum(done.values())}: {_listing(done)}"
        + (f" (not done: {'; '.join(other)})" if other else ""),
        *figures.lines,
        f"  workers died         {len(died)} (must be 0; killed by the nemesis aside)",
    ]
    failures = list(figures.failures)
    details = list(figures.details)
    if died:
        failures.append(f"workers died: {len(died)}")
        details += list(died)
        details += [f"{s.name}: {line}" for s in slots for line in list(s.stderr)[-5:]]
    data = {
        "ok": not failures,
        "failures": failures,
        "mode": f"jobs-{config.jobs_mode}",
        "seed": config.seed,
        "seconds": config.seconds,
        "faults": {"by_kind": dict(done)},
        "workers_died": list(died),
        **figures.data,
    }
    return Summary(not failures, tuple(failures), data, tuple(lines), tuple(details))


async def run_job_mode(config: ChaosConfig, log: TextIO) -> tuple[Summary, Path]:
    """Run the job sub-mode ``config.jobs_mode``; its summary and work directory (kept
    when the run fails or ``config.keep``).

    Raises:
        RuntimeError: no server binary, a worker that did not start.
    """
    workdir = Path(tempfile.mkdtemp(prefix="asynclock-chaos-jobs-"))
    passed = False
    try:
        async with contextlib.AsyncExitStack() as stack:
            server = RedisServer(config.engine)
            stack.push_async_callback(asyncio.to_thread, server.stop)
            await asyncio.to_thread(server.start)
            proxies = [
                await stack.enter_async_context(FaultProxy(server.host, server.port))
                for _ in range(config.workers)
            ]
            summary, wall = await _JobRun(config, server, proxies, workdir).run()
        engine = f"{server.engine} {server.version}"
        lines = (
            *summary.lines,
            f"  server               {engine}",
            f"  wall time            {wall:.1f} s",
        )
        summary = dataclasses.replace(summary, lines=lines)
        passed = summary.ok
        print(f"chaos: jobs {config.jobs_mode} run done in {wall:.1f} s", file=log, flush=True)
        return summary, workdir
    finally:
        if passed and not config.keep:
            shutil.rmtree(workdir, ignore_errors=True)
