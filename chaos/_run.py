"""The chaos run: a private server, a fault proxy per worker, worker processes, the nemesis.

Design note. The parent is one asyncio program: the :class:`~asynclock.testing.FaultProxy`
of each worker (one per worker, so that a network fault can cut off a single holder) runs
on its loop, so nothing here may block it for long (server restarts and raw commands go to
threads). Workers are ``subprocess`` children in their own session (a terminal's Ctrl-C
reaches only the parent, which cleans up), each running ``tasks`` contenders on one
Redis client; each reports on its stdout, read by one task per worker, which keeps track
of which of its contenders holds a lock now (for the nemesis's ``holder_stop`` and
holder-scoped network faults, which hit the whole process) and collects how every round
ended. The run is bounded at every step: workers must be ready within 30 s, the nemesis
stops at the end of the run (the fault in progress is healed, not cut short), workers get
a few TTLs plus 10 s to stop before they are killed (a failure), and the whole run is
cancelled cleanly by Ctrl-C or SIGTERM. Then every check runs over what was recorded
(``_summary``).

The failover mode (``failover=True``) runs a primary and a replica (``_replication``)
instead of the one server, the workers' leases ask for ``min_replicas``, and the nemesis
only fails over (kills the primary right after a grant it hears of, promotes the replica,
repoints the proxies, starts a new replica); the reports' ``acquired`` messages feed its
wait for a grant (:meth:`_Run.next_grant`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from redis.asyncio import Redis

from asynclock.testing import (
    FaultProxy,
    FencedStore,
    History,
    RedisServer,
    check_fenced_writes,
    keys_left,
)

from ._cluster import ChaosCluster, ClusterNemesis, make_cluster_schedule
from ._nemesis import (
    FAIR_KINDS,
    JOB_KINDS,
    REDLOCK_KINDS,
    Fault,
    Nemesis,
    Target,
    make_failover_schedule,
    make_schedule,
)
from ._replication import Replication
from ._summary import (
    RoundReport,
    RunRecord,
    Summary,
    WorkerOutcome,
    mode_text,
    of_limit,
    summarize,
)
from ._worker import WorkerConfig, counter_key, holder_name, slot_name

__all__ = ["ChaosConfig", "run_chaos"]

_READY_TIMEOUT: Final = 30.0  # seconds for every worker to start and report ready
_STOP_GRACE: Final = 10.0  # seconds (plus 4 TTLs) for the workers to stop when told
_NEMESIS_GRACE: Final = 15.0  # seconds for the fault in progress to end after the run
_TTL_MARGIN: Final = 0.3  # seconds past a TTL for a key to have surely expired
_PROGRESS_EVERY: Final = 60.0  # seconds between progress lines (runs of 2 minutes or more)
_WORKER_CODE: Final = "import sys; from chaos._worker import main; sys.exit(main(sys.argv[1:]))"
_ROOT: Final = str(Path(__file__).resolve().parents[1])  # workers import this very asynclock
_DEFAULTS: Final = {"workers": 4, "tasks": 2, "seconds": 20.0, "locks": 3, "ttl": 0.8}
FAILOVERS: Final = 4  # failovers a failover-mode run schedules unless told otherwise


@dataclasses.dataclass(frozen=True, slots=True)
class ChaosConfig:
    """What a chaos run is asked to do. Times in seconds.

    Attributes:
        seed: drives the nemesis's schedule and the workers' choices.
        workers: worker processes (at least 2).
        tasks: contenders per worker process, all sharing its one Redis client (so that
            a release can hand the lock to another contender of the same client).
        seconds: length of the run, from the first worker being ready to healing.
        locks: locks the workers contend for.
        ttl: the leases' TTL.
        engine: ``"redis"``, ``"valkey"`` or None for the first one installed.
        keep: keep the work directory (history, fenced store) even when the run passes.
        sabotage: a negative control: the workers' bodies ignore the loss of their lease
            (shielded from its cancellation, no ``is_held()``), so the checks must fail;
            in the Redlock mode each fault of a server also hits a majority of them, and
            in the fair mode, instead, a third of the rounds jump the queue.
        detached: the share of rounds (0 to 1) that hold their lease with ``acquire()``,
            do their work inside ``lease.guard()`` and give it back with ``release()``,
            instead of ``async with lease(...)``.
        limit: above 1, the semaphore mode: every lock is a semaphore of ``limit``
            permits, and each permit is checked as a slot of its own (no two unpaused
            holders, tokens in order, a fenced counter each), so no lock ever has more
            than ``limit`` unpaused holders.
        failover: the failover mode: a primary and a replica, and the nemesis only fails
            over (``failovers`` times, fewer if the run is too short).
        min_replicas: the leases' ``min_replicas`` (failover mode only; 0 shows what a
            failover does to leases no replica confirmed).
        failovers: how many failovers the failover mode schedules.
        shared: the shared mode, above 0: the share of rounds that hold a shared lease
            (``lease(..., shared=True)``) beside the exclusive ones; no exclusive holder
            may overlap any other holder, and an exclusive waiter must get in within its
            ``blocking_timeout`` unless another exclusive holder or a fault was in its way.
        fair: the fair mode: every lease is ``fair=True``, the nemesis draws from
            ``FAIR_KINDS`` (with ``waiter_stop``), and grants must follow the waiters'
            arrival, a dead waiter delaying the queue no longer than its bound.
        redlock: the Redlock mode, above 0: that many independent servers (3 or 5), each
            lease held on a majority of them (``lease([r1, r2, r3], name)``); the nemesis
            draws from ``REDLOCK_KINDS``, hitting one server at a time.
        jobs: the jobs mode: every round calls ``once()`` for a job key of the moment;
            callers of a key must all get one result (``chaos._modes``).
        cluster: the cluster mode: a Redis Cluster of three primaries with a replica
            each, workers on ``RedisCluster`` clients, and a nemesis that migrates the
            leased slots and kills primaries (``chaos._cluster``); leases use
            ``min_replicas``.
        jobs_mode: a job sub-mode of its own run (``chaos._jobs``): ``fenced``
            (``once()`` with fenced effects, runners killed and stopped), ``every``
            (``every()`` on skewed clocks) or ``run`` (``asynclock run`` commands).
    """

    seed: int
    workers: int = 4
    tasks: int = 2
    seconds: float = 20.0
    locks: int = 3
    ttl: float = 0.8
    engine: str | None = None
    keep: bool = False
    sabotage: bool = False
    detached: float = 0.0
    limit: int = 1
    failover: bool = False
    min_replicas: int = 0
    failovers: int = FAILOVERS
    shared: float = 0.0
    fair: bool = False
    redlock: int = 0
    jobs: bool = False
    cluster: bool = False
    jobs_mode: str = ""

    def schedule(self) -> tuple[Fault, ...]:
        """The faults this run's seed schedules (failovers alone in the failover mode,
        the fair mode's own bag in the fair mode)."""
        if self.failover:
            return make_failover_schedule(self.seed, self.seconds, self.ttl, self.failovers)
        if self.cluster:
            return make_cluster_schedule(self.seed, self.seconds, self.ttl)
        if self.fair:
            return make_schedule(self.seed, self.seconds, self.ttl, FAIR_KINDS)
        if self.redlock:
            return make_schedule(self.seed, self.seconds, self.ttl, REDLOCK_KINDS)
        if self.jobs_mode:
            return make_schedule(self.seed, self.seconds, self.ttl, JOB_KINDS[self.jobs_mode])
        return make_schedule(self.seed, self.seconds, self.ttl)

    @property
    def mode(self) -> str:
        """``failover``, ``shared``, ``fair``, ``redlock``, ``jobs``, ``semaphore`` or
        ``mutex``."""
        if self.failover:
            return "failover"
        if self.cluster:
            return "cluster"
        if self.redlock:
            return "redlock"
        if self.jobs:
            return "jobs"
        if self.jobs_mode:
            return f"jobs-{self.jobs_mode}"
        if self.shared:
            return "shared"
        if self.fair:
            return "fair"
        return "semaphore" if self.limit > 1 else "mutex"

    @property
    def lock_names(self) -> tuple[str, ...]:
        return tuple(f"lock-{i}" for i in range(self.locks))

    @property
    def slots(self) -> tuple[str, ...]:
        """What holders are checked per: the locks, or, above ``limit`` 1, their permits."""
        if self.limit == 1:
            return self.lock_names
        return tuple(slot_name(lock, i) for lock in self.lock_names for i in range(self.limit))

    def replay(self) -> str:
        """The command line that replays this run (same seed, same schedule)."""
        parts = [
            "python -m chaos",
            f"--seed {self.seed}",
            f"--workers {self.workers}",
            f"--seconds {self.seconds:g}",
        ]
        if self.tasks != _DEFAULTS["tasks"]:
            parts.append(f"--tasks {self.tasks}")
        if self.locks != _DEFAULTS["locks"]:
            parts.append(f"--locks {self.locks}")
        if self.ttl != _DEFAULTS["ttl"]:
            parts.append(f"--ttl {self.ttl:g}")
        if self.engine is not None:
            parts.append(f"--engine {self.engine}")
        if self.sabotage:
            parts.append("--sabotage")
        if self.detached:
            parts.append(f"--detached {self.detached!r}")
        if self.limit != 1:
            parts.append(f"--limit {self.limit}")
        if self.failover:
            parts.append(f"--failover --min-replicas {self.min_replicas}")
            if self.failovers != FAILOVERS:
                parts.append(f"--failovers {self.failovers}")
        if self.shared:
            parts.append(f"--shared {self.shared!r}")
        if self.fair:
            parts.append("--fair")
        if self.redlock:
            parts.append(f"--redlock {self.redlock}")
        if self.jobs:
            parts.append("--jobs")
        if self.cluster:
            parts.append(f"--cluster --min-replicas {self.min_replicas}")
        if self.jobs_mode:
            parts.append(f"--jobs {self.jobs_mode}")
        return " ".join(parts)


def new_seed() -> int:
    """A random seed for a run that was given none."""
    return secrets.randbelow(2**32)


@dataclasses.dataclass(slots=True)
class _Worker:
    name: str
    proc: asyncio.subprocess.Process
    holders: tuple[str, ...]
    """The holder ids of its contenders (one per task)."""
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    holding: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    """Contender (holder id) -> (lock, fencing token) it holds now, by its last report."""
    waiting: dict[str, str] = dataclasses.field(default_factory=dict)
    """Contender (holder id) -> the lock it is asking for now, by its last report."""
    final: dict[str, Any] | None = None
    stderr: deque[str] = dataclasses.field(default_factory=lambda: deque(maxlen=40))
    told_to_stop: bool = False
    exited_early: bool = False
    tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)


class _Run:
    """One chaos run against ``server``, worker ``i`` through ``proxies[i]``; see the
    module's design note."""

    def __init__(
        self,
        config: ChaosConfig,
        server: RedisServer,
        proxies: Sequence[FaultProxy],
        workdir: Path,
        log: TextIO,
        replication: Replication | None = None,
        servers: Sequence[tuple[RedisServer, Sequence[FaultProxy]]] = (),
        cluster: ChaosCluster | None = None,
    ) -> None:
        self.config = config
        self.cluster = cluster
        """The cluster mode's cluster (its workers have no proxy)."""
        self.server = server
        self.servers = tuple(servers)
        """The Redlock mode's servers, each with its proxies (one per worker)."""
        self.replication = replication
        self._grant_waiters: list[asyncio.Future[tuple[str, str]]] = []
        self.proxies = tuple(proxies)
        self.workdir = workdir
        self.log = log
        self.history_path = workdir / "history.jsonl"
        self.store_path = workdir / "fenced.sqlite3"
        self.history = History(self.history_path)
        self.workers: list[_Worker] = []
        self.rounds: list[RoundReport] = []
        self.schedule = config.schedule()
        self.nemesis: Nemesis | None = None
        self.keys_expired = 0
        """Redlock mode: keys found at the exit that expired by their TTL (_keys_left)."""

    def holders(self) -> list[Target]:
        """The workers of which a contender holds a lock now (by their last reports)."""
        return [
            Target(w.name, w.proc.pid, index, w.holders)
            for index, w in enumerate(self.workers)
            if w.holding and w.proc.returncode is None
        ]

    def waiters(self) -> list[Target]:
        """The workers of which a contender waits for a lock and none holds one now."""
        return [
            Target(w.name, w.proc.pid, index, w.holders)
            for index, w in enumerate(self.workers)
            if w.waiting and not w.holding and w.proc.returncode is None
        ]

    def held_locks(self) -> list[str]:
        """The locks (slots) some contender holds now (by the last reports), sorted."""
        return sorted({lock for w in self.workers for lock, _ in w.holding.values()})

    def next_grant(self) -> asyncio.Future[tuple[str, str]]:
        """A future set to ``(holder, lock)`` by the next ``acquired`` report (for the
        nemesis's failover, which kills the primary right after a grant)."""
        future: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
        self._grant_waiters.append(future)
        return future

    def _granted(self, holder: str, lock: str) -> None:
        waiters, self._grant_waiters = self._grant_waiters, []
        for future in waiters:
            if not future.done():
                future.set_result((holder, lock))

    # -- workers ------------------------------------------------------------------------

    async def _spawn(self, index: int) -> _Worker:
        config = self.config
        name = f"worker-{index}"
        worker_config = WorkerConfig(
            index=index,
            name=name,
            url=self.proxies[index].url if self.proxies else self.server.url,
            locks=config.lock_names,
            ttl=config.ttl,
            seed=config.seed,
            history=str(self.history_path),
            store=str(self.store_path),
            parent_pid=os.getpid(),
            tasks=config.tasks,
            sabotage=config.sabotage,
            detached=config.detached,
            limit=config.limit,
            min_replicas=config.min_replicas,
            shared=config.shared,
            fair=config.fair,
            redlock=tuple(front[index].url for _, front in self.servers),
            jobs=config.jobs,
            cluster=self.cluster.urls if self.cluster is not None else (),
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _WORKER_CODE,
            worker_config.to_json(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        holders = tuple(holder_name(name, task) for task in range(config.tasks))
        worker = _Worker(name, proc, holders)
        worker.tasks = [
            asyncio.create_task(self._read_reports(worker)),
            asyncio.create_task(self._read_stderr(worker)),
        ]
        return worker

    async def _read_reports(self, worker: _Worker) -> None:
        stream = worker.proc.stdout
        assert stream is not None
        while line := await stream.readline():
            try:
                message = json.loads(line)
            except ValueError:
                worker.stderr.append("stdout: " + line.decode(errors="replace").rstrip())
                continue
            kind = message.get("k")
            if kind == "ready":
                worker.ready.set()
            elif kind == "asking":
                worker.waiting[str(message.get("holder", worker.name))] = str(message["lock"])
            elif kind == "acquired":
                holder = str(message.get("holder", worker.name))
                worker.waiting.pop(holder, None)
                worker.holding[holder] = (str(message["lock"]), int(message["fence"]))
                self._granted(holder, str(message["lock"]))
            elif kind == "round":
                worker.holding.pop(str(message.get("holder", worker.name)), None)
                worker.waiting.pop(str(message.get("holder", worker.name)), None)
                self.rounds.append(RoundReport.from_message(worker.name, message))
            elif kind == "final":
                worker.final = dict(message["stats"])
        if not worker.told_to_stop:
            worker.exited_early = True
        worker.holding.clear()
        worker.waiting.clear()

    async def _read_stderr(self, worker: _Worker) -> None:
        stream = worker.proc.stderr
        assert stream is not None
        while line := await stream.readline():
            worker.stderr.append(line.decode(errors="replace").rstrip())

    async def _start_workers(self) -> None:
        for index in range(self.config.workers):
            self.workers.append(await self._spawn(index))
        waits = [asyncio.create_task(w.ready.wait()) for w in self.workers]
        try:
            async with asyncio.timeout(_READY_TIMEOUT):
                await asyncio.gather(*waits)
        except TimeoutError:
            late = [w.name for w in self.workers if not w.ready.is_set()]
            raise RuntimeError(
                f"worker(s) {', '.join(late)} not ready within {_READY_TIMEOUT:g} s"
            ) from None
        finally:
            for wait in waits:
                wait.cancel()

    async def _stop_workers(self) -> None:
        """Close every worker's stdin, wait for them to exit, kill those that do not."""
        for worker in self.workers:
            worker.told_to_stop = True
            stdin = worker.proc.stdin
            if stdin is not None:
                stdin.close()
        waits = [asyncio.create_task(w.proc.wait()) for w in self.workers]
        await asyncio.wait(waits, timeout=_STOP_GRACE + 4 * self.config.ttl)
        await self._kill_workers()
        for worker in self.workers:  # read what they wrote before exiting
            await asyncio.wait(worker.tasks, timeout=5.0)

    async def _kill_workers(self) -> None:
        for worker in self.workers:
            if worker.proc.returncode is None:
                worker.stderr.append("(killed: did not stop in time)")
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGCONT)
                    worker.proc.kill()
        for worker in self.workers:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await worker.proc.wait()

    def _outcomes(self) -> list[WorkerOutcome]:
        outcomes = []
        for worker in self.workers:
            code = worker.proc.returncode
            died = None
            if worker.exited_early:
                died = f"died during the run (exit status {code})"
            elif code != 0:
                died = f"exited with status {code} when told to stop"
            elif worker.final is None:
                died = "exited without its final report"
            outcomes.append(
                WorkerOutcome(worker.name, code, died, worker.final or {}, tuple(worker.stderr))
            )
        return outcomes

    # -- the run ------------------------------------------------------------------------

    async def _progress(self, t0: float, nemesis: Nemesis) -> None:
        while True:
            await asyncio.sleep(_PROGRESS_EVERY)
            done = sum(1 for i in nemesis.injections if i.done)
            acquired = sum(1 for r in self.rounds if r.body_start is not None)
            print(
                f"chaos: {time.monotonic() - t0:.0f} of {self.config.seconds:g} s, "
                f"{acquired} acquisitions, {done} faults",
                file=self.log,
                flush=True,
            )

    def _nemesis(self, targets: Sequence[Target]) -> Nemesis:
        """The nemesis of this run's mode, aiming at the workers ``targets``."""
        config = self.config
        if self.cluster is not None:
            return ClusterNemesis(
                self.cluster,
                self.history,
                self.holders,
                targets,
                config.ttl,
                locks=config.lock_names,
                held_locks=self.held_locks,
                next_grant=self.next_grant,
                lose_keys=config.sabotage,
            )
        return Nemesis(
            self.server,
            self.proxies,
            self.history,
            self.holders,
            targets,
            config.ttl,
            replication=self.replication,
            next_grant=self.next_grant,
            waiters=self.waiters if config.fair else None,
            servers=self.servers,
            majority=config.sabotage and bool(config.redlock),
        )

    async def run(self) -> RunRecord:
        config = self.config
        started = time.monotonic()
        store = FencedStore(self.store_path)  # creates the schema before any worker runs
        try:
            try:
                await self._start_workers()
                targets = [
                    Target(w.name, w.proc.pid, i, w.holders) for i, w in enumerate(self.workers)
                ]
                self.nemesis = injector = self._nemesis(targets)
                t0 = time.monotonic()
                until = t0 + config.seconds
                nemesis = asyncio.create_task(injector.run(self.schedule, t0, until))
                progress = None
                if config.seconds >= 2 * _PROGRESS_EVERY:
                    progress = asyncio.create_task(self._progress(t0, injector))
                try:
                    await asyncio.sleep(max(0.0, until - time.monotonic()))
                    injector.stop()
                    await asyncio.wait({nemesis}, timeout=_NEMESIS_GRACE)
                finally:
                    for task in (nemesis, progress):
                        if task is not None and not task.done():
                            task.cancel()
                            await asyncio.wait({task})
                if not nemesis.cancelled() and nemesis.exception() is not None:
                    raise RuntimeError("the nemesis failed") from nemesis.exception()
                await injector.heal_all()
                await self._stop_workers()
                keys = await self._keys_left()
            finally:
                if self.nemesis is not None:
                    await self.nemesis.heal_all()
                await self._kill_workers()
            self._save()
            history = History.load(self.history_path)
            counters = {slot: store.read_int(counter_key(slot)) for slot in config.slots}
            return RunRecord(
                seed=config.seed,
                workers=config.workers,
                tasks=config.tasks,
                seconds=config.seconds,
                locks=config.slots,
                ttl=config.ttl,
                engine=f"{self.server.engine} {self.server.version}",
                schedule=self.schedule,
                injections=tuple(injector.injections),
                rounds=tuple(self.rounds),
                outcomes=tuple(self._outcomes()),
                intervals=tuple(history.intervals),
                pauses=tuple(history.pauses),
                attempts=tuple(store.attempts()),
                fenced_violations=tuple(check_fenced_writes(store)),
                counters=counters,
                keys_left=tuple(keys),
                keys_expired=self.keys_expired,
                wall_seconds=time.monotonic() - started,
                replay=config.replay(),
                limit=config.limit,
                failover=config.failover,
                min_replicas=config.min_replicas,
                replicas_started=self._replicas_started(),
                shared=config.shared,
                fair=config.fair,
                redlock=config.redlock,
                jobs=config.jobs,
                cluster=config.cluster,
            )
        finally:
            store.close()
            self.history.close()

    def _replicas_started(self) -> int:
        """Replicas started by the failover or cluster mode (0 in the others)."""
        if self.replication is not None:
            return self.replication.replicas_started
        return self.cluster.replicas_started if self.cluster is not None else 0

    def _save(self) -> None:
        """Write the schedule, what the nemesis did and every round to the work directory."""
        injections = self.nemesis.injections if self.nemesis is not None else []
        with open(self.workdir / "injections.jsonl", "w") as file:
            for injection in injections:
                file.write(json.dumps(injection.to_json()) + "\n")
        with open(self.workdir / "rounds.jsonl", "w") as file:
            for report in self.rounds:
                file.write(json.dumps(dataclasses.asdict(report)) + "\n")

    async def _keys_left(self) -> list[str]:
        """The lease keys left once every worker exited. In the Redlock mode, those found
        are looked at again a TTL later: an attempt answered after its round is given
        back in the background (see ``asynclock._lifecycle._redlock``), and a worker told
        to stop meanwhile leaves its key to the TTL (counted in ``keys_expired``)."""
        keys = await self._keys_now()
        if keys and self.config.redlock:
            await asyncio.sleep(self.config.ttl + _TTL_MARGIN)
            left = await self._keys_now()
            self.keys_expired = len(set(keys) - set(left))
            keys = left
        return keys

    async def _keys_now(self) -> list[str]:
        if self.cluster is not None:
            return await self.cluster.keys_left()
        server = self.replication.primary if self.replication is not None else self.server
        servers = [s for s, _ in self.servers] or [server]
        found = []
        for index, one in enumerate(servers):
            client = Redis.from_url(one.url, socket_timeout=5.0, socket_connect_timeout=5.0)
            try:
                keys = await keys_left(client)
            finally:
                await client.aclose()
            found += [f"server-{index}:{key}" if self.servers else key for key in keys]
        return found


async def run_chaos(config: ChaosConfig, log: TextIO | None = None) -> tuple[Summary, Path]:
    """Run the chaos test described by ``config``; return its summary and work directory.

    ``log`` receives progress lines (default: stderr). The work directory holds the
    shared history and fenced store; it is deleted when the run passes (unless
    ``config.keep``), and kept when it fails.

    Raises:
        RuntimeError: no server binary, a server or worker that did not start.
    """
    log = sys.stderr if log is None else log
    if config.jobs_mode:
        from ._jobs import run_job_mode  # (it imports this module)

        return await run_job_mode(config, log)
    workdir = Path(tempfile.mkdtemp(prefix="asynclock-chaos-"))
    server: RedisServer | None = None
    passed = False
    try:
        async with contextlib.AsyncExitStack() as stack:
            replication: Replication | None = None
            cluster: ChaosCluster | None = None
            fronts: list[tuple[RedisServer, Sequence[FaultProxy]]] = []
            if config.failover:  # a primary and a replica, synced before any worker runs
                replication = await stack.enter_async_context(Replication(config.engine))
                server = replication.primary
            elif config.cluster:  # three primaries with a replica each, no proxy
                cluster = await stack.enter_async_context(ChaosCluster(config.engine))
                server = cluster.nodes[0]
            elif config.redlock:  # independent servers, a proxy per worker in front of each
                for _ in range(config.redlock):
                    one = RedisServer(config.engine)
                    stack.push_async_callback(asyncio.to_thread, one.stop)
                    await asyncio.to_thread(one.start)
                    front = [
                        await stack.enter_async_context(FaultProxy(one.host, one.port))
                        for _ in range(config.workers)
                    ]
                    fronts.append((one, front))
                server = fronts[0][0]
            else:
                server = RedisServer(config.engine)
                stack.push_async_callback(asyncio.to_thread, server.stop)
                await asyncio.to_thread(server.start)
            if fronts:
                proxies = list(fronts[0][1])
            elif cluster is not None:
                proxies = []
            else:
                proxies = [
                    await stack.enter_async_context(FaultProxy(server.host, server.port))
                    for _ in range(config.workers)
                ]
            record = await _Run(
                config, server, proxies, workdir, log, replication, fronts, cluster
            ).run()
        summary = summarize(record)
        passed = summary.ok
        return summary, workdir
    finally:
        if passed and not config.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _print_summary(
    config: ChaosConfig, summary: Summary, workdir: Path, as_json: bool, out: TextIO
) -> None:
    print("", *summary.lines, sep="\n", file=out)
    if summary.ok:
        kept = f" (files kept in {workdir})" if config.keep else ""
        print(f"OK: every check passed{kept}", file=out)
    else:
        print("", "failures:", *(f"  - {f}" for f in summary.failures), sep="\n", file=out)
        if summary.details:
            print("details:", *(f"  {d}" for d in summary.details), sep="\n", file=out)
        print(f"files kept in {workdir}", file=out)
        print(f"FAILED: replay with {config.replay()}", file=out)
    if as_json:
        print(json.dumps(summary.data, separators=(",", ":")), file=out)
    out.flush()


def run(config: ChaosConfig, *, as_json: bool = False, out: TextIO | None = None) -> int:
    """Run, print the one summary to ``out`` (default stdout), return the exit status.

    0 when every must-be-0 figure is 0 and no worker died, 1 when a check failed, 2 when
    the run could not be carried out, 130 when interrupted.
    """
    out = sys.stdout if out is None else out
    schedule = config.schedule()
    mode = mode_text(config, config.jobs_mode)
    print(
        f"asynclock chaos: seed {config.seed}, {config.workers} workers x {config.tasks} "
        f"tasks, {config.locks} locks{of_limit(config.limit)}, ttl {config.ttl:g} s, "
        f"{config.seconds:g} s{mode}, "
        f"{len(schedule)} faults scheduled (replay: {config.replay()})",
        file=out,
        flush=True,
    )

    async def main() -> tuple[Summary, Path]:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        return await run_chaos(config)

    try:
        summary, workdir = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: every worker and the server were stopped", file=out, flush=True)
        return 130
    except RuntimeError as exc:
        print(f"asynclock chaos: the run could not be carried out: {exc}", file=out, flush=True)
        print(f"FAILED: replay with {config.replay()}", file=out, flush=True)
        return 2
    _print_summary(config, summary, workdir, as_json, out)
    return 0 if summary.ok else 1


def print_schedule(config: ChaosConfig, out: TextIO | None = None) -> None:
    """Print the faults ``config``'s seed schedules, one per line."""
    out = sys.stdout if out is None else out
    for fault in config.schedule():
        print(fault.describe(), file=out)
