"""Giving a lease back: the owner-checked release, or a handoff to this client's next waiter.

Design note. The release runs shielded from cancellation and every exchange ends within
``release_timeout`` (see ``_shield.finish_idempotent``): a dead Redis never hangs an exit,
the key then expires by its TTL. Within that bound, a release whose outcome is unknown is
sent again until Redis answers (``_send``), so a connection reset for a moment does not
leave the key to its TTL. With a waiter in this client's line the HANDOFF script
gives it the key in the same round trip (see ``_wakeup``), and the releaser lets the new
holder run before it goes on (``after_release``). A release's "not ours" answer
is a proven loss only when it is the first attempt's and arrived before ``safe_until``
(see ``_send_release``); anything else proves nothing and is not reported as a loss.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final, Protocol

from redis.exceptions import MaxConnectionsError

from .._base._events import LeaseEventKind
from .._base._exceptions import LossReason
from .._base._options import LeaseOptions
from .._base._shield import finish, finish_idempotent
from .._kinds._hold import Hold
from .._kinds._mutex import Handoff, handoff_call, read_handoff, unregister
from .._redis._lane import not_sent
from .._redis._scripts import STORE, UNKNOWN_OUTCOME, Arg, Script, persisting
from .._session._connections import Companion
from .._session._wakeup import Waiter

__all__ = ["Held", "Wake", "after_release", "let_go", "release", "release_storing", "unretain"]

log = logging.getLogger("asynclock")

_CLOSE_LIMIT: Final = 1.0  # seconds allowed to close idle side connections


class Held(Protocol):
    """A lease as its release sees it (``_lease.Tenure`` is one): read here, changed only
    by asking it (``end``, ``lose``, ``event``, ``follow``). Loop times in seconds."""

    @property
    def token(self) -> str: ...
    @property
    def deadline(self) -> float: ...  # the safe deadline (``Lease.safe_until``)
    @property
    def lost_reason(self) -> LossReason | None: ...
    @property
    def companion(self) -> Companion: ...
    @property
    def options(self) -> LeaseOptions: ...
    @property
    def hold(self) -> Hold: ...  # its keys and scripts (see _kinds._hold)
    @property
    def keep_until(self) -> float | None: ...  # hold_at_least: keep the key until then
    @property
    def asking(self) -> bool: ...  # (its slot migrates to its node: see Tenure.moved)

    def owner(self) -> str: ...
    async def on_its_node(self, send: Callable[[Companion], Awaitable[object]]) -> object: ...
    def event(self, kind: LeaseEventKind, detail: str = "") -> None: ...
    def lose(self, reason: LossReason, cause: BaseException | None = None) -> None: ...
    def end(self) -> None: ...


class Wake(enum.Enum):
    """Whom to wake once a lease was given back (see ``after_release``)."""

    OURS = "ours"  # the head of this client's line, if any
    OTHERS = "others"  # other clients' waiters compete, or one was granted the key:
    # ours stands back a moment, then tries (and so learns how long to wait)
    HANDED = "handed"  # the head of this client's line was handed the key (and woken):
    # the releaser lets it run first (see after_release)


async def release(held: Held, *, shielded: bool = False) -> Wake:
    """Stop renewing and release the key (shielded, unless the caller is: ``shielded``;
    every exchange ends within release_timeout), hand it to the next waiter of this
    client's line, or grant it to a waiter of another client. Returns whom to wake
    (see ``after_release``).

    A renewal of this lease may still be in flight in a batch with other leases'; it
    is not waited for: the renew script is owner-checked, so landing after the
    release it changes nothing, and its reply is ignored once the lease is closing.
    """
    if held.lost_reason is LossReason.NOT_OWNER:
        return Wake.OURS  # the key is known not to be ours
    channel = held.options.channel
    room = held.companion.room
    # The next waiter in this client's line, if any, is handed the key directly.
    successor = room.head(channel)
    if successor is not None and (
        successor.offered or successor.grant is not None or not held.hold.hands_over
    ):
        successor = None  # (only a plain lock's lease is handed over: see _kinds._hold)
    t_offer = held.companion.loop.time()
    keep_ms = 0  # (hold_at_least: the key is kept this long rather than deleted)
    keep_until = held.keep_until
    if keep_until is not None and keep_until > t_offer:
        keep_ms = math.ceil((keep_until - t_offer) * 1000)
        successor = None  # (nobody takes it before then)
    behind: Waiter | None = None
    if successor is not None:
        successor.offered = True  # from now on the key may hold its token
        # HANDOFF may register us, offering the successor's token to other clients, or
        # that of the waiter behind it; replies refine the registration
        successor.exposed = True
        behind = room.second(channel)  # (fixed here: it is the one HANDOFF may offer)
        if behind is not None:
            behind.exposed = True
            room.in_use.add(behind.token)
        room.in_use.add(successor.token)
        room.set_registered(channel, True)
    limit = held.options.release_timeout
    release = partial(
        _send_release,
        held,
        keep_ms=keep_ms,
        successor=successor,
        behind=behind,
        t_offer=t_offer,
        deadline=t_offer + limit,
    )
    try:
        released = await finish_idempotent(release, limit, shield=not shielded)
    except Exception as exc:
        _not_done(held, exc, "release of %r did not complete (%r); its key expires by its TTL")
        return Wake.OURS
    if released is _NotOurs.NOT_OURS:
        held.lose(LossReason.NOT_OWNER)  # the key vanished, the watchdog unaware
    elif released is not None:
        held.event(LeaseEventKind.RELEASED)
    if successor is not None and not room.waiting(channel) and room.registered(channel):
        room.in_background(unregister(held.companion, held.options))  # line emptied
    return released if isinstance(released, Wake) else Wake.OURS


async def release_storing(held: Held, keys: list[str], args: list[Arg]) -> bool | None:
    """Stop renewing a lease of ``once()`` and, in one owner-checked step, store its job's
    result and delete its key (the STORE script: ``keys``, and ``args`` after the
    lease's value), shielded, every exchange within ``release_timeout``. No waiter is
    handed the key: a release's notification wakes them, to find the result.

    Returns True if stored; False if the key was not ours (a loss, if that answer proves
    one: see ``_release``); None if unknown (Redis did not answer: logged, the key expires
    by its TTL, and a duplicate may then run the job again).
    """
    companion = held.companion
    options = held.options
    limit = options.release_timeout
    deadline = companion.loop.time() + limit
    full = [held.owner(), *args, options.channel, companion.room.origin]

    async def store(*, first: bool) -> tuple[object, bool]:
        reply, definitive = await _send(held, STORE, keys, lambda: full, deadline)
        return reply, first and definitive

    try:
        reply, first = await finish_idempotent(store, limit)
    except Exception as exc:
        _not_done(
            held,
            exc,
            "the result of %r may not have been stored (%r); its lease expires "
            "by its TTL, after which a duplicate may run the job again",
        )
        return None
    if reply == 1:
        held.event(LeaseEventKind.RELEASED)
        return True
    if not first:
        return None  # (the first run may have stored it, and deleted the key)
    if _proves_loss(held, first):
        held.lose(LossReason.NOT_OWNER)
    return False


def _not_done(held: Held, exc: Exception, warning: str) -> None:
    """A release did not complete (``exc``): ``warning`` logged (with the lease's name and
    ``exc``), ``release_failed`` reported. The key expires by its TTL."""
    log.warning(warning, held.options.name, exc)
    held.event(LeaseEventKind.RELEASE_FAILED, repr(exc))


class _NotOurs(enum.Enum):
    """A release's answer that proves the key was not ours (see ``_send_release``)."""

    NOT_OURS = "not ours"


async def _send_release(
    held: Held,
    *,
    first: bool,
    keep_ms: int,
    successor: Waiter | None,
    behind: Waiter | None,
    t_offer: float,
    deadline: float,
) -> Wake | _NotOurs | None:
    """Release ``held``. Returns whom to wake once it is released (OURS: deleted, waiters
    notified; HANDED: handed to our next waiter, woken; OTHERS: granted to a waiter of
    another client, or deleted with waiters of other clients registered). Returns
    NOT_OURS if Redis answered that the key was not ours while we still believed we held
    it (the work may have overlapped another holder); None if that answer proves nothing:
    a retry after a lost reply (the first attempt may have released the key), or a reply
    that arrived at or after the safe deadline. Redis ran the script at some moment before
    its reply arrived, and the key cannot expire by its TTL before ``safe_until``; so only
    a reply received before ``safe_until`` proves the key went early. One sent earlier but
    answered later may have found the key expired by its TTL after the block had finished
    in time, which is no loss.

    With a ``successor`` (the head of this client's line for the lock) the HANDOFF script
    gives it the key in the same round trip unless a waiter of another client is
    registered; the successor's lease counts from ``t_offer``, taken before the first send.
    Every exchange ends by ``deadline`` (loop time) or raises ``TimeoutError``. With
    ``keep_ms`` (hold_at_least), the key is kept that long instead of deleted (until
    ``held.keep_until``, as of each send). ``first``:
    False for a run that repeats one a native cancellation interrupted (not definitive).
    """
    companion = held.companion
    options = held.options
    room = companion.room
    hold = held.hold
    args: Callable[[], list[Arg]]
    if successor is None:
        script = hold.release
        keys = list(hold.keys)
        base: list[Arg] = [held.owner(), options.channel, room.origin]
        keep_until = held.keep_until if keep_ms else None

        def args() -> list[Arg]:
            # (hold_at_least: kept until keep_until, counted at each send, so that a resend
            # landing late keeps it no longer; past it, the key is deleted)
            if keep_until is None:
                return base
            left_ms = math.ceil((keep_until - companion.loop.time()) * 1000)
            return [*base, left_ms] if left_ms > 0 else base

        retrying: Callable[[], None] | None = None
    else:
        request = handoff_call(
            options,
            held.owner(),
            successor,
            behind,
            room.origin,
            room.listening(options.channel),
            t_offer,
        )
        script, keys, handoff_args = request.script, list(request.keys), request.args

        def args() -> list[Arg]:
            return handoff_args  # (the same at every send)

        # (on a retry: the first run may have registered us as waiting)
        retrying = partial(room.set_registered, options.channel, True)
    reply, definitive = await _send(held, script, keys, args, deadline, retrying)
    first = first and definitive
    if successor is None:
        if reply == 1:
            return Wake.OURS
        return _NotOurs.NOT_OURS if _proves_loss(held, first) else None
    answer, fence = read_handoff(reply)
    if answer is Handoff.ALREADY and first:
        # The next holder took the key by an attempt of its own: ours was gone before the
        # release (its own reply tells it so; it is only woken here).
        successor.event.set()
        return _NotOurs.NOT_OURS if _proves_loss(held, first) else None
    if answer in (Handoff.HANDED, Handoff.ALREADY):  # (ALREADY on a retry: ours landed)
        successor.grant = (fence, t_offer)  # the script set or renewed its expiry
        successor.event.set()
        room.set_registered(options.channel, behind is not None)
        if successor.token not in room.in_use:  # (it gave up while the release was resent)
            room.give_back(options.channel, successor.token)
        return Wake.HANDED
    successor.offered = False  # a definitive answer: the key was not handed over
    if answer in (Handoff.GRANTED, Handoff.CONTESTED):  # (granted: to another's waiter)
        room.set_registered(options.channel, True)
        return Wake.OTHERS
    if answer is Handoff.RELEASED:  # the next holder gave up; released as RELEASE does
        room.set_registered(options.channel, behind is not None)
        return Wake.OURS
    return _NotOurs.NOT_OURS if _proves_loss(held, first) else None


async def _send(
    held: Held,
    script: Script,
    keys: list[str],
    args: Callable[[], list[Arg]],
    deadline: float,
    retrying: Callable[[], None] | None = None,
) -> tuple[object, bool]:
    """Run a release's ``script`` by ``deadline`` (loop time) on the lane, or on the
    overflow pool when the caller's pool is full; answered ``MOVED`` or ``ASK``, on the
    node named (see ``Tenure.on_its_node``); ``args()``: its arguments as of each send.
    After an unknown outcome it is sent again on the overflow pool (``retrying`` called
    before each resend) until Redis answers or ``deadline`` passes (see
    ``_scripts.persisting``): a connection reset for a moment does not leave the key to
    its TTL. Returns the reply and whether it is definitive: no earlier send may have
    run (one that failed before it was sent, ``not_sent``, did not)."""

    def on_lane(companion: Companion) -> Awaitable[object]:
        return script(companion.lane, keys, args(), deadline, asking=held.asking)

    landed = False  # (an earlier send may have run)
    try:
        return await held.on_its_node(on_lane), True
    except MaxConnectionsError:  # the caller's pool is full: nothing was sent
        pass
    except UNKNOWN_OUTCOME as exc:
        log.debug("release of %r failed (%r), retrying", held.options.name, exc)
        landed = not not_sent(exc)
    overflow = held.companion.overflow()

    async def again() -> object:
        nonlocal landed
        if landed and retrying is not None:
            retrying()
        try:
            return await script(overflow, keys, args(), asking=held.asking)
        except UNKNOWN_OUTCOME as exc:
            landed = landed or not not_sent(exc)
            raise

    async with asyncio.timeout_at(deadline):
        reply = await persisting(again, f"release of {held.options.name!r}", deadline)
    return reply, not landed


def _proves_loss(held: Held, first: bool) -> bool:
    """Whether a release's answer that the key was not ours, just received, proves the key
    went early: the first attempt's, received before ``safe_until`` (see ``_send_release``)."""
    return first and held.companion.loop.time() < held.deadline


_LETTING_GO: set[asyncio.Task[None]] = set()  # see let_go()


def let_go(companion: Companion) -> None:
    """``unretain`` in the background (closing idle side connections, bounded), for a
    caller that returns at once."""
    task = companion.loop.create_task(unretain(companion), name="asynclock-unretain")
    _LETTING_GO.add(task)
    task.add_done_callback(_LETTING_GO.discard)


async def unretain(companion: Companion) -> None:
    if companion.unretain():
        try:
            await finish(companion.aclose_if_idle(), _CLOSE_LIMIT)
        except Exception as exc:
            log.debug("closing side connections failed: %r", exc)


async def after_release(held: Held, wake: Wake) -> None:
    """After ``release`` (whatever its outcome): mark the lease ended, wake the waiters
    ``wake`` says, and let go of the companion. After a hand-over it then yields once:
    the new holder (woken when the reply came) runs before the releaser goes on, so the
    key does not sit idle in its hands while the releaser, say, queues for it again;
    what the releaser does next overlaps the new holder's round trips instead."""
    held.end()
    room = held.companion.room
    if room.in_use:  # (a grant to its token from now on is given back)
        room.in_use.discard(held.token)
    if wake is Wake.OTHERS:
        room.wake_with_others(held.options.channel)
    else:
        room.wake(held.options.channel)
    await unretain(held.companion)
    if wake is Wake.HANDED:
        await asyncio.sleep(0)
