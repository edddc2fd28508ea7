"""The watchdog: renews every held lease of a client every ttl/3 until its block exits.

Design note. A lease is valid until ``safe_until = t_send + ttl - drift``, where ``t_send``
is the loop time just before the last *confirmed* acquire or renew command was sent:
Redis set the key's expiry after it received that command, so the key cannot expire
before ``t_send + ttl`` unless the server's clock runs fast, which ``drift`` allows for.

Renewing every ttl/3 (from the last confirmed ``t_send``) leaves two thirds of the TTL
to confirm a renewal: a slow or failed attempt is retried, with a short backoff, while
time remains. Each attempt has its own time limit (at most ttl/3, never past the
deadline), so one hung connection cannot hold a renewal past the deadline.

The deadline needs no timer per lease. At every moment a held lease is either waiting on
the timeline (for its next renewal, its next retry, or, when no retry fits before the
deadline, for ``safe_until`` itself), or in a batch of renewals in flight, whose own
timer (``_InFlight``) comes up at each ``safe_until`` of the batch while it is in flight
(and whose time limit ends at the earliest). Whichever comes up at ``safe_until``
declares the loss, so the body is cancelled at the deadline even while a renewal command
is still in flight, however slowly that command unwinds. A reply of 0 means the key no
longer holds our token: lost at once, no retry can bring it back. A renewal refused by
the server's ACL (a missing rule, see ``_redis._refusals``) is a configuration error that
no retry mends either: lost at once too (``watchdog_failed``, the refusal as its cause,
naming the rule), not left SUSPECT until its deadline. Any other failure (timeout,
connection error, a failover's READONLY/LOADING) leaves the outcome unknown: the lease
turns SUSPECT and its deadline does not move.

One :class:`Watchdog` serves every lease of a client (per event loop): a single loop
timer fires when the earliest renewal is due, and every renewal due within a few
milliseconds travels in one pipeline on the client's dedicated renewal connection. Each lease
keeps its own schedule, deadline and outcome; coalescing only changes how the commands
travel, so ten thousand leases cost one task and a pipeline per tick, not ten thousand
tasks, and nothing runs between renewals. Each batch runs as a task of its own, so one
hung batch cannot delay the next. The leases a batch renewed are due again together, so
they go back on the timeline as one entry: a held lease costs the timeline a list slot,
not an entry of its own. So do leases taken in a burst: one due within the coalescing
window after the entry last scheduled joins that entry (its renewal would travel in that
entry's batch anyway), so ten thousand permits taken in a second cost the timeline a few
dozen entries until their first renewal, not an entry (a tuple and a list for the
garbage collector to scan) each.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import random
from collections.abc import Awaitable, Callable
from typing import Final, NamedTuple, Protocol

from redis.asyncio import Redis
from redis.exceptions import AskError, NoScriptError, RedisError

from .._base._exceptions import LossReason, ReplicationTimeout
from .._base._options import LeaseOptions, replicas_confirmed
from .._redis._compat import connection_errors
from .._redis._lane import exchange
from .._redis._refusals import explain, is_refusal
from .._redis._scripts import ASKING, Script, pack, refused_as_command, renewed

__all__ = ["Watchdog", "Watched", "report_stall"]

log = logging.getLogger("asynclock")

_WINDOW: Final = 0.05  # seconds (at most ttl/30): renewals due this close travel together
_BATCH: Final = 1000  # most renewals in one pipeline


class _Confirmed(NamedTuple):
    """What the replicas said of a batch of renewals (see ``Watchdog._send``)."""

    acked: int
    """Replicas that confirmed every renewal of the batch (-1: no answer, or refused)."""
    wait: float
    """The most seconds the confirmation was allowed (``WAIT``, and ``WAITAOF``)."""
    error: BaseException | None
    """The confirmation's error reply, if it was refused."""


_NONE_ASKED: Final = _Confirmed(0, 0.0, None)  # (a batch without min_replicas)


class Watched(Protocol):
    """A held lease as the watchdog sees it (``_lifecycle._lease.Tenure`` is one). The
    lease owns all of this state: the watchdog reads it, and changes it only by asking
    (``watch``, ``confirm``, ``suspect``, ``on_deadline``, ...). Loop times and seconds."""

    @property
    def options(self) -> LeaseOptions: ...
    @property
    def active(self) -> bool: ...
    @property
    def due(self) -> float | None: ...  # set by watch: when the watchdog looks next
    @property
    def backoff(self) -> float | None: ...  # set by note_backoff
    @property
    def deadline(self) -> float: ...  # the safe deadline (``Lease.safe_until``)

    def watch(self, due: float | None) -> None: ...
    def note_backoff(self, backoff: float) -> None: ...
    @property
    def renew_script(self) -> Script: ...  # the kind's renew script (reloaded on NOSCRIPT)
    def renew_tail(self) -> bytes: ...  # its renew command's keys and arguments, packed
    @property
    def renew_head(self) -> bytes: ...  # the command up to them (ask renew_tail first)
    @property
    def by_command(self) -> bool: ...  # renewed by SET ... IFEQ, not a script
    def renew_by_script(self) -> None: ...  # the server refused that: scripts from now on
    @property
    def asking(self) -> bool: ...  # its renewal goes after ASKING (see Tenure.moved)
    def confirm(self, t_send: float, safe_until: float | None = None) -> bool: ...
    def moved(self, error: AskError) -> bool: ...  # MOVED/ASK: True if it moved there
    def found_not_ours(self) -> None: ...
    def suspect(self, cause: BaseException) -> None: ...
    def on_deadline(self, cause: BaseException | None = None) -> None: ...
    def fail(self, cause: BaseException) -> None: ...
    def lose(self, reason: LossReason, cause: BaseException | None = None) -> None: ...


def report_stall(lease: Watched, due: float, now: float, what: str) -> None:
    """Log a warning if a timer of ``lease`` ran much later than ``due`` (loop times).

    Lateness means the event loop (or the whole process) was stalled: a blocking call in
    a coroutine, a long CPU-bound stretch, a GC pause, SIGSTOP. Code that does not await
    cannot be cancelled, so the guarded work may have run past the lease's deadline.
    """
    late = now - due
    if late > max(0.1, lease.options.ttl / 6):
        log.warning(
            "event loop stall of %.3fs detected (%s of lease %r ran late); "
            "nothing that does not await can be interrupted, so the guarded work may have "
            "overlapped another holder: rely on the fencing token",
            late,
            what,
            lease.options.name,
        )


class Watchdog:
    """Renews the leases of one client and watches their deadlines; see the design note."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        renewer: Callable[[], Redis],
        locate: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """``renewer`` gives the client renewals travel on; ``locate``, if given, runs
        before each batch is sent, until the loop time it is given (a Sentinel client's
        renewals follow the primary: see ``_connections``)."""
        self._loop = loop
        self._renewer = renewer
        self._locate = locate
        # The timeline: a heap of (loop time, tie-breaker, leases due then), with one loop
        # timer (due at _at) for its earliest entry.
        self._timeline: list[tuple[float, int, list[Watched]]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf
        # The entry ``schedule`` last put on the timeline, while it is there: the leases
        # due within the window after it join it (see the design note).
        self._recent: tuple[float, int, list[Watched]] | None = None
        self._batches: set[asyncio.Task[None]] = set()
        self._closing = False  # set while aclose() cancels the batches in flight

    @property
    def running(self) -> bool:
        """True while renewals are in flight (tasks that may still touch Redis)."""
        return bool(self._batches)

    def schedule(self, lease: Watched, due: float) -> None:
        """Look at ``lease`` at loop time ``due``: renew it then, or declare it lost if its
        ``safe_until`` has passed by then. Only for a lease not already waiting. A renewal
        due at most one window after the entry last scheduled here joins that entry (the
        batch sent when it comes up takes it anyway). A retry (its backoff set) or a
        deadline check goes alone, at its own time."""
        recent = self._recent
        if recent is not None and lease.backoff is None and due < lease.deadline:
            at, _, group = recent
            ttl = lease.options.ttl
            if at <= due <= at + min(_WINDOW, ttl / 30) and group[0].options.ttl == ttl:
                lease.watch(at)  # (``at`` itself: _fire knows its entries by identity)
                group.append(lease)
                return
        self._recent = self._schedule_group([lease], due)

    def idle(self) -> None:
        """No lease of the client is held any more: forget every schedule. The timer stays
        armed (it finds nothing to do), so a client that takes short leases one after
        another arms no timer per lease."""
        self._timeline.clear()
        self._recent = None

    async def aclose(self) -> None:
        """Stop renewing and wait for renewals in flight to be cancelled."""
        self._cancel_timeline()
        batches = list(self._batches)
        self._closing = True
        try:
            for task in batches:
                task.cancel()
            for task in batches:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            self._closing = False

    def _fire(self, now: float) -> None:
        """The earliest entry is due: send every renewal due within the window, and
        declare lost every lease whose deadline has come."""
        timeline = self._timeline
        batch: list[Watched] = []
        early: list[Watched] = []  # deadline checks that came up a hair before the deadline
        window = 0.0
        while timeline and len(batch) < _BATCH:
            due, _, group = timeline[0]
            if not batch:
                window = min(_WINDOW, group[0].options.ttl / 30)  # (a group shares one ttl)
            if due > now + window:
                break
            if heapq.heappop(timeline) is self._recent:
                self._recent = None  # (off the timeline: no lease may join it now)
            for i, lease in enumerate(group):
                if lease.due is not due or not lease.active:
                    continue  # rescheduled since, or ended (the lease's own float marks it)
                if len(batch) >= _BATCH:
                    self._push(due, group[i:])  # the rest goes in the next batch
                    break
                lease.watch(None)
                try:
                    if lease.deadline <= now:
                        lease.on_deadline()
                    elif due >= lease.deadline:
                        early.append(lease)  # a deadline check, not a renewal: not yet
                    else:
                        report_stall(lease, due, now, "the renewal")
                        batch.append(lease)
                except Exception as exc:  # (a logging handler, say): lost, never unwatched
                    _failed(lease, exc)
        for lease in early:
            lease.watch(lease.deadline)
            self._push(lease.deadline, [lease])
        if timeline:
            self._arm(max(timeline[0][0], now))
        self._launch_split(batch)  # (if any)

    def _launch_split(self, batch: list[Watched]) -> None:
        """Send ``batch``: those waiting for replicas travel apart (WAIT holds its
        connection), and those waiting for append-only files apart again (WAITAOF
        counts fewer)."""
        confirmed = [lease for lease in batch if lease.options.min_replicas]
        if confirmed:
            batch = [lease for lease in batch if not lease.options.min_replicas]
            for aof in (False, True):
                group = [lease for lease in confirmed if lease.options.wait_aof is aof]
                if group:
                    self._launch(group)
        if batch:
            self._launch(batch)

    def _launch(self, batch: list[Watched]) -> None:
        task = self._loop.create_task(self._renew(batch), name="asynclock-renewal")
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)
        _InFlight(self._loop, batch, task)

    async def _renew(self, batch: list[Watched]) -> None:
        """One attempt for each lease of ``batch``; never raises (failures are per lease)."""
        try:
            t_send, replies, confirmed = await self._send(batch)
        except asyncio.CancelledError:
            if self._closing:
                raise
            # Not ours (a cancellation that escaped the time limit under a stalled loop,
            # say): the outcome is unknown, and no lease may be left unwatched.
            self._retry_all(batch, TimeoutError("renewal cancelled"))
            return
        except (RedisError, OSError, TimeoutError) as exc:  # (or SCRIPT LOAD refused: _retry)
            self._retry_all(batch, exc)
            return
        except BaseException as exc:  # a bug: never silence, never leave a lease unwatched
            for lease in batch:
                _failed(lease, exc)
            return
        self._settle(batch, t_send, replies, confirmed)

    def _settle(
        self, batch: list[Watched], t_send: float, replies: list[object], confirmed: _Confirmed
    ) -> None:
        """Act on the batch's replies (sent at ``t_send``): confirm the leases renewed and
        put them back on the timeline; tell the others what happened."""
        # Renewed leases are due again together: one timeline entry per ttl, one float
        # per ttl for the new deadline and the next due time.
        renewed: dict[float, tuple[float, list[Watched]]] = {}
        for lease, reply in zip(batch, replies, strict=True):
            if not lease.active:
                continue
            try:
                if self._answered(lease, reply, confirmed):
                    ttl = lease.options.ttl
                    found = renewed.get(ttl)
                    if found is None:
                        found = renewed[ttl] = (lease.options.safe_until(t_send), [])
                    if lease.confirm(t_send, found[0]):
                        found[1].append(lease)
            except Exception as exc:  # (an on_event hook is guarded; a log handler is not)
                _failed(lease, exc)
        for ttl, (_, leases) in renewed.items():
            if leases:
                self._schedule_group(leases, t_send + ttl / 3)

    def _answered(self, lease: Watched, reply: object, confirmed: _Confirmed) -> bool:
        """Act on one lease's renew reply; returns whether it renewed the lease (to be
        confirmed by the caller): else the lease was told what happened (moved, refused,
        to be retried, or not ours)."""
        if isinstance(reply, AskError) and lease.moved(reply):
            return False  # (MOVED too: its slot is elsewhere now, renewed there at once)
        if isinstance(reply, BaseException):
            self._retry(lease, reply)  # (or refused: see _retry)
            return False
        if not renewed(reply):
            lease.found_not_ours()
            return False
        if confirmed.error is not None and is_refusal(confirmed.error):
            _refused(lease, confirmed.error)  # (WAIT refused)
            return False
        if lease.options.min_replicas > confirmed.acked:
            # renewed on the primary, not confirmed by enough replicas: failed
            wanted, acked = lease.options.min_replicas, confirmed.acked
            short = ReplicationTimeout(lease.options.name, wanted, acked, confirmed.wait)
            short.__cause__ = confirmed.error  # (WAITAOF refused, say)
            self._retry(lease, short)
            return False
        return True

    async def _send(self, batch: list[Watched]) -> tuple[float, list[object], _Confirmed]:
        """Send the batch's renewals in one write; returns t_send, a reply (or the
        per-command error) per lease, and how many replicas confirmed them (``WAIT``, and
        ``WAITAOF`` with ``wait_aof``, behind them when the batch's leases ask for
        ``min_replicas``; else 0; -1 for no answer or an error reply). Raises on a
        connection error, or TimeoutError at the batch's earliest deadline (or ttl/3
        after sending, if sooner)."""
        t_send = self._loop.time()
        earliest = min(lease.deadline for lease in batch)
        limit_at = min(earliest, t_send + min(lease.options.ttl for lease in batch) / 3)
        client = self._renewer()
        renewals, asked = _pack(batch)
        count = len(batch) + len(asked)
        wanted = max(lease.options.min_replicas for lease in batch)
        steps, wait_ms, confirmation = 1, 0, b""
        if wanted:  # (see _lifecycle/_replicas: WAIT confirms every write before it)
            options = batch[0].options  # (all of the batch wait_aof or none: see _fire)
            steps = options.confirmation_steps
            wait_ms = min(lease.options.replica_wait_ms for lease in batch)
            wait_ms = max(1, min(wait_ms, int((limit_at - t_send) * 500) // steps))  # half
            commands = options.confirmation(wanted, wait_ms)
            confirmation = b"".join(pack(command, "utf-8", "strict") for command in commands)
            count += len(commands)
        async with asyncio.timeout_at(limit_at):
            if self._locate is not None:  # (t_send stays before it: the earlier, the safer)
                await self._locate((t_send + limit_at) / 2)
            replies = await _exchange(client, renewals + confirmation, count, asked)
            if _command_refused(batch, replies):
                # The server will not renew by command (full, an ACL without +set, an
                # older server after a failover): by script from now on, sent again.
                batch[0].renew_by_script()  # (the client's: every lease of the batch)
                renewals = _pack(batch)[0]
                t_send = self._loop.time()
                replies = await _exchange(client, renewals + confirmation, count, asked)
            if any(isinstance(reply, NoScriptError) for reply in replies):
                # A restarted or failed-over server forgot the scripts: load the batch's
                # (each once), resend.
                with connection_errors():  # (a dropped connection, on some Pythons)
                    for source in {lease.renew_script.source: None for lease in batch}:
                        await client.script_load(source)
                t_send = self._loop.time()
                replies = await _exchange(client, renewals + confirmation, count, asked)
        if not wanted:
            return t_send, replies, _NONE_ASKED
        last = replies[-1]
        error = last if isinstance(last, BaseException) else None
        confirmed = _Confirmed(replicas_confirmed(last), wait_ms * steps / 1000, error)
        del replies[len(batch) :]
        return t_send, replies, confirmed

    def _schedule_group(
        self, leases: list[Watched], due: float
    ) -> tuple[float, int, list[Watched]]:
        for lease in leases:
            lease.watch(due)
        entry = self._push(due, leases)
        if due < self._at:
            self._arm(due)
        return entry

    def _push(self, due: float, leases: list[Watched]) -> tuple[float, int, list[Watched]]:
        """Put ``leases`` on the timeline at ``due``, without arming its timer (``_fire``
        re-arms it when it is done); returns the entry."""
        entry = (due, next(self._order), leases)
        heapq.heappush(self._timeline, entry)
        return entry

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = self._loop.call_at(at, self._tick), at

    def _tick(self) -> None:
        self._timer, self._at = None, math.inf
        self._fire(self._loop.time())

    def _cancel_timeline(self) -> None:
        self._timeline.clear()
        self._recent = None
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = None, math.inf

    def _retry_all(self, batch: list[Watched], error: BaseException) -> None:
        """The batch failed as a whole: every lease of it tries again, or is refused
        (see ``_retry``)."""
        for lease in batch:
            try:
                self._retry(lease, error)
            except Exception as bug:
                _failed(lease, bug)

    def _retry(self, lease: Watched, error: BaseException) -> None:
        """The outcome is unknown: SUSPECT, and try again shortly while time remains; with
        no time left for a retry, wait for the deadline itself. A refusal by the server's
        ACL (a configuration error) is not retried: lost at once (see ``_refused``)."""
        if is_refusal(error):
            _refused(lease, error)
            return
        if not lease.active:
            return
        now = self._loop.time()
        if now >= lease.deadline:
            lease.on_deadline(error)
            return
        lease.suspect(error)
        backoff = lease.backoff or min(lease.options.ttl / 30, 0.05)
        lease.note_backoff(min(backoff * 2, lease.options.ttl / 10, 1.0))
        pause = backoff * random.uniform(0.5, 1.0)
        self.schedule(lease, min(now + pause, lease.deadline))


def _pack(batch: list[Watched]) -> tuple[bytes, list[int]]:
    """The batch's renewals in RESP, each after ``ASKING`` where its lease needs it, and
    where the replies of those ``ASKING`` come (to drop them)."""
    parts: list[bytes] = []
    asked: list[int] = []
    for i, lease in enumerate(batch):  # (each lease's kind says how it is renewed)
        if lease.asking:
            asked.append(i + len(asked))  # (after i renewals and the ASKINGs before)
            parts.append(ASKING)
        tail = lease.renew_tail()  # (first: it says which head goes before it)
        parts += (lease.renew_head, tail)
    return b"".join(parts), asked


def _command_refused(batch: list[Watched], replies: list[object]) -> bool:
    """Whether the server refused a renewal of ``batch`` sent as a command (see
    ``refused_as_command``; ``replies``: one per lease first)."""
    return any(
        lease.by_command and refused_as_command(reply)
        for lease, reply in zip(batch, replies, strict=False)  # (WAIT's reply after them)
    )


async def _exchange(client: Redis, packed: bytes, count: int, asked: list[int]) -> list[object]:
    """``exchange``, the replies of the ``ASKING`` at ``asked`` left out."""
    replies = await exchange(client, packed, count)
    for index in reversed(asked):
        del replies[index]
    return replies


def _refused(lease: Watched, error: BaseException) -> None:
    """The server's ACL refused the renewal of ``lease`` (see :func:`is_refusal`): lost at
    once, the refusal explained (naming the missing rule) as the cause."""
    what = f"the renewal of lease {lease.options.name!r}"
    _failed(lease, explain(error, what, lease.renew_script.source))


def _failed(lease: Watched, error: BaseException) -> None:
    """The watchdog's own handling of ``lease`` raised: the lease is lost
    (``watchdog_failed``), never left unwatched, even if reporting that raises too."""
    try:
        lease.fail(error)
    except Exception:
        lease.lose(LossReason.WATCHDOG_FAILED, error)  # (no-op if fail got that far)


class _InFlight:
    """The deadlines of a batch of renewals in flight, on one loop timer of its own.

    The batch's time limit ends at its earliest deadline, but the batch's task must then
    run, and unwind through redis-py, before its leases are looked at; with a busy loop
    that can come late. This timer declares each lease lost at its ``safe_until`` directly
    (a timer callback, as fast as a timer of the lease's own) while the batch is in
    flight, and goes away with the batch. A lease still in flight is one with no
    schedule (``due is None``) that is still active."""

    __slots__ = ("_batch", "_loop", "_timer")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, batch: list[Watched], task: asyncio.Task[None]
    ) -> None:
        self._loop = loop
        self._batch = batch
        self._timer: asyncio.TimerHandle | None = loop.call_at(
            min(lease.deadline for lease in batch), self._check
        )
        task.add_done_callback(self._done)

    def _check(self) -> None:
        now = self._loop.time()
        earliest = math.inf
        for lease in self._batch:
            if lease.due is not None or not lease.active:
                continue  # back on the timeline, or ended
            if lease.deadline <= now:
                try:
                    lease.on_deadline()
                except Exception as exc:  # (a logging handler, say)
                    _failed(lease, exc)
            else:
                earliest = min(earliest, lease.deadline)
        self._timer = None if earliest == math.inf else self._loop.call_at(earliest, self._check)

    def _done(self, task: asyncio.Task[None]) -> None:
        """The batch ended: its leases are back on the timeline or ended, and the timer
        goes; should one have been left neither (a bug), it stays to declare the loss."""
        if any(lease.due is None and lease.active for lease in self._batch):
            return
        if self._timer is not None:
            self._timer.cancel()
