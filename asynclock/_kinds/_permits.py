"""Acquiring a permit of a semaphore (``lease(..., limit=N)``), the semaphore kind's way in.

Design note. A semaphore of N is N permit keys, ``<prefix>{name}:permit:<i>``; a permit
held is a lease of its own on one of them. So once acquired it is renewed, watched,
lost and released by the same code as a mutex's lease, through the seam of its kind
(PERMIT_RENEW and PERMIT_RELEASE, which keep the index below in step; the read-back of
its key is a mutex's); a permit whose holder dies expires on its own, by its TTL. Taking
one is here: the SEMAPHORE_ACQUIRE script finds a free slot in the semaphore's index
``<prefix>{name}:permits`` (a sorted set of slot -> the server time its key expires at,
0 once released) in O(log N) whatever the limit, takes its key, minting a fencing token
from the lock's one counter (so fencing tokens increase per name across all permits),
or answers when the first held permit expires. The attempt's void key records the slot
taken, so a retry of ours (and the undo) finds its permit without a scan.

Waiting reuses the client's waiting room (see ``_wakeup``): waiters of one client queue
in one line per semaphore, the head tries, subscribes to the lock's release channel after
a failed try and tries again, then sleeps until a release of any permit (published by
RELEASE, or by this client's own release) or until the first permit would expire. A head
that takes a permit wakes the next in line, which tries in its turn, since more permits
may be free. No permit is handed over: releasers let waiters of every client compete.

The loop, and the ladder for an attempt whose outcome is unknown, are the engine's
(``_engine``); this kind supplies its scripts and their replies: SEMAPHORE_ABANDON deletes
the permit if an abandoned attempt took one and leaves a tombstone the script honours, so
a late arrival cannot take a permit after all.
"""

from __future__ import annotations

from typing import cast

from .._base._exceptions import LimitConflict
from .._redis._scripts import SEMAPHORE_ABANDON, SEMAPHORE_ACQUIRE, Arg
from .._session._wakeup import WaitingRoom
from ._engine import Busy, Granted, Kind, Line, Refused, Request, Turn, answer
from ._hold import Hold, of_permit

__all__ = ["Permits"]


class Permits(Kind):
    """The semaphore kind: a permit of ``options.limit``, waiting in the client's line."""

    __slots__ = ()

    def turn(self, room: WaitingRoom, token: str) -> Turn:
        return Line(room, self._options, token)

    def attempt(self, token: str, turn: Turn | None) -> Request:
        options = self._options
        keys = [
            options.limit_key,
            options.fence_key,
            options.void_key(token),
            options.base_key,
            options.permits_key,
        ]
        return Request(
            SEMAPHORE_ACQUIRE, keys, [token, options.ttl_ms, options.fence_ttl_ms, options.limit]
        )

    def parse(self, reply: object, t_send: float, waiting: bool) -> Granted | Busy | Refused:
        """(1, fence, slot): a permit; (0, pttl of the first to expire); (-2, the limit
        the permits are held with); (-3): held as a plain lock."""
        options = self._options
        if int(cast(list[int], reply)[0]) == -3:
            return Refused(LimitConflict(options.name, "held as a plain lock (limit=1)"))
        return answer(reply, t_send, options)

    def holding(self, token: str, grant: Granted) -> Hold:
        return of_permit(self._options, grant.slot)

    def undo(self, token: str, origin: str, slot: int = -1) -> Request:
        options = self._options
        keys = [options.void_key(token), options.permits_key, options.base_key]
        args: list[Arg] = [token, options.tombstone_ms, options.channel, origin]
        if slot >= 0:  # (granted, then sealed: the tombstone hides the attempt's slot)
            args.append(slot)
        return Request(SEMAPHORE_ABANDON, keys, args)
