"""Waking waiters when a lock is released, without polling.

Design note. Waiters of one process queue locally, one line per lock: only the head of a
line talks to Redis, so a release wakes one attempt, not a herd, and waiters are served in
arrival order. A release by this process wakes its local head directly. Other processes
learn of a release from the lock's pub/sub channel, on which the release script publishes;
one subscription connection per client serves every lock waited on.

A release with a waiter in the releasing client's own line hands the key straight to that
waiter (the ``HANDOFF`` script; see ``Waiter``). To keep other clients from being starved
by such local handoffs, blocking waits register their client in Redis (a hash of origin ->
since/until, written by failed attempts), offering the token of their first waiter with
the loop time at which the registration was sent. Once another client's waiter has been
registered for a few milliseconds, the release grants the key to that client's offered
token and publishes the grant on that client's own grant channel for the lock (the
release channel plus ``:<origin>``, subscribed together with it, so no other client
reads it: the releaser's own and every third client's listener would otherwise wake for
nothing, and on a shared core delay the one that matters); the client picks it up here
(``_granted``) and the waiter counts its lease from its offer's loop time, which precedes
the grant. Without an offer
the release is a plain one. Either way the releasing client's head stands back
(``wake_with_others``) until the next release notification, or ``_YIELD``, then tries, and
so learns how long to wait at most.

A waiter subscribes before the attempt that precedes its wait, so no release can slip
between a failed attempt and the subscription. Notifications are only a hint: the head
also wakes when the holder's key would expire (its PTTL plus jitter), so an expired or
crashed holder's lock is taken too, and a broken subscription degrades to that fallback,
never to an error or a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from .._base._shield import close_fully
from .._redis._compat import connection_errors
from .._redis._lane import encoding_in
from .._redis._leftovers import forget_connection
from .._redis._refusals import explain, is_refusal

__all__ = ["Waiter", "WaitingRoom"]

log = logging.getLogger("asynclock")

_SUBSCRIBE_LIMIT = 1.0  # seconds a waiter waits for a subscription to be confirmed
_YIELD = 0.02  # seconds our head stands back after a release that others compete for
_STALE_CHANNELS = 64  # unused subscriptions kept before they are dropped in one batch
_HEARTBEAT = 1.0  # seconds of silence on the subscription, while waiters wait, before a PING
_HEARD_WITHIN = 3 * _HEARTBEAT  # a subscription silent for longer is not trusted to listen
_SUBSCRIPTION_REPLIES = frozenset((b"subscribe", b"unsubscribe", b"ssubscribe", b"sunsubscribe"))


class Waiter:
    """One contender waiting in a line; ``event`` is set to wake it.

    A releaser of the same client may hand the lock straight to the head of the line (the
    ``HANDOFF`` script): it sets ``offered`` before sending (from then on the key may hold
    this waiter's ``token``), then ``grant`` (fencing token, t_send) if the handoff landed.

    ``exposed`` is set before anything registers ``token`` in Redis as this client's
    offer: from then on a releaser of another client may grant the key to it at any time
    (published, and set here as ``grant``), so a waiter that gives up must withdraw the
    offer and delete such a key (``ABANDON``).
    """

    __slots__ = ("event", "exposed", "fence_ttl_ms", "grant", "offered", "token", "ttl_ms")

    def __init__(self, token: str = "", ttl_ms: int = 0, fence_ttl_ms: int = 0) -> None:
        self.event = asyncio.Event()
        self.token = token
        self.ttl_ms = ttl_ms
        self.fence_ttl_ms = fence_ttl_ms  # (its lock's fencing counter's retention, ms)
        self.offered = False
        self.exposed = False
        self.grant: tuple[int, float] | None = None


class WaitingRoom:
    """The local lines of waiters of one client, and the subscription that wakes them."""

    def __init__(
        self, connection_class: type[Any], settings: dict[str, Any], *, sharded: bool = False
    ) -> None:
        """``sharded``: the client of a cluster node, whose locks' channels are sharded
        (``SSUBSCRIBE``, one lock's channels per command: they share its slot)."""
        self._connection_class = connection_class
        self._sharded = sharded
        self._subscribe = "SSUBSCRIBE" if sharded else "SUBSCRIBE"
        self._unsubscribe = "SUNSUBSCRIBE" if sharded else "UNSUBSCRIBE"
        # The listener reads RESP2 bytes and blocks without a socket timeout.
        self._settings = {**settings, "decode_responses": False, "socket_timeout": None}
        # Channel names come back as the bytes our connection encoded them to.
        self._encoding = encoding_in(settings)
        self._lines: dict[str, deque[Waiter]] = {}
        # Waiters outside the lines (fair and shared ones: see listen), per channel.
        self._listeners: dict[str, set[asyncio.Event]] = {}
        self.origin = secrets.token_hex(8)
        """Published with this client's releases, so it can tell its own notifications."""
        self._origin_bytes = self.origin.encode()
        self._grants = ":" + self.origin  # a lock's channel + this: our grant channel
        self.connection: Any = None
        """The subscription's connection (None before the first subscription)."""
        self._reader: asyncio.Task[None] | None = None
        # channel -> SUBSCRIBE/UNSUBSCRIBE commands for it sent and not answered yet: a
        # lock's channel counts as subscribed once the reply to the last of them, for it
        # and for its grants', said so (its last command: SUBSCRIBE, see _subscribed)
        self._inflight: dict[str, int] = {}
        # locks' channels confirmed with their grants': all subscribed, on a connection not
        # broken since (a break, or aclose, clears it)
        self._confirmed: set[str] = set()
        self._pending: dict[str, asyncio.Future[bool]] = {}
        self._healthy = False
        # loop time the subscription connection last answered (set, like _confirmed, only
        # by a reply read: every channel confirmed was confirmed by a reply heard since)
        self._heard = -math.inf
        self._starting = asyncio.Lock()
        self._subscribed: set[str] = set()  # locks' channels sent SUBSCRIBE (both) and
        # not UNSUBSCRIBE
        # heads standing back for other clients' waiters: channel -> the timer's handle
        self._deferred: dict[str, asyncio.TimerHandle] = {}
        self._registered: set[str] = set()  # channels for which we may be registered waiting
        self._background: set[asyncio.Task[object]] = set()  # work made in passing
        self._subscribing: asyncio.Task[object] | None = None  # (one of them)
        self.in_use: set[str] = set()
        """Tokens of this client's acquires that offered their token, until the acquire
        failed or its lease ended: a grant to one of them is never undone."""
        self.on_orphan: Callable[[str, str], Coroutine[Any, Any, object]] | None = None
        """Undoes a grant to a token of ours that no waiter holds any more: (channel,
        token); run in the background."""

    @property
    def open(self) -> bool:
        return self._reader is not None or bool(self._background)

    # -- local lines -------------------------------------------------------------------

    def join(self, channel: str, waiter: Waiter) -> Waiter:
        """Add ``waiter`` at the end of ``channel``'s line."""
        line = self._lines.setdefault(channel, deque())
        line.append(waiter)
        if len(line) == 1:
            waiter.event.set()
        return waiter

    def head(self, channel: str) -> Waiter | None:
        """The first waiter in ``channel``'s line, if any."""
        line = self._lines.get(channel)
        return line[0] if line else None

    def second(self, channel: str) -> Waiter | None:
        """The waiter behind the head of ``channel``'s line, if any."""
        line = self._lines.get(channel)
        return line[1] if line and len(line) > 1 else None

    def waiting(self, channel: str) -> int:
        """How many waiters are in ``channel``'s line."""
        return len(self._lines.get(channel, ()))

    def listening(self, channel: str) -> bool:
        """Whether release notifications on ``channel``, and grants of its lock to this
        client, reach this client: both subscriptions are confirmed, have not broken
        since, and the connection answered within the last ``_HEARD_WITHIN`` seconds
        (while waiters wait, a silent subscription is pinged every ``_HEARTBEAT``: a
        connection dropped without a word, by a NAT or a load balancer, must not go on
        being trusted to carry grants)."""
        return (
            channel in self._confirmed
            and asyncio.get_running_loop().time() - self._heard <= _HEARD_WITHIN
        )

    def registered(self, channel: str) -> bool:
        """Whether this client may be registered in Redis as waiting for the lock."""
        return channel in self._registered

    def set_registered(self, channel: str, registered: bool) -> None:
        if registered:
            self._registered.add(channel)
        else:
            self._registered.discard(channel)

    def leave(self, channel: str, waiter: Waiter, *, wake_next: bool = True) -> None:
        """Remove ``waiter``; the next in line becomes head (woken to try if ``wake_next``)."""
        line = self._lines.get(channel)
        if not line:
            return
        was_head = line[0] is waiter
        with contextlib.suppress(ValueError):
            line.remove(waiter)
        if not line:
            del self._lines[channel]
        elif was_head and wake_next:
            line[0].event.set()

    def wake(self, channel: str) -> None:
        """The lock on ``channel`` was released: wake the head of its line, if any, and
        every listener of the channel."""
        line = self._lines.get(channel)
        if line:
            line[0].event.set()
        for event in self._listeners.get(channel, ()):
            event.set()

    def listen(self, channel: str, event: asyncio.Event) -> None:
        """Set ``event`` at every release of the lock on ``channel`` (ours, or another
        client's once subscribed): for waiters that all try at each release, outside the
        lines, which are never handed a lock (a fair lock's, a shared lease's)."""
        self._listeners.setdefault(channel, set()).add(event)

    def listeners(self, channel: str) -> int:
        """How many waiters listen to ``channel`` outside its line (see ``listen``)."""
        return len(self._listeners.get(channel, ()))

    def unlisten(self, channel: str, event: asyncio.Event) -> None:
        listeners = self._listeners.get(channel)
        if listeners is not None:
            listeners.discard(event)
            if not listeners:
                del self._listeners[channel]

    def wake_with_others(self, channel: str) -> None:
        """A release of ours found waiters of other clients registered: let them have the
        lock. Our own head stands back for a moment instead of racing them (it would win
        every time, starting first), and is woken by the next release notification, or
        after ``_YIELD`` seconds should the others not take it (a waiter that went away
        stays registered until its registration expires). Without a confirmed
        subscription no notification would come: then it is woken at once, and the
        subscription is made in the background for the next time (a line that passes the
        lock on by handoffs alone never had a failed attempt that subscribed)."""
        if channel not in self._confirmed:
            self.wake(channel)
            if self._subscribing is None or self._subscribing.done():
                self._subscribing = self.in_background(self.subscribe(channel))
            return
        earlier = self._deferred.pop(channel, None)
        if earlier is not None:
            earlier.cancel()
        loop = asyncio.get_running_loop()
        self._deferred[channel] = loop.call_later(_YIELD, self._wake_deferred, channel)

    def in_background(self, work: Coroutine[Any, Any, object]) -> asyncio.Task[object]:
        """Run ``work`` as a task of this room's, cancelled if the room is closed first
        (the companion's work in passing too: its server check)."""
        task = asyncio.get_running_loop().create_task(work, name="asynclock-background")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _wake_deferred(self, channel: str) -> None:
        if self._deferred.pop(channel, None) is not None:
            self.wake(channel)  # the others did not take it in time

    # -- the subscription --------------------------------------------------------------

    async def subscribe(self, channel: str, deadline: float | None = None) -> bool:
        """Subscribe to ``channel`` and to our grant channel for its lock, and wait
        (bounded, and no later than loop time ``deadline`` if given) until Redis
        confirmed both.

        Returns False when the subscription could not be confirmed; the caller then relies
        on its PTTL fallback. Never raises for a Redis or network failure.
        """
        if channel in self._confirmed:
            return True
        limit = _SUBSCRIBE_LIMIT
        if deadline is not None:
            limit = min(limit, deadline - asyncio.get_running_loop().time())
            if limit <= 0:
                return False
        try:
            await self._ensure_reader(limit)
            if not self._healthy:
                return False
            future = self._pending.get(channel)
            if future is None:
                future = self._pending[channel] = asyncio.get_running_loop().create_future()
                stale = self._subscribed - self._lines.keys() - self._listeners.keys()
                stale.discard(channel)
                if len(stale) >= _STALE_CHANNELS:
                    self._subscribed -= stale
                    self._confirmed -= stale  # (not listening from now on)
                    self._settle(stale)  # (one whose waiter left before it was confirmed)
                    await self._command(self._unsubscribe, self._both(stale))
                self._subscribed.add(channel)
                await self._command(self._subscribe, self._both((channel,)))
            async with asyncio.timeout(limit):
                return await asyncio.shield(future)
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("subscription to %s not confirmed: %r", channel, exc)
            self._settle((channel,))  # (the next subscribe sends it again)
            return False

    async def _command(self, command: str, names: list[str]) -> None:
        """Send SUBSCRIBE or UNSUBSCRIBE for the channels ``names``: none of them counts
        as subscribed again until the replies to every such command sent so far are in."""
        for name in names:
            self._inflight[name] = self._inflight.get(name, 0) + 1
        # Sharded, one lock's pair per command (one slot: see _both); else all in one.
        step = 2 if self._sharded else len(names)  # (never empty)
        with connection_errors():  # (a dropped connection, on some Pythons: _compat)
            for i in range(0, len(names), step):
                await self.connection.send_command(command, *names[i : i + step])

    async def _ensure_reader(self, limit: float = _SUBSCRIBE_LIMIT) -> None:
        if self._reader is not None:
            return
        async with self._starting:
            if self._reader is not None:
                return
            connection = self._connection_class(**self._settings)
            try:
                async with asyncio.timeout(limit):
                    await connection.connect()
            except BaseException:
                with contextlib.suppress(Exception):
                    await close_fully(connection.disconnect())
                raise
            self.connection = connection
            self._healthy = True
            self._reader = asyncio.get_running_loop().create_task(
                self._read(), name="asynclock-wakeup"
            )

    async def _read(self) -> None:
        backoff = 0.05
        loop = asyncio.get_running_loop()
        pinged = False
        while True:
            try:
                with connection_errors():  # (a dropped connection: _compat)
                    if not self._healthy:
                        await self.connection.connect()
                        pinged = False
                        if self._subscribed:
                            await self._command(self._subscribe, self._both(self._subscribed))
                        self._healthy = True
                    reply = await self.connection.read_response(timeout=_HEARTBEAT)
                    if reply is None:  # silence for _HEARTBEAT seconds
                        if pinged:
                            raise RedisConnectionError("the subscription did not answer a PING")
                        if self._lines or self._listeners:  # (else silence is fine)
                            await self.connection.send_command("PING")
                            pinged = True
                        continue
                    self._heard = loop.time()
                    pinged = False
                    backoff = 0.05
            except ResponseError as exc:
                # A refused (S)SUBSCRIBE: on a cluster node, MOVED for a slot that moved
                # away. The connection is fine; its waiters fall back on the holder's
                # time left, and their next attempt finds the slot's new owner.
                if is_refusal(exc):  # (by the ACL: a configuration error, said aloud)
                    what = "a wake-up subscription (waiters wait for the holder's time left)"
                    log.warning("%s", explain(exc, what))
                else:
                    log.debug("a subscription was refused: %r", exc)
                self._heard = loop.time()
                self._forget_unconfirmed()
            except (RedisError, OSError) as exc:
                log.debug("wake-up subscription broken: %r", exc)
                self._healthy = False
                self._unsubscribed()
                # A release may have been missed: let every head and listener try.
                for channel in [*self._lines, *self._listeners]:
                    self.wake(channel)
                with contextlib.suppress(Exception):
                    await self.connection.disconnect()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            else:
                if self._dispatch(reply):
                    # A waiter was woken (a grant, a release): let it run before this task
                    # reads on, the handoff waits for it, not for the next read to be armed.
                    await asyncio.sleep(0)

    def _forget_unconfirmed(self) -> None:
        """A subscription was refused, and the refusal does not say which: every channel
        not confirmed yet counts as not subscribed (its waiter is told so, and a later
        subscribe sends it again); those confirmed stay."""
        for channel in self._subscribed - self._confirmed:
            self._subscribed.discard(channel)
            for name in self._both((channel,)):
                self._inflight.pop(name, None)
        self._settle([channel for channel in self._pending if channel not in self._confirmed])

    def _settle(self, channels: Iterable[str], confirmed: bool = False) -> None:
        """Tell whoever waits for the subscription of ``channels`` whether it is
        ``confirmed`` (if not, a later subscribe sends it again)."""
        for channel in list(channels):
            future = self._pending.pop(channel, None)
            if future is not None and not future.done():
                future.set_result(confirmed)

    def _unsubscribed(self) -> None:
        """The subscription's connection broke or is closed: no channel is confirmed."""
        self._settle(self._pending)
        self._inflight.clear()
        self._confirmed.clear()

    def _both(self, channels: Iterable[str]) -> list[str]:
        """The channels to subscribe to for locks' ``channels``: each, and our grants'."""
        return [name for channel in channels for name in (channel, channel + self._grants)]

    def _dispatch(self, reply: object) -> bool:
        """Act on one message of the subscription; returns whether it was a grant or
        another client's release (a waiter may have been woken)."""
        if not isinstance(reply, list) or len(reply) < 2:
            return False
        kind, raw_channel = reply[0], reply[1]
        if not isinstance(raw_channel, bytes):  # (RESP2 bytes: see __init__)
            return False
        name = raw_channel.decode(*self._encoding)
        grant = name.endswith(self._grants)  # (a lock's channel ends in "}:released")
        channel = name[: -len(self._grants)] if grant else name
        if kind == b"message" or kind == b"smessage":
            payload = reply[2] if len(reply) > 2 else b""
            if grant:
                self._granted(channel, payload)
                return True
            if payload != self._origin_bytes:  # (our own: woken already)
                timer = self._deferred.pop(channel, None)
                if timer is not None:
                    timer.cancel()
                self.wake(channel)
                return True
        elif kind in _SUBSCRIPTION_REPLIES:
            unsubscribed = kind == b"unsubscribe" or kind == b"sunsubscribe"
            left = self._inflight.pop(name, 0) - 1
            if left > 0:  # a later command for it is not answered yet
                self._inflight[name] = left
            elif unsubscribed:
                self._confirmed.discard(channel)
                if left < 0:  # not asked for: the server dropped it (its slot moved)
                    self._subscribed.discard(channel)
                    self.wake(channel)  # (its waiters try now, and find the new owner)
                    return True
            else:  # subscribed, if its last command, and its grants', were so and are answered
                answered = self._inflight.keys().isdisjoint(self._both((channel,)))
                if answered and channel in self._subscribed:
                    self._confirmed.add(channel)
                    self._settle((channel,), True)
        return False

    def _granted(self, channel: str, payload: bytes) -> None:
        """A releaser granted the lock to a waiter of ours (see ``HANDOFF``), published on
        our grant channel for the lock as
        "<releaser>:<client>:<token>:<fencing token>:<that client's loop time>"."""
        try:
            _, origin, raw_token, raw_fence, raw_time = payload.split(b":")
            if origin != self._origin_bytes:
                return
            token, fence, t_offer = raw_token.decode(), int(raw_fence), float(raw_time)
        except ValueError:
            log.debug("unexpected message on %s: %r", channel, payload)
            return
        # (The releaser dropped our registration, but an attempt of ours may have written
        # a new one since, its reply read before this: ``_registered`` stays as it is, a
        # "may be registered" that costs at most one needless unregister.)
        for waiter in self._lines.get(channel, ()):
            if waiter.token == token:
                waiter.grant = (fence, t_offer)
                waiter.event.set()
                return
        if token in self.in_use:
            # Not waiting any more, but its acquire goes on or its lease is held: its own
            # attempt found the key granted to it (and took it, same fencing token).
            return
        # Nobody of ours waits with that token or holds a lease with it: give it back.
        self.give_back(channel, token)

    def give_back(self, channel: str, token: str) -> None:
        """In the background, give back the key of the lock on ``channel`` granted or
        handed to ``token``, a waiter of ours that is gone (``on_orphan``)."""
        if self.on_orphan is not None:
            self.in_background(self.on_orphan(channel, token))

    async def _cancel_background(self, tasks: Iterable[asyncio.Task[object]] | None = None) -> None:
        """Cancel ``tasks`` (by default all background work) and wait for them to end."""
        for task in list(self._background if tasks is None else tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def forget(self) -> None:
        """This room's loop has closed: drop its subscription connection without that
        loop (see ``_leftovers``)."""
        connection, self.connection = self.connection, None
        self._reader = None
        if connection is not None:
            forget_connection(connection)

    async def aclose(self) -> None:
        """Stop listening and close the subscription connection, unless a waiter came
        meanwhile (the last lease of a client closes the room in the task leaving it,
        while other tasks may start waiting).

        The room's state is reset before the old reader and connection are awaited: a
        waiter arriving while they close subscribes afresh, on a new connection, and
        nothing of its state is cleared under it.
        """
        await self._cancel_background()  # (first: a subscribe among them would reopen)
        if self._lines or self._listeners:
            return  # a waiter came while the background work ended: keep listening
        reader, self._reader = self._reader, None
        connection, self.connection = self.connection, None
        self._unsubscribed()  # (a background subscribe's pending future, cancelled)
        self._subscribed.clear()
        for timer in self._deferred.values():
            timer.cancel()
        self._deferred.clear()
        self._registered.clear()
        self._healthy = False
        if reader is not None:
            # (and work that a grant read by the old reader started since: not a newcomer's)
            await self._cancel_background([reader, *self._background])
        if connection is not None:
            with contextlib.suppress(Exception):
                await close_fully(connection.disconnect())
