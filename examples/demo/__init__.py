"""``python -m examples.demo`` (``./dev demo``): worker processes compete for one lease,
then things go wrong.

The scenario: N worker processes (each its own Python interpreter, event loop and Redis
client) take turns holding one lease, renewing it while they "work". About a third into
the run the demo SIGKILLs whichever worker holds the lease; the others only take over once
the dead holder's key has expired. About two thirds in, the demo deletes the lease key from
outside; the holder's watchdog notices, its work is cancelled and ``LockLost`` is raised.
At the end the workers are stopped (releasing what they hold) and a summary is printed; the
exit status says whether everything happened as expected.

Design note. The parent is plain synchronous code: a reader thread per worker pipe turns
the worker's stdout (one JSON object per line) into messages on a queue, and the main thread
drives the scenario by pumping that queue until some condition holds or a deadline
passes, so every wait is bounded and Ctrl-C lands in ordinary code that kills the workers.
Workers stamp each event with ``time.monotonic()``, which on Linux is one clock for every
process, and the parent prints the timeline through a short reorder buffer so the lines
come out in time order even though they arrive through different pipes. Workers run in
their own session (a terminal's Ctrl-C reaches only the parent) and stop when their stdin
reaches EOF: the parent closes it to stop them, and if the parent dies the kernel closes
it for them, so no worker outlives the demo. The demo strikes (kill, delete) 0.15 TTL after
an acquisition it has seen: the holder's work lasts at least 0.8 TTL, so it surely still
holds the lease, and its first renewal (at 1/3 TTL) is still to come and finds the deletion.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Final, TextIO

import redis
import redis.asyncio
from redis.exceptions import RedisError

import asynclock
from asynclock.testing import RedisServer

__all__ = ["DemoConfig", "run_demo", "worker_main"]

_LOCK_NAME: Final = "demo"
_TICK: Final = 0.05  # seconds between timeline flushes while the parent waits
_LAG: Final = 0.15  # seconds a timeline line is held back so late arrivals sort before it
_STOP_GRACE: Final = 5.0  # seconds the workers get to stop before they are killed
_PHASE_WAIT: Final = 8.0  # seconds (plus a few TTLs) any one step of the scenario may take
_STRIKE_AFTER: Final = 0.15  # kill / delete this many TTLs after an acquisition ...
_STRIKE_BEFORE: Final = 0.28  # ... and no later than this (the first renewal is at 1/3)
_WORKER_CODE: Final = (
    "import sys; from examples.demo import worker_main; sys.exit(worker_main(sys.argv[1:]))"
)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What ``python -m examples.demo`` (``./dev demo``) was asked to do. Times in seconds."""

    url: str | None = None
    """An existing server to use; None starts a private one."""
    workers: int = 4
    seconds: float = 20.0
    ttl: float = 1.5
    name: str = _LOCK_NAME


# --------------------------------------------------------------------------------------
# The worker process
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _WorkerConfig:
    name: str
    url: str
    lock_name: str
    ttl: float
    seed: int


class _Reporter:
    """Writes one JSON line per event to the parent; silent once the parent is gone."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._broken = False

    def __call__(self, kind: str, **fields: object) -> None:
        if self._broken:
            return
        record = {"t": time.monotonic(), "kind": kind, **fields}
        try:
            self._stream.write(json.dumps(record).encode() + b"\n")
            self._stream.flush()
        except (OSError, ValueError):  # the parent is gone; stdin EOF will stop us
            self._broken = True
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._stream.fileno())


class _LogToTimeline(logging.Handler):
    """Sends asynclock's own warnings to the parent as timeline lines."""

    def __init__(self, report: _Reporter) -> None:
        super().__init__(logging.WARNING)
        self._report = report

    def emit(self, record: logging.LogRecord) -> None:
        self._report("log", level=record.levelname, detail=record.getMessage())


@dataclass(slots=True)
class _Progress:
    """How far one hold's work got, and how it ended."""

    steps: int
    step: int = 0
    outcome: str = "running"  # finished | cancelled | checked (is_held() said no)


def worker_main(argv: list[str]) -> int:
    """Entry point of a worker process; ``argv`` is one JSON object (a ``_WorkerConfig``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    config = _WorkerConfig(**json.loads(argv[0]))
    report = _Reporter(sys.stdout.buffer)
    logger = logging.getLogger("asynclock")
    logger.addHandler(_LogToTimeline(report))
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    return asyncio.run(_worker(config, report))


async def _worker(config: _WorkerConfig, report: _Reporter) -> int:
    client = redis.asyncio.Redis.from_url(config.url)
    counter = [0]
    compete = asyncio.create_task(_compete(client, config, report, counter))
    stop = asyncio.create_task(_stdin_closed())
    status = 0
    try:
        await asyncio.wait({compete, stop}, return_when=asyncio.FIRST_COMPLETED)
        compete.cancel()  # releases the lease if held: the lease's exit is shielded
        try:
            await compete
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            report("error", detail=repr(exc))
            status = 1
    finally:
        stop.cancel()
        await client.aclose()
    report("stopped", acquisitions=counter[0])
    return status


async def _stdin_closed() -> None:
    """Return once the parent closes our stdin (or dies)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        while await reader.readline():
            pass
    finally:
        transport.close()


async def _compete(
    client: redis.asyncio.Redis, config: _WorkerConfig, report: _Reporter, counter: list[int]
) -> None:
    """Acquire, work, release, pause; forever (until cancelled)."""
    rng = random.Random(config.seed)
    ttl = config.ttl
    blocking_timeout = 4 * ttl

    def hook(event: asynclock.LeaseEvent) -> None:
        if event.kind is not asynclock.LeaseEventKind.ACQUIRED:  # reported by the body
            left = max(0.0, event.safe_until - event.at)
            report(event.kind.value, fence=event.fencing_token, left=left, detail=event.detail)

    while True:
        progress = _Progress(steps=rng.randint(4, 7))
        started = time.monotonic()
        try:
            async with asynclock.lease(
                client,
                config.lock_name,
                ttl=ttl,
                blocking_timeout=blocking_timeout,
                on_event=hook,
            ) as lock:
                counter[0] += 1
                report(
                    "acquired",
                    fence=lock.fencing_token,
                    key=lock.key,
                    waited=time.monotonic() - started,
                    left=lock.time_left,
                )
                await _work(lock, progress, step_time=ttl / 5)
        except asynclock.AcquireTimeout:
            report("timeout", waited=blocking_timeout)
        except asynclock.LockLost as exc:
            report(
                "locklost",
                reason=exc.reason.value,
                outcome=progress.outcome,
                step=progress.step,
                steps=progress.steps,
            )
        except (RedisError, OSError) as exc:
            report("error", detail=repr(exc))
        await asyncio.sleep(rng.uniform(0.1, 0.3) * ttl)


async def _work(lock: asynclock.Lease, progress: _Progress, step_time: float) -> None:
    """The "work" done while holding the lease: a few steps, checking the lease between them."""
    try:
        while progress.step < progress.steps:
            progress.step += 1
            if not await lock.is_held():
                progress.outcome = "checked"
                return
            await asyncio.sleep(step_time)
        # Before "committing" the result, make sure with Redis that the lease is still ours.
        if not await lock.is_held(verify=True):
            progress.outcome = "checked"
            return
        progress.outcome = "finished"
    except asyncio.CancelledError:
        progress.outcome = "cancelled"
        raise


# --------------------------------------------------------------------------------------
# The parent: timeline
# --------------------------------------------------------------------------------------


class _Timeline:
    """Prints ``time  who  what  detail`` lines in time order, each held back by ``_LAG``."""

    def __init__(self, t0: float, out: TextIO) -> None:
        self.t0 = t0
        self._out = out
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0

    def add(self, t: float, who: str, what: str, detail: str = "") -> None:
        line = f"{t - self.t0:8.3f}s  {who:<9} {what:<15} {detail}".rstrip()
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, line))

    def flush(self, everything: bool = False) -> None:
        horizon = time.monotonic() - _LAG
        while self._heap and (everything or self._heap[0][0] <= horizon):
            print(heapq.heappop(self._heap)[2], file=self._out, flush=True)


# --------------------------------------------------------------------------------------
# The parent: workers and the scenario
# --------------------------------------------------------------------------------------

_Message = tuple[str, dict[str, Any] | None]  # (worker name, event or None at EOF)


@dataclass(slots=True)
class _Worker:
    name: str
    proc: subprocess.Popen[bytes]
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    threads: list[threading.Thread] = field(default_factory=list)
    acquisitions: int = 0
    killed: bool = False
    exited: bool = False
    stopped: bool = False  # reported a clean stop

    @property
    def running(self) -> bool:
        return not self.exited and self.proc.poll() is None


@dataclass(frozen=True, slots=True)
class _Acquisition:
    t: float
    worker: str
    fence: int


@dataclass(slots=True)
class _Kill:
    victim: str
    fence: int
    t_kill: float
    expires_at: float  # when the victim's key would expire, as read just before the kill
    key_left: float
    taker: str | None = None
    t_taken: float | None = None


@dataclass(slots=True)
class _Delete:
    holder: str
    fence: int
    t_delete: float
    reason: str | None = None
    outcome: str | None = None
    step: int = 0
    steps: int = 0
    t_lost: float | None = None


class _Demo:
    """Runs the scenario against a server at ``url``; ``failures`` says what went wrong."""

    def __init__(self, config: DemoConfig, url: str, out: TextIO) -> None:
        self.config = config
        self.url = url
        self.out = out
        self.t0 = time.monotonic()
        self.timeline = _Timeline(self.t0, out)
        self.inbox: queue.Queue[_Message] = queue.Queue()
        self.workers: dict[str, _Worker] = {}
        self.redis = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        self.acquisitions: list[_Acquisition] = []
        self.holder: str | None = None
        self.key: str | None = None
        self.kill: _Kill | None = None
        self.delete: _Delete | None = None
        self.unexpected_losses: list[str] = []
        self.failures: list[str] = []
        self.stopping = False
        self.key_left_behind: bool | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> _Demo:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._kill_all()
        self.redis.close()

    def _kill_all(self) -> None:
        """SIGKILL every worker still running and reap it (used on errors and Ctrl-C)."""
        for worker in self.workers.values():
            if worker.proc.poll() is None:
                with contextlib.suppress(OSError):
                    worker.proc.kill()
        for worker in self.workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=_STOP_GRACE)
            for stream in (worker.proc.stdin, worker.proc.stdout, worker.proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def _spawn(self, index: int) -> None:
        name = f"worker-{index}"
        config = _WorkerConfig(
            name=name,
            url=self.url,
            lock_name=self.config.name,
            ttl=self.config.ttl,
            seed=random.randrange(2**32),
        )
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # import this very asynclock and demo
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, json.dumps(asdict(config))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C goes to the parent only
        )
        worker = _Worker(name, proc)
        self.workers[name] = worker
        for target in (self._read_events, self._read_stderr):
            thread = threading.Thread(target=target, args=(worker,), daemon=True)
            thread.start()
            worker.threads.append(thread)

    def _read_events(self, worker: _Worker) -> None:
        assert worker.proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for raw in worker.proc.stdout:
                try:
                    message = json.loads(raw)
                except ValueError:
                    message = None
                if not isinstance(message, dict):
                    text = raw.decode(errors="replace").rstrip()
                    message = {"t": time.monotonic(), "kind": "output", "detail": text}
                self.inbox.put((worker.name, message))
        self.inbox.put((worker.name, None))

    def _read_stderr(self, worker: _Worker) -> None:
        assert worker.proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            for raw in worker.proc.stderr:
                worker.stderr.append(raw.decode(errors="replace").rstrip())

    # -- waiting -----------------------------------------------------------------------

    def _pump(self, until: float, done: Callable[[], bool] | None = None) -> bool:
        """Handle worker events until ``done()`` (then True) or ``until`` (then False)."""
        while True:
            if done is not None and done():
                return True
            now = time.monotonic()
            if now >= until:
                return False
            try:
                name, message = self.inbox.get(timeout=min(until - now, _TICK))
            except queue.Empty:
                pass
            else:
                self._handle(name, message)
            self.timeline.flush()

    def _say(self, text: str, t: float | None = None) -> None:
        self.timeline.add(time.monotonic() if t is None else t, "demo", text)

    def _acquired_after(self, seen: int) -> Callable[[], bool]:
        return lambda: len(self.acquisitions) > seen

    def _fresh_holder(self, deadline: float) -> _Acquisition | None:
        """Wait for the next acquisition, then until it is ``_STRIKE_AFTER`` TTLs old.

        Returns it if its worker still holds the lease and the first renewal is still
        ahead; otherwise tries the next one, until ``deadline``.
        """
        ttl = self.config.ttl
        while time.monotonic() < deadline:
            if not self._pump(deadline, self._acquired_after(len(self.acquisitions))):
                return None
            acquisition = self.acquisitions[-1]

            def changed(acquisition: _Acquisition = acquisition) -> bool:
                return self.acquisitions[-1] is not acquisition or self.holder != acquisition.worker

            if self._pump(acquisition.t + _STRIKE_AFTER * ttl, changed):
                continue
            if time.monotonic() < acquisition.t + _STRIKE_BEFORE * ttl:
                return acquisition
        return None

    # -- events ------------------------------------------------------------------------

    def _handle(self, name: str, message: dict[str, Any] | None) -> None:
        worker = self.workers[name]
        if message is None:
            self._on_exit(worker)
            return
        t = float(message.get("t", time.monotonic()))
        kind = str(message.get("kind", "?"))
        detail = str(message.get("detail", ""))
        if kind == "acquired":
            self._on_acquired(worker, t, message)
        elif kind == "renewed":
            self.timeline.add(t, name, "renewed", f"({float(message['left']):.2f}s left)")
        elif kind == "renew_failed":
            self.timeline.add(t, name, "renew failed", detail)
        elif kind == "lost":
            if self.holder == name:
                self.holder = None
            self.timeline.add(t, name, "lost", f"reason {detail}: its work is being cancelled")
        elif kind == "released":
            if self.holder == name:
                self.holder = None
            self.timeline.add(t, name, "released")
        elif kind == "release_failed":
            if self.holder == name:
                self.holder = None
            self.timeline.add(t, name, "release failed", detail)
        elif kind == "locklost":
            self._on_lock_lost(worker, t, message)
        elif kind == "timeout":
            waited = float(message["waited"])
            self.timeline.add(
                t, name, "AcquireTimeout", f"no lease within {waited:g}s; trying again"
            )
        elif kind == "log":
            self.timeline.add(t, name, f"log {message.get('level', '')}", detail)
        elif kind == "stopped":
            worker.stopped = True
            count = int(message.get("acquisitions", 0))
            self.timeline.add(
                t, name, "stopped", f"after {count} acquisition{'' if count == 1 else 's'}"
            )
        elif kind == "error":
            self.timeline.add(t, name, "error", detail)
            self.failures.append(f"{name} hit an unexpected error: {detail}")
        else:
            self.timeline.add(t, name, kind, detail)

    def _on_acquired(self, worker: _Worker, t: float, message: dict[str, Any]) -> None:
        fence = int(message["fence"])
        self.key = str(message["key"])
        self.acquisitions.append(_Acquisition(t, worker.name, fence))
        self.holder = worker.name
        worker.acquisitions += 1
        detail = f"fence {fence}"
        note = f"waited {float(message['waited']):.2f}s"
        kill, delete = self.kill, self.delete
        if kill is not None and kill.taker is None and worker.name != kill.victim:
            kill.taker, kill.t_taken = worker.name, t
            note = (
                f"took over {t - kill.t_kill:.2f}s after the kill: the dead holder's key "
                f"had {kill.key_left:.2f}s left of its {self.config.ttl:g}s ttl"
            )
        elif delete is not None and delete.reason is None and worker.name != delete.holder:
            note = (
                f"{delete.holder} has not noticed its loss yet, "
                f"but its fence {delete.fence} is lower"
            )
        self.timeline.add(t, worker.name, "acquired", f"{detail}   ({note})")

    def _on_lock_lost(self, worker: _Worker, t: float, message: dict[str, Any]) -> None:
        reason = str(message["reason"])
        outcome = str(message["outcome"])
        step, steps = int(message["step"]), int(message["steps"])
        if self.holder == worker.name:
            self.holder = None
        how = {
            "cancelled": f"its work was cancelled at step {step} of {steps}",
            "checked": f"its work stopped at step {step} of {steps} (is_held() said no)",
            "finished": "its work had already finished",
        }.get(outcome, outcome)
        delete = self.delete
        if delete is not None and delete.reason is None and worker.name == delete.holder:
            delete.reason, delete.outcome, delete.t_lost = reason, outcome, t
            delete.step, delete.steps = step, steps
            how += f", {t - delete.t_delete:.2f}s after the key was deleted"
        else:
            self.unexpected_losses.append(f"{worker.name} lost the lease ({reason})")
        self.timeline.add(t, worker.name, "LockLost", f"reason {reason}: {how}")

    def _on_exit(self, worker: _Worker) -> None:
        worker.exited = True
        for thread in worker.threads:
            thread.join(timeout=1.0)
        try:
            code = worker.proc.wait(timeout=_STOP_GRACE)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            code = worker.proc.wait()
        now = time.monotonic()
        if worker.killed:
            self.timeline.add(now, worker.name, "exited", f"killed by the demo (status {code})")
        elif self.stopping and code == 0:
            self.timeline.add(now, worker.name, "exited")
        else:
            self.timeline.add(now, worker.name, "exited", f"unexpectedly, status {code}")
            for line in worker.stderr:
                self.timeline.add(now, worker.name, "stderr", line)
            self.failures.append(f"{worker.name} exited unexpectedly (status {code})")

    # -- the scenario ------------------------------------------------------------------

    def run(self) -> None:
        config = self.config
        self._say(f"starting {config.workers} worker processes")
        for index in range(1, config.workers + 1):
            self._spawn(index)
        self._pump(self.t0 + config.seconds / 3)
        self._kill_holder()
        self._pump(self.t0 + 2 * config.seconds / 3)
        self._delete_key()
        self._pump(max(self.t0 + config.seconds, time.monotonic() + config.ttl))
        self._stop_workers()
        self._check_key_gone()
        self.timeline.flush(everything=True)

    def _kill_holder(self) -> None:
        ttl = self.config.ttl
        deadline = time.monotonic() + _PHASE_WAIT + 4 * ttl
        while True:
            acquisition = self._fresh_holder(deadline)
            if acquisition is None:
                self.failures.append("no worker held the lease long enough to be killed")
                return
            assert self.key is not None
            pttl = int(self.redis.pttl(self.key))
            t_read = time.monotonic()
            if pttl > 0:
                break
        victim = self.workers[acquisition.worker]
        victim.killed = True
        victim.proc.kill()
        t_kill = time.monotonic()
        kill = _Kill(
            acquisition.worker, acquisition.fence, t_kill, t_read + pttl / 1000, pttl / 1000
        )
        self.kill = kill
        self._say(
            f"killing {victim.name} (SIGKILL) while it holds the lease "
            f"(fence {acquisition.fence}; its key expires in {pttl / 1000:.2f}s)",
            t_kill,
        )
        self._pump(kill.expires_at + _PHASE_WAIT + 2 * ttl, lambda: kill.taker is not None)
        if kill.taker is None or kill.t_taken is None:
            self.failures.append(f"nobody took over the lease after {victim.name} was killed")
        elif kill.t_taken < kill.expires_at - 0.005:
            self.failures.append(
                f"{kill.taker} took over {kill.expires_at - kill.t_taken:.3f}s before the "
                "dead holder's key expired"
            )

    def _delete_key(self) -> None:
        ttl = self.config.ttl
        deadline = time.monotonic() + _PHASE_WAIT + 4 * ttl
        while True:
            acquisition = self._fresh_holder(deadline)
            if acquisition is None:
                self.failures.append("no worker held the lease long enough to delete its key")
                return
            assert self.key is not None
            deleted = int(self.redis.delete(self.key))
            t_delete = time.monotonic()
            if deleted == 1:
                break
        delete = _Delete(acquisition.worker, acquisition.fence, t_delete)
        self.delete = delete
        self._say(
            f"deleting the lease key {self.key} while {acquisition.worker} holds it "
            f"(fence {acquisition.fence})",
            t_delete,
        )
        self._pump(t_delete + _PHASE_WAIT + 2 * ttl, lambda: delete.reason is not None)
        if delete.reason is None:
            self.failures.append(f"{delete.holder} never reported LockLost after the delete")
        elif delete.reason != asynclock.LossReason.NOT_OWNER.value:
            self.failures.append(f"{delete.holder} lost the lease for {delete.reason}")
        elif delete.outcome not in ("cancelled", "checked"):
            self.failures.append(f"{delete.holder}'s work was not stopped ({delete.outcome})")

    def _stop_workers(self) -> None:
        self.stopping = True
        self._say("stopping the workers (closing their stdin)")
        for worker in self.workers.values():
            if worker.running and worker.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    worker.proc.stdin.close()
        deadline = time.monotonic() + _STOP_GRACE
        if not self._pump(deadline, lambda: not any(w.running for w in self.workers.values())):
            for worker in self.workers.values():
                if worker.running:
                    self.failures.append(f"{worker.name} did not stop within {_STOP_GRACE:g}s")
            self._kill_all()
        # The last EOFs may still be queued: handle them so every exit is accounted for.
        self._pump(time.monotonic() + 1.0, lambda: all(w.exited for w in self.workers.values()))

    def _check_key_gone(self) -> None:
        if self.key is None:
            self.failures.append("no worker ever acquired the lease")
            return
        self.key_left_behind = bool(self.redis.exists(self.key))
        if self.key_left_behind:
            self.failures.append(f"the lease key {self.key} was left behind")

    # -- the summary -------------------------------------------------------------------

    def summary(self) -> Iterator[str]:
        """Lines of the final summary (the failures are listed by the caller)."""
        ttl = self.config.ttl
        counts = []
        for worker in self.workers.values():
            mark = " (killed)" if worker.killed else ""
            counts.append(f"{worker.name} {worker.acquisitions}{mark}")
        total = len(self.acquisitions)
        yield f"  acquisitions    {', '.join(counts)}; {total} in all"
        fences = [a.fence for a in sorted(self.acquisitions, key=lambda a: a.t)]
        increasing = all(a < b for a, b in itertools.pairwise(fences))
        if not increasing:
            self.failures.append("the fencing tokens did not strictly increase")
        verdict = "yes" if increasing else "NO"
        yield f"  fencing tokens  strictly increasing over all {total} acquisitions: {verdict}"
        kill = self.kill
        if kill is not None and kill.t_taken is not None:
            yield (
                f"  kill            {kill.victim} killed holding fence {kill.fence}; "
                f"{kill.taker} took over {kill.t_taken - kill.t_kill:.2f}s later "
                f"(its key had {kill.key_left:.2f}s left; ttl {ttl:g}s)"
            )
        elif kill is not None:
            yield f"  kill            {kill.victim} killed; nobody took over"
        delete = self.delete
        if delete is not None and delete.t_lost is not None:
            yield (
                f"  key deleted     {delete.holder} raised LockLost({delete.reason}) "
                f"{delete.t_lost - delete.t_delete:.2f}s later; its work was "
                f"{'cancelled' if delete.outcome == 'cancelled' else delete.outcome} "
                f"at step {delete.step} of {delete.steps}"
            )
        elif delete is not None:
            yield f"  key deleted     {delete.holder} never noticed"
        for loss in self.unexpected_losses:
            yield f"  also            {loss}"
        stopped = sum(1 for w in self.workers.values() if w.stopped)
        alive = sum(1 for w in self.workers.values() if not w.killed)
        key = "the lease key is gone" if self.key_left_behind is False else "the lease key remains"
        yield f"  cleanup         {stopped} of {alive} workers stopped cleanly; {key}"


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _unreachable(url: str) -> str | None:
    """Why the server at ``url`` cannot be used, or None if it answers ``PING``."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
    except ValueError as exc:
        return str(exc)
    try:
        client.ping()
    except (RedisError, OSError) as exc:
        return str(exc) or type(exc).__name__
    finally:
        client.close()
    return None


def run_demo(config: DemoConfig, out: TextIO | None = None) -> int:
    """Run the demo; returns the exit status (0: everything happened as expected)."""
    out = sys.stdout if out is None else out
    started = time.monotonic()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    server: RedisServer | None = None
    failures: list[str] = []
    summary: list[str] = []
    try:
        url = config.url
        if url is None:
            try:
                server = RedisServer()
                server.start()
            except RuntimeError as exc:  # no server binary, or it did not start
                print(f"asynclock demo: cannot start a server: {exc}", file=out, flush=True)
                return 1
            url = server.url
            where = f"a private {server.engine} {server.version} server at {url}"
        else:
            problem = _unreachable(url)
            if problem is not None:
                print(f"asynclock demo: cannot use {url}: {problem}", file=out, flush=True)
                return 1
            where = f"the server at {url}"
        print(
            f"asynclock demo: {config.workers} worker processes compete for the lease "
            f"{config.name!r} (ttl {config.ttl:g}s) on {where}.",
            f"Around {config.seconds / 3:.0f}s the holder is killed; around "
            f"{2 * config.seconds / 3:.0f}s its lease key is deleted from outside.",
            "",
            f"{'time':>9}  {'who':<9} {'event':<15} detail",
            sep="\n",
            file=out,
            flush=True,
        )
        with _Demo(config, url, out) as demo:
            try:
                demo.run()
            finally:
                demo.timeline.flush(everything=True)
            summary = list(demo.summary())
            failures = demo.failures
    except KeyboardInterrupt:
        print("\ninterrupted: the workers were killed", file=out, flush=True)
        return 130
    finally:
        if server is not None:
            server.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if server is not None:
        summary.append("  server          the private server was stopped")
    print("", "summary", *summary, sep="\n", file=out)
    elapsed = time.monotonic() - started
    if failures:
        print("", "FAILED:", *(f"  - {f}" for f in failures), sep="\n", file=out)
        print(f"(ran {elapsed:.1f}s)", file=out, flush=True)
        return 1
    print(f"\nOK: everything happened as expected (ran {elapsed:.1f}s)", file=out, flush=True)
    return 0
