"""The acquisition loop, written once; a kind of lock plugs in as a policy (``Kind``).

Design note. An acquisition is one attempt (``blocking=False`` or ``blocking_timeout=0``)
or a wait: try; on a busy reply subscribe to the lock's release channel and try again (so
no release slips between the two); then park until a wake-up, the holder's time left (the
kind's ``pause``) or the deadline (below), and try again. How a kind's waiters of
one client take turns is its ``Turn`` (below).

The ladder for an attempt whose outcome is unknown lives here alone: after a connection
error or timeout the same script is sent once more with the same token (the kind's script
finds its own hold and answers as if it had just taken it); if the outcome stays unknown,
the deadline passes, or the caller is cancelled (even by a cancellation that redis-py's
internal ``wait_for`` swallowed: see ``_shield.cancel_dropped``), whatever the attempt
may have left on the server is undone (the kind's ``undo`` script, which also leaves a
tombstone that stops a late arrival of the attempt) before the error propagates; the
undo is tried again while Redis does not answer, within ``release_timeout`` and no later
than ``TIMEOUT_GRACE`` past the deadline, if any (a place left in a fair queue would hold
up every other client's waiters). An
attempt answered so late that less than a third of the TTL is left is not handed out: it
is sent again at once, which refreshes the hold in one round trip. An attempt that got no
answer may still reach Redis after the acquisition is over: an acquisition that had one
leaves the same tombstone whatever its end, by the undo if it fails, before the lease is
handed out if it is granted (``_seal``).

How long an acquisition may take, one rule for every kind: ``blocking_timeout`` becomes a
deadline (loop time) when the acquisition starts.

- ``blocking_timeout=0`` is one attempt, as ``blocking=False`` is (no wait, no place in
  any line, no subscription): a free lock is taken, a held one raises ``AcquireTimeout``
  at once.
- An attempt is started only before the deadline, and its round trip ends at the
  deadline or ``ROUND_TRIP_FLOOR`` seconds after it was sent, whichever is later
  (``round_trip_end``): the last attempt before the deadline gets the time a round trip
  needs, so a busy lock is never reported as a silent server.
- Past the deadline the wait ends with an ``AcquireTimeout`` that says what the last
  reply said (``held``): the lock held and for how much longer its holder's lease runs;
  or, when the last round trip found no answer in time, that Redis did not answer
  (``timed_out``). Undoing an attempt still in flight may take ``TIMEOUT_GRACE`` more.

A kind supplies only what differs (``Kind``): the script and its keys and arguments, the
parsing of its reply into a named outcome (``Granted``, ``Busy``, ``Refused``), the pause
before trying again unprompted, its undo script, and how its waiters take turns
(``Turn``): all at each wake-up (the base), or the head of the client's line (``Line``,
whose first waiter tries before taking a place in it); for the plain lock, a line whose
head may also be handed the lock by a releaser (``_mutex.HandOverLine``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, cast

from redis.exceptions import MaxConnectionsError, OutOfMemoryError, ResponseError

from .._base._exceptions import AcquireTimeout, LimitConflict, LockBusy
from .._base._options import LeaseOptions
from .._base._shield import finish
from .._redis._lane import not_sent
from .._redis._scripts import SEAL, UNKNOWN_OUTCOME, Arg, Script, run_idempotent
from .._session._connections import Companion
from .._session._wakeup import Waiter, WaitingRoom
from ._hold import Hold, of_lock

__all__ = [
    "Busy",
    "Granted",
    "Kind",
    "Line",
    "Refused",
    "Request",
    "Turn",
    "acquire",
    "answer",
    "until_expiry",
]

log = logging.getLogger("asynclock")


TIMEOUT_GRACE: Final = 0.5
"""Seconds past the end of an acquisition that undoing an attempt still in flight may take
(at most ``release_timeout``); past it, a key the attempt set expires by its TTL."""

ROUND_TRIP_FLOOR: Final = 0.25
"""The least time (seconds) an attempt's round trip is given, even when the deadline is
nearer: an attempt that cannot get it is not worth sending."""


def round_trip_end(deadline: float | None, now: float) -> float | None:
    """The loop time by which an attempt sent at ``now`` must be answered (None: no bound
    but the client's own socket timeout)."""
    if deadline is None:
        return None
    return max(deadline, now + ROUND_TRIP_FLOOR)


def held(options: LeaseOptions, pttl_ms: int | None) -> AcquireTimeout:
    """The timeout of an acquisition whose last attempt found the lock taken;
    ``pttl_ms``: what that attempt said of the holder's time left (ms; -1 no expiry,
    None or 0 unknown)."""
    whose = "its holder's lease ends"
    if options.limit > 1:
        what = f"all {options.limit} permits are held"
        whose = "the first of them ends"
    elif options.fair:
        what = "the lock is held, or others wait ahead in its queue"
    else:
        what = "the lock is held" if not options.shared else "the lock is held exclusively"
    if pttl_ms is not None and pttl_ms > 0:
        detail = f"{what} ({whose} in {pttl_ms / 1000:.3g}s unless renewed)"
    elif pttl_ms == -1:
        detail = f"{what} by a key without expiry (not written by asynclock?)"
    else:
        detail = what
    return timed_out(options, detail)


def timed_out(options: LeaseOptions, detail: str) -> AcquireTimeout:
    """The timeout of an acquisition, ``detail`` saying why: besides ``held``, Redis did
    not answer the last round trip in time, or its last grant came too late to use."""
    return AcquireTimeout(options.name, options.blocking_timeout or 0.0, detail)


@dataclass(slots=True)
class Granted:
    """The lock taken: the fencing token minted, the loop time the attempt was sent (or
    the offer a releaser granted), the kind's detail (a semaphore's permit slot; -1
    none), and whether a releaser handed it over (the key then holds no job digest)."""

    fencing_token: int
    t_send: float
    slot: int = -1
    handed: bool = False


@dataclass(slots=True)
class Busy:
    """The lock is taken: what the reply said of the holder's time left (ms; -1 no
    expiry, 0 ending now or unknown: ``LockBusy.retry_after`` is None then);
    ``pending``: the attempt left something of ours on the server that giving up must
    undo (a fair waiter's place in the queue)."""

    pttl_ms: int
    pending: bool = False


@dataclass(slots=True)
class Refused:
    """The lock cannot be had this way: ``error`` says why (a conflicting limit, another
    kind, a job's stored result or another fingerprint). The refused attempt left
    nothing of ours (an earlier one's place in a fair queue is still undone)."""

    error: Exception


def answer(
    reply: object, t_send: float, options: LeaseOptions, *, pending: bool = False
) -> Granted | Busy | Refused:
    """The replies every acquire script shares, once a kind has read its own: the lock
    taken with the attempt sent at ``t_send``, answered with its fencing token alone (a
    decimal string, or an integer for a retry of ours: the plain and fair locks'
    scripts) or as (1, fencing token[, a permit's slot]); (0, the holder's time left in
    ms) busy (``pending``: see ``Busy``); (-2, the limit) permits of the name held with
    another limit than ``options.limit`` (``LimitConflict``: one name, one limit). Any
    other status left here is (-1, 0), the answer to an abandoned attempt (its
    tombstone), which the engine never reads: a bug."""
    if not isinstance(reply, list):
        return Granted(int(cast(int | bytes, reply)), t_send)
    raw_status, raw_value, *slot = cast(list[int | bytes], reply)
    status = int(raw_status)
    if status == -2:
        theirs = raw_value.decode() if isinstance(raw_value, bytes) else str(raw_value)
        why = f"held with limit={theirs}, not {options.limit}"
        return Refused(LimitConflict(options.name, why))
    if status == 1:
        return Granted(int(raw_value), t_send, int(slot[0]) if slot else -1)
    if status == 0:
        return Busy(int(raw_value), pending)
    raise RuntimeError("asynclock: an abandoned acquire attempt was answered")


class Request(NamedTuple):
    """One script call: the script, its keys and its arguments."""

    script: Script
    keys: Sequence[str]
    args: list[Arg]


@dataclass(slots=True, eq=False)
class Turn:
    """When a waiter of one client may try, and how it leaves; the base: every waiter of
    the client tries at each wake-up (shared and fair leases), listening to the lock's
    channel in ``room``. ``event`` wakes it, from ``take_place`` on (set then: it tries at
    once); ``waiter`` is our place in the client's line, once taken (lines only)."""

    _room: WaitingRoom
    _options: LeaseOptions
    _channel: str = field(init=False)
    event: asyncio.Event = field(init=False)
    waiter: Waiter | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._channel = self._options.channel

    def first_alone(self) -> bool:
        """Whether to try once before taking a place (nobody of ours waits)."""
        return False

    def take_place(self) -> None:
        """Start waiting (in the line, or as a listener)."""
        self.event = asyncio.Event()
        self.event.set()  # (tries at once)
        self._room.listen(self._channel, self.event)

    def mine(self) -> bool:
        """Whether it is our turn to try when woken."""
        return True

    def handed(self) -> Granted | None:
        """The lock, if a releaser handed it to us (once)."""
        return None

    @property
    def exposed(self) -> bool:
        """Whether a releaser may have handed (or granted) us the key: giving up must
        undo it."""
        return False

    async def leave(self, granted: bool, quietly: bool) -> None:
        """Stop waiting; ``granted``: we took the lock; ``quietly``: our caller returns
        at once (timed out, or refused), so what can wait goes on in the background."""
        self._room.unlisten(self._channel, self.event)


@dataclass(slots=True, eq=False)
class Line(Turn):
    """The client's waiters queue in one line; only its head tries (a semaphore's). An
    acquire joins it only after a busy reply: while nobody of ours waits, it tries at
    once (concurrent acquires take free permits side by side, not one round trip after
    another behind the head)."""

    _token: str

    def take_place(self) -> None:
        options = self._options
        waiter = Waiter(self._token, options.ttl_ms, options.fence_ttl_ms)
        self.waiter = self._room.join(self._channel, waiter)
        self.event = waiter.event
        self.event.set()  # (tries at once; leave() sets it too when we become the head)

    def first_alone(self) -> bool:
        return not self._room.waiting(self._channel)

    def mine(self) -> bool:
        return self.waiter is not None and self._room.head(self._channel) is self.waiter

    async def leave(self, granted: bool, quietly: bool) -> None:
        """Out of the line; the next in line tries now (another permit may be free, or,
        if we gave up, the one we were woken for)."""
        if self.waiter is not None:
            self._room.leave(self._channel, self.waiter, wake_next=True)


@dataclass(slots=True, eq=False)
class Kind:
    """What a kind of lock supplies to the acquisition loop, for one acquisition with
    ``options`` (the defaults: a kind whose attempt depends on nothing but the token,
    with no bookkeeping around it, whose waiters all try at each wake-up, whose replies
    are those every acquire script shares, which waits until the holder's time is up,
    and whose lease holds the lock's own key)."""

    _options: LeaseOptions

    def turn(self, room: WaitingRoom, token: str) -> Turn:
        """How this acquisition's waits take turns in ``room``."""
        return Turn(room, self._options)

    def attempt(self, token: str, turn: Turn | None) -> Request:
        """The acquire script for ``token``; ``turn``: part of a blocking wait."""
        raise NotImplementedError

    def again(self, request: Request) -> Request:
        """``request`` as sent when an earlier attempt with its token may have landed
        (its outcome unknown, or its grant answered too late to use): the script must
        find that hold and answer as if it had just taken it. The default: the same
        request (a kind whose script always looks for its token's hold)."""
        return request

    def sending(self, request: Request, t_send: float) -> None:
        """Called just before ``request`` is sent at loop time ``t_send`` (each try)."""

    def parse(self, reply: object, t_send: float, waiting: bool) -> Granted | Busy | Refused:
        """The acquire script's reply as an outcome."""
        return answer(reply, t_send, self._options)

    def answered(self, outcome: Granted | Busy, waiting: bool) -> None:
        """Called with each answer the caller was not cancelled during."""

    def pause(self, busy: Busy) -> float:
        """Seconds to wait before trying again when no release wakes us."""
        return until_expiry(self._options, busy.pttl_ms)

    def holding(self, token: str, grant: Granted) -> Hold:
        """What the lease that ``grant`` (taken with ``token``) holds: its key (the
        lock's, a permit's or a shared lease's own) and how it is renewed and released."""
        return of_lock(self._options)

    def undo(self, token: str, origin: str, slot: int = -1) -> Request:
        """The script that undoes whatever an attempt with ``token`` may have left (and
        stops it from landing later); ``origin``: our client's id in release messages;
        ``slot``: the grant's (a permit's), when the lock was granted but not handed out
        (see ``_Acquisition._seal``), else -1."""
        raise NotImplementedError


def until_expiry(options: LeaseOptions, pttl_ms: int) -> float:
    """Seconds until a hold that has ``pttl_ms`` left expires, plus a little jitter (a
    key without expiry, ``pttl_ms`` -1, is looked at again after a ttl)."""
    wait = options.ttl if pttl_ms < 0 else pttl_ms / 1000
    return wait + random.uniform(0.001, 0.005 + wait * 0.02)


async def acquire(companion: Companion, options: LeaseOptions, kind: Kind) -> tuple[str, Granted]:
    """Acquire by ``kind``'s rules: one attempt or a wait, as the options say; returns
    the token the lock was taken with and the grant.

    Raises:
        LockBusy: ``blocking=False`` and the lock is taken.
        AcquireTimeout: ``blocking_timeout`` passed (``0``: the one attempt found the lock
            taken), or one attempt was answered too late, twice, to hand the lease out.
        Exception: a ``Refused`` outcome's error (``LimitConflict``, a job's outcome).
        redis.exceptions.RedisError: Redis refused or stayed unreachable.
    """
    token = secrets.token_hex(16)
    return await _Acquisition(companion, options, kind, companion.loop, token).run()


@dataclass(slots=True, eq=False)
class _Acquisition:
    """One acquire: the state of the loop (``_loop``: the companion's; ``_token``: the
    one every attempt of this acquire is made with)."""

    _companion: Companion
    _options: LeaseOptions
    _kind: Kind
    _loop: asyncio.AbstractEventLoop
    _token: str
    # an attempt of ours may have left a hold (or a place)
    _pending: bool = field(default=False, init=False)
    # an attempt of ours got no answer: it may still reach Redis, even after the lease
    # ends (held up on its way); sealed once the lock is ours (see _seal), undone if not
    _unsure: bool = field(default=False, init=False)
    _slot: int = field(default=-1, init=False)  # a grant's slot while it is sealed
    _refused: bool = field(default=False, init=False)  # the last reply was a Refused outcome
    _turn: Turn | None = field(default=None, init=False)  # how we wait, while we do

    async def run(self) -> tuple[str, Granted]:
        options = self._options
        timeout = options.blocking_timeout
        deadline = None if timeout is None else self._loop.time() + timeout
        try:
            if not options.blocking or options.blocking_timeout == 0:  # (one attempt)
                grant = await self._once(deadline)
            else:
                grant = await self._wait(deadline)
            if self._unsure:
                await self._seal(grant)
            return self._token, grant
        except BaseException as exc:
            turn = self._turn
            # (a refusal answered our last attempt: nothing of ours is in flight, and a
            # grant to a withdrawn offer is given back by the room; an attempt that got
            # no answer may be, whatever came after it)
            exposed = turn is not None and turn.exposed and not self._refused
            try:
                if self._pending or exposed or self._unsure:
                    await self._undo(self._undo_limit(exc, deadline))
            finally:
                # (an offered token stays in use for as long as its lease: a grant
                # repeated to it is not undone; see WaitingRoom.in_use)
                self._companion.room.in_use.discard(self._token)
            raise

    async def _once(self, deadline: float | None) -> Granted:
        options = self._options
        for _ in range(2):  # (a second try when the reply came too late to use)
            outcome = await self._attempt(deadline, None)
            if isinstance(outcome, Busy):
                if options.blocking:  # (blocking_timeout=0)
                    raise held(options, outcome.pttl_ms)
                pttl = outcome.pttl_ms
                raise LockBusy(options.name, pttl / 1000 if pttl > 0 else None)
            if self._usable(outcome.t_send):
                return outcome
        raise timed_out(options, "Redis answered too late to use it")

    async def _wait(self, deadline: float | None) -> Granted:
        turn = self._turn = self._kind.turn(self._companion.room, self._token)
        busy: Busy | None = None
        if turn.first_alone():
            # Try before taking a place in the line (the uncontended case costs no line
            # bookkeeping): a usable grant, or the busy reply to act on once in line.
            outcome = await self._try(turn, deadline)
            if isinstance(outcome, Granted):
                return outcome
            busy = outcome
        turn.take_place()
        try:
            grant = await self._in_turn(turn, deadline, busy)
        except BaseException as exc:
            # (quietly when our caller returns at once: timed out, or refused, which is
            # the error in flight when _refused is set)
            await turn.leave(False, self._refused or isinstance(exc, AcquireTimeout))
            raise
        await turn.leave(True, False)
        return grant

    async def _in_turn(self, turn: Turn, deadline: float | None, busy: Busy | None) -> Granted:
        """Wait in turn until an attempt (or a releaser) gives us the lock."""
        options = self._options
        subscribed = False
        held_ms = None if busy is None else busy.pttl_ms  # the last busy reply's word
        while True:
            handed = turn.handed()
            if handed is not None:
                if self._usable(handed.t_send):
                    return handed
                turn.event.set()  # too late to use: refresh it with an attempt
            wait: float | None = None
            # (a waiter holding the key, granted too late to use, refreshes it even if it
            # is not the head: a grant by another client can reach any offered token)
            if not (turn.mine() or self._pending):
                turn.event.clear()  # (woken when it becomes the head of the line)
                busy = None
            elif busy is not None or turn.event.is_set():
                turn.event.clear()
                if busy is None:
                    if deadline is not None and self._loop.time() >= deadline:
                        raise held(options, held_ms)  # (an attempt now would be too late)
                    outcome = await self._try(turn, deadline)
                    if isinstance(outcome, Granted):
                        return outcome
                    busy = outcome
                held_ms = busy.pttl_ms
                # (the pause counts from the reply: a subscription that took its bound
                # and failed must not stretch it, say past a fair waiter's liveness)
                resume = self._loop.time() + self._kind.pause(busy)
                busy = None  # (acted on)
                if not subscribed:
                    subscribed = True
                    if await self._companion.room.subscribe(options.channel, deadline):
                        turn.event.set()  # subscribed first, now try again
                        continue
                wait = max(0.0, resume - self._loop.time())
            if deadline is not None:
                left = deadline - self._loop.time()
                if left <= 0:
                    raise held(options, held_ms)
                wait = left if wait is None else min(wait, left)
            try:
                async with asyncio.timeout(wait):
                    await turn.event.wait()
            except TimeoutError:
                turn.event.set()  # the holder's time is up about now: try again

    async def _try(self, turn: Turn, deadline: float | None) -> Granted | Busy:
        """An attempt of a wait: a usable grant or a busy reply; a grant answered too late
        to use is refreshed at once by another (past the deadline, Redis is slow)."""
        while True:
            outcome = await self._attempt(deadline, turn)
            if isinstance(outcome, Busy) or self._usable(outcome.t_send):
                return outcome
            if deadline is not None and self._loop.time() >= deadline:
                raise timed_out(self._options, "Redis is slow: the last grant came too late to use")

    def _usable(self, t_send: float) -> bool:
        """Whether a hold taken by an attempt sent at ``t_send`` leaves at least a third
        of its TTL; if not, the caller tries again with the same token, which refreshes
        our own hold in one round trip (no release and re-acquire on a slow server)."""
        options = self._options
        left = options.safe_until(t_send) - self._loop.time()
        self._pending = left < options.ttl / 3
        if self._pending:
            log.warning(
                "acquire of %r took %.3fs of a %.3fs ttl; refreshing before use",
                options.name,
                self._loop.time() - t_send,
                options.ttl,
            )
        return not self._pending

    async def _attempt(self, deadline: float | None, turn: Turn | None) -> Granted | Busy:
        """One attempt, and the unknown-outcome ladder (see the design note); ``turn``:
        part of a blocking wait.

        Raises:
            AcquireTimeout: ``deadline`` passed before Redis answered.
            Exception: a ``Refused`` outcome's error.
        """
        kind = self._kind
        request = kind.attempt(self._token, turn)
        if self._pending:  # (an attempt of ours may have left a hold: see again)
            request = kind.again(request)
        task = asyncio.current_task()  # (once: on Python 3.11 each lookup costs ~0.3 µs)
        before = task.cancelling() if task is not None else 0
        client = self._companion.lane
        for retried in (False, True):  # (sent once more after an unknown outcome)
            script, keys, args = request
            t_send = self._loop.time()
            kind.sending(request, t_send)
            try:
                try:
                    reply = await script(client, keys, args, round_trip_end(deadline, t_send))
                except MaxConnectionsError:  # the caller's pool is full: nothing was sent
                    t_send = self._loop.time()  # (an offer keeps the earlier time)
                    ends = round_trip_end(deadline, t_send)
                    reply = await script(self._companion.overflow(), keys, args, ends)
                break
            except UNKNOWN_OUTCOME as exc:
                if not_sent(exc) and not retried:
                    raise  # (never reached Redis: nothing to undo)
                self._pending = True  # (it may have landed: run() undoes it)
                self._unsure = self._unsure or not not_sent(exc)
                if deadline is not None and self._loop.time() >= deadline:
                    raise timed_out(self._options, "Redis did not answer") from exc
                if retried:
                    raise
                request = kind.again(request)
            except ResponseError as exc:
                if isinstance(exc, OutOfMemoryError):
                    exc.add_note(
                        f"asynclock: cannot acquire {self._options.name!r}: Redis is out of "
                        "memory (maxmemory reached under noeviction); leases already held "
                        "keep renewing, new ones cannot be written"
                    )
                # the server refused the script: it wrote nothing of ours to undo (a key
                # of another type at the lock's name is refused by SET ... GET, after the
                # counter's write)
                raise
            except BaseException:
                self._pending = True
                raise
        cancelled = task is not None and task.cancelling() > before  # (see cancel_dropped)
        return self._answered(reply, t_send, turn is not None, cancelled)

    def _answered(
        self, reply: object, t_send: float, waiting: bool, cancelled: bool
    ) -> Granted | Busy:
        """The reply as an outcome, with the dropped-cancellation rule: a cancellation
        that arrived while the script was in flight (``cancelled``) is raised here, what
        the attempt took left for ``run()`` to undo."""
        try:
            outcome = self._kind.parse(reply, t_send, waiting)
        except Exception:
            if cancelled:
                raise asyncio.CancelledError from None
            raise
        left = isinstance(outcome, Granted) or (isinstance(outcome, Busy) and outcome.pending)
        if cancelled:
            self._pending = self._pending or left
            raise asyncio.CancelledError
        if isinstance(outcome, Refused):
            # (this attempt left nothing, but what an earlier one left stays to undo: a
            # fair waiter's place in the queue, so _pending is kept)
            self._refused = True
            raise outcome.error
        self._pending = left and not isinstance(outcome, Granted)  # (see _usable)
        self._kind.answered(outcome, waiting)
        return outcome

    def _undo_limit(self, exc: BaseException, deadline: float | None) -> float | None:
        """How long undoing may take after ``exc`` ended an acquisition whose deadline was
        ``deadline`` (loop time; None: none): ``TIMEOUT_GRACE`` past the deadline, which
        an ``AcquireTimeout`` has reached, or past the one attempt of ``blocking=False``;
        else ``release_timeout`` (None)."""
        if isinstance(exc, AcquireTimeout) or not self._options.blocking:
            return TIMEOUT_GRACE
        if deadline is None:
            return None
        return max(deadline - self._loop.time(), 0.0) + TIMEOUT_GRACE

    async def _seal(self, grant: Granted) -> None:
        """Write the tombstone of our token before the lease is handed out, after an
        attempt of ours got no answer: held up on its way, it may reach Redis after the
        lease has ended and take the lock for nobody, until its TTL (a permit, a shared
        hold or a fair place alike); the tombstone makes it take nothing, whenever it
        comes. Within ``ROUND_TRIP_FLOOR``, and only while the hold keeps a third of its
        TTL (``_usable``): if Redis does not answer by then, the lease is handed out all
        the same (a warning says what may follow). A cancellation meanwhile gives the
        lock back, as one during an attempt does (``run()``, ``_slot``)."""
        options = self._options
        self._pending, self._slot = True, grant.slot  # (ours, not yet handed out)
        now = self._loop.time()
        bound = min(ROUND_TRIP_FLOOR, options.safe_until(grant.t_send) - options.ttl / 3 - now)
        keys, args = [options.void_key(self._token)], [options.tombstone_ms]
        companion = self._companion
        try:
            if bound <= 0:
                raise TimeoutError("no time left before the lease is handed out")
            sealing = run_idempotent(SEAL, companion.lane, companion.overflow, keys, args)
            await finish(sealing, bound)
        except (*UNKNOWN_OUTCOME, ResponseError) as exc:
            log.warning(
                "could not seal an acquire attempt of %r that got no answer (%r); if it "
                "reaches Redis after the lease ends, the lock stays taken until its TTL",
                options.name,
                exc,
            )
        self._pending, self._slot = False, -1

    async def _undo(self, limit: float | None = None) -> None:
        """Undo whatever an attempt may have left, within ``limit`` seconds (at most
        ``release_timeout``), tried again while Redis does not answer (what it may have
        left, a fair waiter's place above all, holds up every other client); then let the
        others of our client try."""
        options = self._options
        companion = self._companion
        script, keys, args = self._kind.undo(self._token, companion.room.origin, self._slot)
        bound = options.release_timeout if limit is None else min(limit, options.release_timeout)
        try:
            lane, overflow = companion.lane, companion.overflow
            until = self._loop.time() + bound
            await finish(run_idempotent(script, lane, overflow, keys, args, until=until), bound)
        except Exception as exc:
            why = f"no answer within {bound:g}s" if isinstance(exc, TimeoutError) else repr(exc)
            log.warning(
                "could not undo an acquire attempt of %r that may have landed (%s); if it "
                "did, what it took expires by its TTL",
                options.name,
                why,
            )
        finally:
            companion.room.wake(options.channel)  # (the others: it may be free now)
