"""A chaos worker process: contends for a few locks until told to stop.

Started by the chaos run as ``python -c "from chaos._worker import main; ..."``
with one JSON argument (a :class:`WorkerConfig`). It runs ``tasks`` contenders, asyncio
tasks that all share the process's one Redis client (so a release by one can hand the
lock straight to another waiting in the client's local line). Each contender loops over
rounds: it takes one of the locks (seeded choice) with :func:`asynclock.lease`, records
its guarded interval in the shared :class:`~asynclock.testing.History` under a holder id
of its own (``worker-N/tK``, see :func:`holder_name`), does a few fenced
read-increment-write steps on the lock's counter in the shared
:class:`~asynclock.testing.FencedStore` (checking ``await lock.is_held()`` before each),
sometimes verifies the lease with Redis, and releases. Every error a fault can cause
(``LockLost``, ``AcquireTimeout``, Redis and socket errors, a busy database) ends the
round, is counted, and the contender's next round starts.

It reports to the parent on stdout, one JSON object per line: ``ready``, ``acquired``
(when a body starts), ``round`` (how each round ended, with the times the detection
latency is computed from) and, last, ``final`` (its counters, summed over its
contenders). It stops when its stdin reaches EOF: a contender's round in its body may
finish (up to 3 TTLs), a contender's acquire in progress is cancelled. It never outlives
the parent: on Linux it asks the kernel for ``SIGKILL`` when the parent dies
(``PR_SET_PDEATHSIG``), which also reaches a worker stopped by ``SIGSTOP``, and stdin EOF
covers the rest.

Design note: the store's SQLite calls run in worker threads (``abandon_on_cancel``), not
on the event loop. A worker stopped by ``SIGSTOP`` inside a SQLite transaction holds the
database's write lock for the length of its pause; done on the loop, another worker's
next call would block its event loop for that long, its lease would then outlive its
deadline without the body being cancelled, and the run would report an overlap that is
an artefact of the test fixture, not of asynclock. In a thread, the body stays
cancellable; a call abandoned by a cancellation completes in the background, and
fencing decides whether it lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import random
import re
import signal
import sqlite3
import sys
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, Final

import anyio
import anyio.to_thread
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

import asynclock
from asynclock.testing import FencedStore, Guard, History

from ._cluster import cluster_client

__all__ = ["WorkerConfig", "counter_key", "holder_name", "main", "slot_name"]

_PR_SET_PDEATHSIG: Final = 1


def _drift(ttl: float) -> float:
    """The clock-rate allowance a lease's ``safe_until`` keeps off its TTL, in seconds:
    1% of the TTL plus 2 ms (docs/design.md, the deadline), so that ``safe_until -
    (ttl - drift)`` is the loop time at which the acquire was sent."""
    return ttl * 0.01 + 0.002


_STOP_GRACE: Final = 3.0  # TTLs a round in its body may take to finish after a stop
_STEPS: Final = (3, 8)  # fenced increments per round
_STEP_SLEEP: Final = (0.03, 0.2)  # TTLs slept after each increment
_READ_WRITE_PAUSE: Final = (0.002, 0.02)  # seconds between an increment's read and write
_SABOTAGE_SLOWER: Final = 10.0  # sabotaged bodies sleep this much longer, outliving leases
_BETWEEN_ROUNDS: Final = (0.0, 0.15)  # TTLs slept between rounds
_VERIFY: Final = 0.25  # share of rounds that verify the lease with Redis before leaving
_FAIR_WAIT: Final = 12.0  # TTLs a fair waiter waits (past the queue's bound for a dead waiter)
_FAIR_LEAVING: Final = 0.25  # share of fair waiters that give up early ...
_FAIR_LEAVE_AFTER: Final = (0.5, 2.0)  # ... after this many TTLs
_JOB_GENERATION: Final = 5.0  # TTLs of wall time a generation of job keys lasts
_JOB_KEYS: Final = 3  # job keys per generation
_JOB_RESULT_TTL: Final = 600.0  # seconds a job's result is kept
_JUMPERS: Final = 1 / 3  # share of rounds a sabotaged fair mode takes with a plain lease()


_WARNINGS: Final = (  # (text in an asynclock warning, the key it is counted under)
    ("stall", "event loop stall"),
    ("lost:", "lease lost"),
    ("refreshing before use", "acquire answered too late"),
    ("could not undo", "abandoned acquire not undone"),
    ("did not complete", "release not completed"),
    ("may not have been stored", "job result store unconfirmed"),
)


def counter_key(lock: str) -> str:
    """The key of the fenced counter that lock ``lock`` guards in the store."""
    return f"counter:{lock}"


def slot_name(lock: str, permit: int) -> str:
    """What the semaphore mode records a permit's holders under: ``lock-0#2`` for permit 2
    of ``lock-0``. Each permit is checked like a lock of its own (no overlap, tokens in
    order, its own fenced counter), so N permits hold at most N holders at once."""
    return f"{lock}#{permit}"


Held = asynclock.Lease | asynclock.RedlockLease
"""A lease of one server, or (the Redlock mode) of a majority of several."""


def _slot_of(lease: Held, limit: int) -> str:
    """The slot a lease holds: its lock's name, or, for a permit, :func:`slot_name`."""
    if limit == 1 or not isinstance(lease, asynclock.Lease):
        return lease.name
    head, _, index = lease.key.rpartition(":permit:")
    if not head or not index.isdigit() or not 0 <= int(index) < limit:
        raise AssertionError(f"a permit key out of the semaphore's range: {lease.key!r}")
    return slot_name(lease.name, int(index))


def holder_name(worker: str, task: int) -> str:
    """The holder id that contender ``task`` of worker process ``worker`` records its
    intervals (and fenced writes) under: every contender is a holder of its own, so two
    contenders of one process holding one lock at once are an overlap like any other."""
    return f"{worker}/t{task}"


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What one worker process is told (as JSON on its command line). Times in seconds."""

    index: int
    name: str
    url: str
    locks: tuple[str, ...]
    ttl: float
    seed: int
    history: str
    store: str
    parent_pid: int
    prefix: str = "asynclock:"
    tasks: int = 1
    """Contenders (asyncio tasks) in the process, all sharing its one Redis client."""
    sabotage: bool = False
    """A negative control: bodies ignore ``is_held()`` and are shielded from the lease's
    cancellation, so they run on after a loss (the checks must then fail)."""
    detached: float = 0.0
    """The share of rounds holding the lease with ``acquire()``, ``guard()`` and
    ``release()`` instead of ``async with lease(...)`` (drawn from a random stream of its
    own, so the other choices of a seed stay as they were)."""
    limit: int = 1
    """Above 1, the semaphore mode: each lock is ``lease(..., limit=limit)``, and each
    permit is recorded as a slot of its own (:func:`slot_name`)."""
    min_replicas: int = 0
    """Above 0 (the failover mode): ``lease(..., min_replicas=min_replicas)``; an
    acquisition that too few replicas confirmed ends the round as ``unconfirmed``."""
    shared: float = 0.0
    """The shared mode, above 0: the share of rounds holding ``lease(..., shared=True)``
    (drawn from a random stream of its own); such a round's body only reads (a fenced
    claim, then a read of the counter) and its interval is recorded as shared."""
    redlock: tuple[str, ...] = ()
    """The Redlock mode: the URLs of the independent servers (through this worker's
    proxies); each lease is ``lease([client, ...], name)`` over one client per URL."""
    jobs: bool = False
    """The jobs mode: each round calls ``asynclock.once()`` for one of a few job keys of
    the moment (``job-<generation>-<k>``, the generation moving every 5 TTLs of wall
    time, so several contenders of several processes call each key), with a job that
    records its run as a guarded interval under the key and returns a value of its own;
    the round reports the result it got (``result``) and whether its job ran (``ran``)."""
    fair: bool = False
    """The fair mode: every round takes ``lease(..., fair=True)``, waiting up to 12 TTLs
    (a quarter of them give up after 0.5-2 TTLs: waiters that leave); with ``sabotage``,
    a third of them take a plain ``lease()`` instead, which does not queue."""

    cluster: tuple[str, ...] = ()
    """The cluster mode: every node's URL; the worker's client is then a
    ``RedisCluster`` that may start from any of them (``url`` is not used)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        data = json.loads(text)
        data["locks"] = tuple(data["locks"])
        data["redlock"] = tuple(data.get("redlock", ()))
        data["cluster"] = tuple(data.get("cluster", ()))
        return cls(**data)


def _client(url: str, ttl: float) -> Redis:
    return Redis.from_url(
        url,
        socket_timeout=max(1.0, 2 * ttl),
        socket_connect_timeout=1.0,
        retry=Retry(ExponentialBackoff(cap=0.25, base=0.02), 2),
    )


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit if it already has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(3)


class _Reporter:
    """Writes one JSON line per message to stdout (the parent's pipe)."""

    def __init__(self) -> None:
        self._out = sys.stdout.buffer

    def __call__(self, message: str, /, **fields: Any) -> None:
        line = json.dumps({"k": message, "t": time.monotonic(), **fields}, separators=(",", ":"))
        try:
            self._out.write(line.encode() + b"\n")
            self._out.flush()
        except (OSError, ValueError):  # the parent is gone: PDEATHSIG / stdin EOF stop us
            pass


class _CountWarnings(logging.Handler):
    """Counts asynclock's warnings by their first words (stall, undo, release, lost...)."""

    def __init__(self, counts: Counter[str]) -> None:
        super().__init__(logging.WARNING)
        self._counts = counts

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        known = (key for needle, key in _WARNINGS if needle in text)
        generic = " ".join(re.sub(r"'[^']*'", "*", text).split()[:5])
        self._counts[next(known, generic)] += 1


@dataclasses.dataclass(slots=True)
class _Round:
    """What one round saw; sent to the parent as a ``round`` message."""

    lock: str
    """The lock's name until it is held; then the slot held (a permit, in the semaphore
    mode: :func:`slot_name`)."""
    fence: int | None = None
    outcome: str = "cancelled"
    """``released``, ``lost``, ``timeout``, ``unconfirmed`` (``ReplicationTimeout``),
    ``error``, ``unexpected`` or ``cancelled``."""
    reason: str | None = None
    error: str | None = None
    body_start: float | None = None
    body_end: float | None = None
    safe_until: float | None = None
    lost_at: float | None = None
    left_at_end: float | None = None
    """Seconds of the lease left when the body returned normally (None: it did not)."""
    increments: int = 0
    refused: int = 0
    lease_from: float | None = None
    """The loop time the lease counts from (the confirmed send of its grant: our own
    acquire attempt, or a sibling's release that handed it to us); None if not acquired."""
    exit_end: float | None = None
    """When ``async with`` had finished (released or not), if the body was entered."""
    form: str = "block"
    """How the lease was held: ``block`` (``async with lease``) or ``detached``."""
    kind: str = "exclusive"
    """What was asked for: ``exclusive``, ``shared``, ``fair`` or, in a sabotaged fair
    mode, ``plain`` (a ``lease()`` that jumps the queue)."""
    asked_at: float | None = None
    """Loop time just before the lease was asked for."""
    waited_until: float | None = None
    """Loop time the wait ended: the lease in hand, or the acquire's exception caught."""
    blocking_timeout: float | None = None
    result: str | None = None
    """The jobs mode: the result ``once()`` returned to this round."""
    ran: str | None = None
    """The jobs mode: the value this round's job returned, if it ran to its end."""

    def message(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Worker:
    """The process: one Redis client, history and store, shared by its contenders."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.report = _Reporter()
        self.stats: Counter[str] = Counter()
        self.warnings: Counter[str] = Counter()
        self.client: Redis | RedisCluster = (
            cluster_client(config.cluster, config.ttl)
            if config.cluster
            else _client(config.url, config.ttl)
        )
        self.servers = [_client(url, config.ttl) for url in config.redlock]
        """The Redlock mode's clients, one per server (else empty)."""
        self.history = History(config.history)
        self.store = FencedStore(config.store, busy_timeout=10.0)
        self.contenders = [_Contender(self, task) for task in range(max(1, config.tasks))]

    async def run(self) -> int:
        handler = _CountWarnings(self.warnings)
        logger = logging.getLogger("asynclock")
        logger.addHandler(handler)
        logger.propagate = False
        stop = asyncio.Event()
        watcher = asyncio.create_task(_wait_for_eof(stop))
        self.report("ready", pid=os.getpid(), tasks=len(self.contenders))
        try:
            async with asyncio.TaskGroup() as group:
                for contender in self.contenders:
                    group.create_task(contender.run(stop))
        finally:
            watcher.cancel()
            await asyncio.wait({watcher})
            await self.client.aclose()
            for client in self.servers:
                await client.aclose()
            self.store.close()
            self.history.close()
            stats = {**self.stats, "warnings": dict(self.warnings)}
            self.report("final", stats=stats)
        return 0


class _Contender:
    """One contender of a worker process: its own rounds, random choices and holder id.

    Everything that belongs to a round (the lock chosen, whether its body is running, the
    interval recorded) is the contender's own; the process's stats are shared.
    """

    def __init__(self, worker: _Worker, task: int) -> None:
        config = worker.config
        self.worker = worker
        self.config = config
        self.task = task
        self.holder = holder_name(config.name, task)
        # contender 0 draws what the single contender of a worker drew before
        suffix = f":{task}" if task else ""
        self.rng = random.Random(f"asynclock-chaos:{config.seed}:{config.index}{suffix}")
        self.forms = random.Random(f"asynclock-chaos:{config.seed}:{config.index}{suffix}:form")
        self.sharing = random.Random(f"asynclock-chaos:{config.seed}:{config.index}{suffix}:shared")
        self.fairness = random.Random(f"asynclock-chaos:{config.seed}:{config.index}{suffix}:fair")
        self.in_body = False
        self.runs = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._one_round(stop)
            if not stop.is_set():
                pause = self.rng.uniform(*_BETWEEN_ROUNDS) * self.config.ttl
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await stop.wait()

    async def _one_round(self, stop: asyncio.Event) -> None:
        """Run one round as a task, so that a stop can cancel it (or let its body finish:
        this contender's body, whatever the process's other contenders are doing)."""
        task = asyncio.create_task(self._round())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                grace = _STOP_GRACE * self.config.ttl if self.in_body else 0.0
                await asyncio.wait({task}, timeout=grace)
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        finally:
            stopping.cancel()
            await asyncio.wait({stopping})

    def _hook(self, state: _Round) -> asynclock.EventHook:
        history = self.worker.history
        stats = self.worker.stats

        def hook(event: asynclock.LeaseEvent) -> None:
            if event.kind is asynclock.LeaseEventKind.LOST:
                # recorded under the slot held (a permit's, in the semaphore mode)
                history.mark_lost(state.lock, event.fencing_token, event.detail or "lost")
                if state.lost_at is None:
                    state.lost_at = event.at
            stats[f"event:{event.kind}"] += 1

        return hook

    async def _job_round(self) -> None:
        """A round of the jobs mode: ``once()`` for a job key of the moment."""
        config, worker = self.config, self.worker
        generation = int(time.time() / (_JOB_GENERATION * config.ttl))
        key = f"job-{generation}-{self.rng.randrange(_JOB_KEYS)}"
        steps = self.rng.randint(*_STEPS)
        state = _Round(key, kind="job", blocking_timeout=3 * config.ttl)
        worker.stats["rounds"] += 1
        self.runs += 1
        value = f"{self.holder}#{self.runs}"

        async def job() -> str:
            token = int(time.time() * 1e6)  # (once() shows no token: a time that rises)
            state.fence = token
            guard = Guard(worker.history, key, self.holder, token)
            with guard:
                worker.report("acquired", lock=key, fence=token, holder=self.holder)
                try:
                    for _ in range(steps):
                        pause = self.rng.uniform(*_STEP_SLEEP) * config.ttl
                        if config.sabotage:  # the job outlives the lease
                            with anyio.CancelScope(shield=True):
                                await asyncio.sleep(pause * _SABOTAGE_SLOWER)
                        else:
                            await asyncio.sleep(pause)
                    state.ran = value
                    return value
                finally:
                    assert guard.start is not None
                    state.body_start = guard.start
                    state.body_end = time.monotonic()

        state.asked_at = time.monotonic()
        worker.report("asking", lock=key, holder=self.holder)
        try:
            result = await asynclock.once(
                worker.client,
                key,
                job,
                ttl=config.ttl,
                result_ttl=_JOB_RESULT_TTL,
                blocking_timeout=state.blocking_timeout,
                prefix=config.prefix,
            )
            state.outcome, state.result = "released", str(result)
        except asynclock.LockLost as exc:
            state.outcome, state.reason = "lost", exc.reason.value
        except asynclock.AcquireTimeout:
            state.outcome = "timeout"
        except (RedisError, OSError) as exc:
            state.outcome, state.error = "error", type(exc).__name__
        except asyncio.CancelledError:
            state.outcome = "cancelled"
            raise
        except Exception as exc:
            state.outcome, state.error = "unexpected", repr(exc)
            traceback.print_exc(file=sys.stderr)
        finally:
            state.waited_until = time.monotonic()
            worker.stats[f"outcome:{state.outcome}"] += 1
            worker.report("round", holder=self.holder, **state.message())

    async def _round(self) -> None:
        if self.config.jobs:
            await self._job_round()
            return
        config = self.config
        worker = self.worker
        stats = worker.stats
        lock_name = self.rng.choice(config.locks)
        steps = self.rng.randint(*_STEPS)
        verify = self.rng.random() < _VERIFY
        state = _Round(lock_name)
        stats["rounds"] += 1
        lock: Held | None = None
        guard: Guard | None = None
        hold = _held_detached if self.forms.random() < config.detached else asynclock.lease
        if hold is _held_detached:
            state.form = "detached"
        kind: dict[str, Any] = {"limit": config.limit} if config.limit > 1 else {}
        if config.min_replicas:
            kind["min_replicas"] = config.min_replicas
        state.kind, kind_options, state.blocking_timeout = self._kind()
        kind.update(kind_options)
        state.asked_at = time.monotonic()
        worker.report("asking", lock=lock_name, holder=self.holder)
        target: Any = worker.servers if worker.servers else worker.client
        try:
            async with hold(
                target,
                lock_name,
                **kind,
                ttl=config.ttl,
                blocking_timeout=state.blocking_timeout,
                release_timeout=config.ttl,
                prefix=config.prefix,
                on_event=self._hook(state),
            ) as lock:
                state.waited_until = time.monotonic()
                state.lock = _slot_of(lock, config.limit)
                state.fence = lock.fencing_token
                # safe_until is t_send + ttl - drift until the first renewal is confirmed
                # (no await yet; the detached form's guard entry is one checkpoint, too
                # short for a renewal to be sent and answered)
                state.lease_from = lock.safe_until - (config.ttl - _drift(config.ttl))
                self.in_body = True
                try:
                    shared = state.kind == "shared"
                    guard = Guard(
                        worker.history,
                        state.lock,
                        self.holder,
                        lock.fencing_token,
                        lock if isinstance(lock, asynclock.Lease) else None,
                        shared=shared,
                    )
                    with guard:
                        worker.report(
                            "acquired",
                            lock=state.lock,
                            fence=lock.fencing_token,
                            holder=self.holder,
                        )
                        await self._body(lock, state, steps, verify, shared)
                        state.left_at_end = lock.time_left
                finally:
                    self.in_body = False
            state.outcome = "released"
        except asynclock.LockLost as exc:
            state.outcome, state.reason = "lost", exc.reason.value
        except asynclock.AcquireTimeout:
            state.outcome = "timeout"
        except asynclock.ReplicationTimeout as exc:  # (a TimeoutError: before OSError)
            state.outcome, state.error = "unconfirmed", type(exc).__name__
        except (RedisError, OSError, sqlite3.Error) as exc:  # TimeoutError is an OSError
            state.outcome, state.error = "error", type(exc).__name__
            if lock is not None and lock.lost_reason is not None:
                state.reason = lock.lost_reason.value  # the body's error came out instead
        except asyncio.CancelledError:
            state.outcome = "cancelled"
            raise
        except Exception as exc:
            state.outcome, state.error = "unexpected", repr(exc)
            traceback.print_exc(file=sys.stderr)
        finally:
            if state.waited_until is None:
                state.waited_until = time.monotonic()
            if guard is not None and guard.interval is not None:
                state.body_start, state.body_end = guard.interval.start, guard.interval.end
                state.exit_end = time.monotonic()
            if lock is not None:
                state.safe_until = lock.safe_until
            stats[f"outcome:{state.outcome}"] += 1
            if state.reason is not None:
                stats[f"lost:{state.reason}"] += 1
            if state.error is not None:
                stats[f"error:{state.error}"] += 1
            worker.report("round", holder=self.holder, **state.message())

    def _kind(self) -> tuple[str, dict[str, Any], float]:
        """What this round asks for, its options and its ``blocking_timeout``, from
        random streams of their own (the other choices of a seed stay as they were)."""
        config = self.config
        if config.fair:
            wait = _FAIR_WAIT * config.ttl
            if self.fairness.random() < _FAIR_LEAVING:
                wait = self.fairness.uniform(*_FAIR_LEAVE_AFTER) * config.ttl
            if config.sabotage and self.fairness.random() < _JUMPERS:
                return "plain", {}, wait
            return "fair", {"fair": True}, wait
        if config.shared and self.sharing.random() < config.shared:
            return "shared", {"shared": True}, 3 * config.ttl
        return "exclusive", {}, 3 * config.ttl

    async def _body(
        self, lock: Held, state: _Round, steps: int, verify: bool, shared: bool
    ) -> None:
        if self.config.sabotage and not self.config.fair:
            with anyio.CancelScope(shield=True):
                await self._steps(lock, state, steps, check=False, shared=shared)
            return
        await self._steps(lock, state, steps, check=True, shared=shared)
        if verify and not await _verified(lock):
            self.worker.stats["verify_false"] += 1

    async def _steps(
        self, lock: Held, state: _Round, steps: int, check: bool, shared: bool
    ) -> None:
        ttl = self.config.ttl
        for _ in range(steps):
            if check and not await lock.is_held():
                self.worker.stats["is_held_false"] += 1
                return
            if shared:
                read = await self._read(lock)
                self.worker.stats["shared_reads" if read else "shared_reads_refused"] += 1
            elif await self._increment(lock):
                state.increments += 1
            else:
                state.refused += 1
            slow = 1.0 if check else _SABOTAGE_SLOWER
            await asyncio.sleep(self.rng.uniform(*_STEP_SLEEP) * ttl * slow)

    async def _read(self, lock: Held) -> bool:
        """A shared holder's fenced read: claim with its token (so that an older writer's
        later write is refused), then read; False if a newer token had claimed."""
        store, token = self.worker.store, lock.fencing_token
        key = counter_key(_slot_of(lock, self.config.limit))
        holder = self.holder

        def claim_and_read() -> bool:
            if not store.claim(key, token, holder=holder):
                return False
            store.read_int(key)
            return True

        return await anyio.to_thread.run_sync(claim_and_read, abandon_on_cancel=True)

    async def _increment(self, lock: Held) -> bool:
        """``FencedStore.increment(key, fencing_token=...)``, with each SQLite call in a
        thread (see the module's design note): claim, read, pause, write."""
        store, token = self.worker.store, lock.fencing_token
        key = counter_key(_slot_of(lock, self.config.limit))
        holder = self.holder

        def claim_and_read() -> int | None:
            if not store.claim(key, token, holder=holder):
                return None
            return store.read_int(key)

        value = await anyio.to_thread.run_sync(claim_and_read, abandon_on_cancel=True)
        if value is None:
            return False
        await asyncio.sleep(self.rng.uniform(*_READ_WRITE_PAUSE))

        def write() -> bool:
            return store.write(key, value + 1, token, holder=holder)

        return await anyio.to_thread.run_sync(write, abandon_on_cancel=True)


async def _verified(lock: Held) -> bool:
    """``is_held(verify=True)``: asked of Redis (a Redlock lease answers from its
    majority's deadlines, which is all it has)."""
    if isinstance(lock, asynclock.Lease):
        return await lock.is_held(verify=True)
    return await lock.is_held()


async def _wait_for_eof(stop: asyncio.Event) -> None:
    """Set ``stop`` once stdin reaches EOF (the parent closed it, or died)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        while await reader.read(4096):
            pass
    finally:
        transport.close()
        stop.set()


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process; ``argv[0]`` is a :class:`WorkerConfig` as JSON."""
    args = sys.argv[1:] if argv is None else argv
    config = WorkerConfig.from_json(args[0])
    _die_with_parent(config.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's
    return asyncio.run(_Worker(config).run())


@contextlib.asynccontextmanager
async def _held_detached(client: Redis, name: str, **options: Any) -> AsyncIterator[Held]:
    """``async with lease(...)`` rebuilt from the detached form: ``acquire()``, the work
    inside ``guard()``, then ``release()`` (which, with the guard's ``LockLost`` in flight,
    lets it through)."""
    lock = await asynclock.acquire(client, name, **options)
    try:
        async with lock.guard():
            yield lock
    finally:
        await lock.release()
