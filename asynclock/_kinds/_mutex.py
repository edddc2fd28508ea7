"""The plain lock (a mutex) as a kind of the acquisition engine, with its hand-over.

Design note. An attempt is one round trip (the ACQUIRE script, or ACQUIRE_JOB for a job of
``once()``); the loop around it, and the ladder for an unknown outcome, are the engine's
(``_engine``). What is the mutex's own is the hand-over, in both directions:

- A blocking acquire first tries at once when nobody of its client waits for the lock (no
  line bookkeeping on the uncontended path); otherwise, or after that try failed, it
  queues in the client's ``WaitingRoom`` line (``HandOverLine``): the head tries,
  subscribes to the release channel (and its client's grant channel for the lock) after a
  failed try and tries again, then sleeps until woken by a release, handed the lock by a
  releaser of its own client (``Waiter.grant``), granted it by a releaser of another, or
  until the holder's key would expire (PTTL plus jitter, ``pause``).
- A blocking wait registers its client as waiting (ACQUIRE's ``on_success``), so releasers
  in other clients let it have the lock after at most ``HANDOFF_PATIENCE_MS``; its line
  drops the registration when it empties (``unregister``).
- A failed try of the head of a listening line offers its token for such a grant
  (``sending`` records the offer's time); from then on, giving up means withdrawing the
  offer (the engine undoes it: ABANDON), since a grant may already have landed. A grant
  that was published but never read (a broken subscription) is found by the next try:
  the key then holds our own token.

ABANDON deletes the key if an attempt of ours set it and leaves a tombstone for its token,
which ACQUIRE honours, so the cleanup is safe even if it overtakes the attempt.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Final, NamedTuple, cast

from .._base._options import LeaseOptions
from .._base._shield import finish
from .._redis._lane import exchange
from .._redis._scripts import ABANDON, ACQUIRE, ACQUIRE_JOB, HANDOFF, Arg
from .._session._connections import Companion
from .._session._wakeup import Waiter, WaitingRoom
from ._engine import Busy, Granted, Kind, Line, Refused, Request, Turn, answer, until_expiry

__all__ = [
    "GRANT_FRESH_MS",
    "HANDOFF_PATIENCE_MS",
    "HandOverLine",
    "Handoff",
    "Job",
    "JobConflict",
    "JobDone",
    "JobUnstored",
    "Mutex",
    "handoff_call",
    "read_handoff",
    "register_ms",
    "unregister",
]

log = logging.getLogger("asynclock")

HANDOFF_PATIENCE_MS: Final = 5
"""A releaser hands the lock within its own client's line until a waiter of another
client has been registered this long (ms); then it grants the lock to that client's
offered token, or lets every client compete (see HANDOFF)."""


GRANT_FRESH_MS: Final = 1000
"""How old (ms) another client's offer may be for a release to grant it the key (and at
most a third of its TTL); an older offer gets a plain release and a wake-up instead. This
bounds how long after a waiter's last attempt a grant can go to a waiter that died."""


def register_ms(ttl_ms: int) -> int:
    """How long (ms) a registration as waiting lasts unless refreshed: 2 x ttl + 1 s.

    A waiting head refreshes it by each failed attempt, and tries at least every half of
    that (``Mutex.pause``), so a live wait never lapses; a crashed one does.
    """
    return 2 * ttl_ms + 1000


class Job(NamedTuple):
    """What makes an acquisition a job of ``once()``: the key of its result hash and the
    caller's fingerprint digest ('' checks nothing)."""

    result_key: str
    fingerprint: str


class JobDone(Exception):
    """Raised by an attempt of a job that found its result stored: ``payload``."""

    def __init__(self, payload: object) -> None:
        super().__init__("the job's result is stored")
        self.payload = payload


class JobUnstored(JobDone):
    """Raised by an attempt of a job that ran but whose result could not be stored: the
    marker left instead says why (``payload``)."""


class JobConflict(Exception):
    """Raised by an attempt of a job that found another fingerprint: ``theirs`` (which
    nobody reads: ``once()`` raises ``IdempotencyConflict`` for the key alone)."""

    def __init__(self, theirs: object) -> None:
        super().__init__("the job runs, or ran, with another fingerprint")


_JOB_REFUSALS: Final[dict[int, type[Exception]]] = {2: JobDone, 3: JobConflict, 4: JobUnstored}
"""A job's attempt refused, by its status: the result stored, another fingerprint, the
result not stored."""


@dataclass(slots=True, eq=False)
class Mutex(Kind):
    """The plain lock (``job``: a job of ``once()``, whose result the attempt reads)."""

    _companion: Companion
    _job: Job | None
    # what the last attempt asked of our registration; whose token it offers, if any
    _on_success: str = field(default="", init=False)
    _offering: Waiter | None = field(default=None, init=False)

    def turn(self, room: WaitingRoom, token: str) -> Turn:
        return HandOverLine(room, self._options, token, self._companion)

    def attempt(self, token: str, turn: Turn | None) -> Request:
        """ACQUIRE; a waiting attempt (``turn``) registers its client as waiting, and the
        head of a listening line offers its token (see ``sending``)."""
        options = self._options
        room = self._companion.room
        channel = options.channel
        keys = options.attempt_keys(token, options.waiting_key)
        job = self._job
        on_success = ""
        waiter = None if turn is None else turn.waiter
        if turn is not None:
            if room.waiting(channel) > (0 if waiter is None else 1):  # others of ours wait
                on_success = "keep"
            elif room.registered(channel):
                on_success = "drop"
            elif waiter is not None:  # (a token in our line may have been offered)
                on_success = "withdraw"
        args: list[Arg] = [
            token,
            options.ttl_ms,
            options.fence_ttl_ms,
            "" if turn is None else room.origin,
            register_ms(options.ttl_ms),
            on_success,
            "",  # (our send time, when offering our token: see sending)
        ]
        if job is not None:
            keys.append(job.result_key)
            args.append(job.fingerprint)
        elif turn is None:  # (outside a wait: the script reads only the first three)
            del keys[3:], args[3:]
        # Only a listening head offers: a grant is read from the subscription, and should
        # its notification be missed anyway (the subscription broke), the head's next
        # attempt finds the key holding its own token and takes it. (Concurrent first
        # attempts, made before joining the line, are not heads: the one that joins
        # second would wait, never trying, and the key granted to it with it.)
        self._offering = None
        if waiter is not None and room.head(channel) is waiter and room.listening(channel):
            self._offering = waiter  # (its token is ours)
            waiter.exposed = True  # (from the first send on, a grant may land)
        self._on_success = on_success
        return Request(ACQUIRE_JOB if job is not None else ACQUIRE, keys, args)

    def sending(self, request: Request, t_send: float) -> None:
        """An offering attempt's lease counts from its send time, carried in the offer."""
        if self._offering is not None:
            self._companion.room.in_use.add(self._offering.token)  # (until it failed or ended)
            request.args[6] = repr(t_send)

    def parse(self, reply: object, t_send: float, waiting: bool) -> Granted | Busy | Refused:
        """The fencing token alone: the lock; (0, the holder's pttl in ms); a job's (2,
        its stored result), (3, another fingerprint), (4, why its result was not stored),
        (5, the fencing token): the lock, which a releaser handed to our token (its key
        holds no job digest)."""
        if isinstance(reply, list):
            raw_status, raw_value = cast(list[int | bytes], reply)  # (exactly two, or raise)
            status = int(raw_status)
            if status in _JOB_REFUSALS:
                return Refused(_JOB_REFUSALS[status](raw_value))
            if status == 5:
                return Granted(int(raw_value), t_send, handed=True)
        return answer(reply, t_send, self._options)

    def answered(self, outcome: Granted | Busy, waiting: bool) -> None:
        if waiting:
            keep = self._on_success == "keep" if isinstance(outcome, Granted) else True
            self._companion.room.set_registered(self._options.channel, keep)

    def pause(self, busy: Busy) -> float:
        """Until the holder's key would expire, and at least every half of our
        registration's life (a live wait never lapses)."""
        wait = until_expiry(self._options, busy.pttl_ms)
        return min(wait, register_ms(self._options.ttl_ms) / 2000)

    def undo(self, token: str, origin: str, slot: int = -1) -> Request:
        """ABANDON: delete the key if it holds ``token``, withdraw its offer, tombstone it."""
        keys, args = self._companion.abandon_call(
            self._options.key, token, self._options.tombstone_ms
        )
        return Request(ABANDON, keys, args)


@dataclass(slots=True, eq=False)
class HandOverLine(Line):
    """The mutex's line: its first waiter tries before taking a place (as every line's
    does), its head may be handed the lock by a releaser, and the line drops its client's
    registration as waiting when it empties."""

    _companion: Companion

    def handed(self) -> Granted | None:
        waiter = self.waiter
        if waiter is None or waiter.grant is None:
            return None
        fence, t_send = waiter.grant
        waiter.grant = None
        waiter.offered = False  # the handoff is over (the engine's pending covers the key)
        return Granted(fence, t_send, handed=True)

    @property
    def exposed(self) -> bool:
        waiter = self.waiter
        return waiter is not None and (waiter.offered or waiter.exposed)

    async def leave(self, granted: bool, quietly: bool) -> None:
        """Out of the line; having just taken the lock, the next in line is not sent to
        try in vain (our release will wake it). An empty line drops our registration as
        waiting: after a grant (a handoff was decided when it was sent) or when our caller
        returns at once (timed out, a job's result found), in the background."""
        room = self._room
        channel = self._channel
        if self.waiter is not None:
            if granted:
                self.waiter.offered = False
            room.leave(channel, self.waiter, wake_next=not granted)
        if not room.waiting(channel) and room.registered(channel):
            work = unregister(self._companion, self._options)
            if granted or quietly:
                room.in_background(work)
            else:
                await work


class Handoff(enum.Enum):
    """What HANDOFF did with the key (a release with a waiter in our own line)."""

    NOT_OURS = 0  # the key was not ours: nothing done
    HANDED = 1  # the key now belongs to the next waiter's token, with a new fence
    CONTESTED = 2  # released as RELEASE does: another client's waiter is due
    ALREADY = 3  # the key already held the next waiter's token (its own attempt, or a
    # retry of ours after our handoff landed); its expiry renewed
    RELEASED = 4  # the next waiter gave up (its tombstone): released as RELEASE does
    GRANTED = 5  # granted to another client's offered waiter (and published to it)


def handoff_call(
    options: LeaseOptions,
    owner: str,
    successor: Waiter,
    behind: Waiter | None,
    origin: str,
    listening: bool,
    t_offer: float,
) -> Request:
    """HANDOFF of the lease ``owner`` holds to ``successor``, the head of our line
    (``behind``: the waiter after it, whose token our registration may offer;
    ``listening``: our client reads its grants, else it offers no token; ``t_offer``: the
    loop time the successor's lease counts from)."""
    keys = [
        options.key,
        options.fence_key,
        options.void_key(successor.token),
        options.waiting_key,
        options.void_key("" if behind is None else behind.token),
    ]
    args: list[Arg] = [
        owner,
        successor.token,
        successor.ttl_ms,
        successor.fence_ttl_ms,
        options.channel,
        origin,
        "keep" if behind is not None else "drop",
        register_ms(successor.ttl_ms),
        HANDOFF_PATIENCE_MS,
        repr(t_offer),
        "" if behind is None or not listening else behind.token,
        0 if behind is None else behind.ttl_ms,
        GRANT_FRESH_MS,
        "1" if listening else "",
    ]
    return Request(HANDOFF, keys, args)


def read_handoff(reply: object) -> tuple[Handoff, int]:
    """HANDOFF's reply: what it did, and the fencing token it minted (or found)."""
    status, fence = (int(x) for x in cast(list[int], reply))
    return Handoff(status), fence


async def unregister(companion: Companion, options: LeaseOptions) -> None:
    """Our line for the lock is empty: drop our client's registration as a waiter, so
    that other clients' releasers hand the lock on within their own lines again without
    standing back for us (best effort; it expires by itself otherwise)."""
    command = companion.pack("HDEL", options.waiting_key, companion.room.origin)
    companion.room.set_registered(options.channel, False)
    try:
        await finish(exchange(companion.client, command, 1), min(1.0, options.release_timeout))
    except Exception as exc:  # (a cancellation is no Exception: it propagates)
        log.debug("could not unregister a wait for %r: %r", options.name, exc)
