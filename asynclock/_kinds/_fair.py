"""Acquiring a lock in arrival order (``lease(..., fair=True)``), the fair kind's way in.

Design note. A fair lock is the plain lock (same key, renewed, lost and released the same
way) with a queue in Redis beside it: FAIR_ACQUIRE enqueues a waiter at its first
attempt, with the server's time as its place, and lets only the first live waiter take
the lock once it is free. Every waiter says it is alive by each attempt, and tries at
least every ``FAIR_PATIENCE / 2`` seconds; a waiter that died is dropped from the head of
the queue once ``FAIR_PATIENCE`` has passed since its last attempt. So a dead waiter
delays the queue by at most ``FAIR_PATIENCE`` plus one retry period (3 s), and one that
gives up (cancelled, timed out) leaves at once (FAIR_LEAVE), waking the others; one whose
attempt fails on the network leaves as soon as Redis answers again (the engine's undo is
tried again within ``release_timeout``), before its caller sees the error.

Unlike the plain lock's line, where only the head of a client's line tries, every fair
waiter of a client tries on each release: its place in the queue is the server's, and a
client's own order would not match it. A release wakes them all (they listen to the
lock's channel in the client's waiting room, outside its line), and the lock is never
handed over within a client (``_release``). A plain ``lease()`` of the same name
does not queue: it takes the lock whenever it finds it free. The loop is the engine's
(``_engine``); this kind supplies its scripts, their replies and its pause.
"""

from __future__ import annotations

import random
from typing import Final

from .._redis._scripts import FAIR_ACQUIRE, FAIR_LEAVE, Arg
from ._engine import Busy, Granted, Kind, Refused, Request, Turn, answer

__all__ = ["FAIR_PATIENCE", "Fair"]

FAIR_PATIENCE: Final = 2.0
"""Seconds a fair waiter counts as waiting after its last attempt (it tries at least
twice as often): how long a waiter that died can hold up the queue."""

_PATIENCE_MS: Final = round(FAIR_PATIENCE * 1000)


class Fair(Kind):
    """The fair kind: the plain lock, taken in the order of a queue in Redis; every
    waiter tries at each release (the queue, not the client, decides the order)."""

    __slots__ = ()

    def attempt(self, token: str, turn: Turn | None) -> Request:
        """A waiting attempt (``turn``) joins (or stays in) the queue."""
        options = self._options
        keys = options.attempt_keys(token, options.queue_key, options.alive_key)
        args: list[Arg] = [
            token,
            options.ttl_ms,
            options.fence_ttl_ms,
            _PATIENCE_MS,
            "wait" if turn is not None else "",
        ]
        return Request(FAIR_ACQUIRE, keys, args)

    def parse(self, reply: object, t_send: float, waiting: bool) -> Granted | Busy | Refused:
        """The fencing token alone: the lock; (0, the holder's pttl in ms; 0 when the lock
        is free but another waiter's turn), a waiting attempt's place in the queue kept."""
        return answer(reply, t_send, self._options, pending=waiting)

    def pause(self, busy: Busy) -> float:
        """At least every FAIR_PATIENCE / 2, so that our place in the queue stays alive."""
        wait = FAIR_PATIENCE / 2 * random.uniform(0.8, 1.0)
        if busy.pttl_ms > 0:
            wait = min(wait, busy.pttl_ms / 1000 + random.uniform(0.001, 0.005))
        return wait

    def undo(self, token: str, origin: str, slot: int = -1) -> Request:
        """Leave the queue, and undo an attempt that may have taken the lock."""
        options = self._options
        keys = [options.key, options.void_key(token), options.queue_key, options.alive_key]
        return Request(FAIR_LEAVE, keys, [token, options.tombstone_ms, options.channel, origin])
