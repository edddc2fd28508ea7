"""What a held lease of each kind renews and releases: its keys and its scripts.

Design note. Every kind holds one key or member per holder (the lock's own key, a
semaphore's permit key, a shared lease's member of the readers' set or, alone, the lock's
key), so renewal, loss and release are the same code for all of them
(``_lifecycle._lease``, ``_session._watchdog``, ``_lifecycle._release``); what
differs is only which keys a renewal and a release touch beside the holder's own, and
with which script. A ``Hold`` says it, made by the kind when it grants the lease: the
lease and the watchdog ask it, and never branch on the kind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .._base._options import LeaseOptions
from .._redis._scripts import (
    IS_OURS,
    PERMIT_RELEASE,
    PERMIT_RENEW,
    PERMIT_RENEW_HEAD,
    RELEASE,
    RENEW,
    RENEW_HEAD,
    SHARED_IS_OURS,
    SHARED_RELEASE,
    SHARED_RENEW,
    SHARED_RENEW_HEAD,
    Script,
)

__all__ = ["Hold", "of_lock", "of_permit", "of_reader"]


@dataclass(slots=True)
class Hold:
    """A held lease's keys and scripts.

    ``options`` are the held lease's (its ``key``: the lock's, a permit's, or for a
    reader the readers' set that holds its member); ``keys`` the keys its renewal and
    its release touch, its own key first, in the scripts' order; ``renew`` renews them
    (``renew_head``: its packed ``EVALSHA`` up to the first key, shared by every lease
    of the kind); ``release`` gives the lease back (its arguments: our value, the lock's
    channel, our origin, and the milliseconds to keep the key for ``hold_at_least``, if
    any); ``hands_over``: a release may hand the key to the next waiter of its client
    (HANDOFF: a plain lock's, not a fair one's); ``plain``: its renewal is RENEW, an
    owner-checked ``PEXPIRE`` of its one key, which a server that has ``SET ... IFEQ``
    does as one command (``_redis._scripts.SET_IF_EQUAL_HEAD``);
    ``verify`` reads whether it is still ours (``is_held(verify=True)``) with ``keys``
    and our value (by default a ``GET`` of its own key compared with our value).
    """

    options: LeaseOptions
    keys: tuple[str, ...]
    renew: Script
    renew_head: bytes
    release: Script
    hands_over: bool = False
    verify: Script = IS_OURS
    plain: bool = False


def of_lock(options: LeaseOptions) -> Hold:
    """A lease of the lock's own key (a mutex, a fair lock, a job of ``once()``)."""
    return Hold(options, (options.key,), RENEW, RENEW_HEAD, RELEASE, not options.fair, plain=True)


def of_permit(options: LeaseOptions, slot: int) -> Hold:
    """A semaphore's permit ``slot``: its key, its slot in the semaphore's index, and the
    limit (kept as long as the permit)."""
    permit = options.permit(slot)
    keys = (permit.key, options.permits_key, options.limit_key)
    return Hold(permit, keys, PERMIT_RENEW, PERMIT_RENEW_HEAD, PERMIT_RELEASE)


def of_reader(options: LeaseOptions, token: str) -> Hold:
    """A shared lease: its member of the readers' set, and the lock's key (the shared
    marker)."""
    reader = replace(options, reader=token)  # (its key: the readers' set)
    keys = (options.readers_key, options.base_key)
    return Hold(
        reader, keys, SHARED_RENEW, SHARED_RENEW_HEAD, SHARED_RELEASE, verify=SHARED_IS_OURS
    )
