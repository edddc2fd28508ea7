"""Acquiring a shared (read) lease (``lease(..., shared=True)``), the shared kind's way in.

Design note. Any number of shared leases may hold a lock at once, and none while an
exclusive (plain) lease holds it. While shared leases hold it, the lock's key holds the
marker ``shared``, kept alive as long as the longest of them: a plain ``lease()`` finds
the lock taken, and waits (or registers as waiting) as it does for any holder. Each shared
lease is a member of the lock's set of readers (``<key>:readers``), its value
``<token>:<fencing token>`` scored with its expiry, which the watchdog renews with the
marker (SHARED_RENEW) and which is lost and released as any lease's key is; the last one
out deletes the marker and announces the release. An attempt knows only its token: one
sent again after an outcome it did not learn says so (``again``), and only then does the
script look the token's member up.

So that writers are not starved, a shared acquire waits while an exclusive waiter is
registered for the lock (a blocking ``lease()`` that found it taken registers, see
ACQUIRE): shared holders drain, the exclusive one gets in, and shared ones follow when it
releases. While a writer waits, shared waiters look again at least every second (its
registration says nothing when it gives up). Shared waiters listen to the lock's release
channel outside the client's line (all of them try at each release), and a shared lease
is never handed over. The loop is the engine's (``_engine``); this kind supplies its
scripts and their replies.
"""

from __future__ import annotations

from .._redis._scripts import SHARED_ABANDON, SHARED_ACQUIRE
from ._engine import Granted, Kind, Request, Turn
from ._hold import Hold, of_reader

__all__ = ["Shared"]


class Shared(Kind):
    """The shared kind: a shared lease; every waiter tries at each release. Its replies
    are (1, fence): a shared hold; (0, ms to wait at most before trying again)."""

    __slots__ = ()

    def attempt(self, token: str, turn: Turn | None) -> Request:
        options = self._options
        keys = options.attempt_keys(token, options.waiting_key, options.readers_key)
        return Request(SHARED_ACQUIRE, keys, [token, options.ttl_ms, options.fence_ttl_ms])

    def again(self, request: Request) -> Request:
        """The attempt, told to look for a hold of its token (SHARED_ACQUIRE's ARGV[4])."""
        return Request(request.script, request.keys, [*request.args[:3], "1"])

    def holding(self, token: str, grant: Granted) -> Hold:
        return of_reader(self._options, token)  # (a member of the readers' set)

    def undo(self, token: str, origin: str, slot: int = -1) -> Request:
        options = self._options
        keys = [options.readers_key, options.base_key, options.void_key(token)]
        return Request(SHARED_ABANDON, keys, [token, options.channel, origin, options.tombstone_ms])
