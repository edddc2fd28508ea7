"""The locks under test, each behind the interface of ``base``."""

from __future__ import annotations

from .aioredlock_peer import AioredlockPeer
from .asynclock_acquire_peer import AsynclockAcquirePeer
from .asynclock_kinds_peer import AsynclockSemaphorePeer, AsynclockSharedPeer
from .asynclock_peer import AsynclockPeer
from .base import (
    BURST,
    CONTEND,
    CYCLE,
    FAMILIES,
    HOLD,
    LOCK_TTL,
    AsyncPeer,
    AsyncSession,
    Holding,
    Peer,
    SyncSession,
    ThreadPeer,
)
from .pipelined import PipelinedPeer
from .pottery_peer import PotteryPeer
from .raw import RawPeer
from .redis_lock_peer import RedisLockPeer
from .redispy import RedisPyLockFastPeer, RedisPyLockPeer

__all__ = [
    "ALL_PEERS",
    "BURST",
    "CONTEND",
    "CYCLE",
    "FAMILIES",
    "HOLD",
    "LOCK_TTL",
    "AsyncPeer",
    "AsyncSession",
    "Holding",
    "Peer",
    "SyncSession",
    "ThreadPeer",
    "get_peer",
]

#: Every peer, in the order of the tables: asynclock first (its `async with` form, then its
#: `acquire()` form, then its semaphore and shared lease in the hand-over scenarios), then
#: the baselines.
ALL_PEERS: tuple[type[Peer], ...] = (
    AsynclockPeer,
    AsynclockAcquirePeer,
    AsynclockSemaphorePeer,
    AsynclockSharedPeer,
    RawPeer,
    RedisPyLockPeer,
    RedisPyLockFastPeer,
    PotteryPeer,
    RedisLockPeer,
    AioredlockPeer,
    PipelinedPeer,
)


def get_peer(key: str) -> Peer:
    """A new instance of the peer called ``key``."""
    for cls in ALL_PEERS:
        if cls.key == key:
            return cls()
    raise KeyError(f"unknown peer {key!r}; known: {', '.join(c.key for c in ALL_PEERS)}")
