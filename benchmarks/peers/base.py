"""The one interface every lock under test implements, so each scenario is written once.

A *peer* is a lock library configured the way a user would use it. It opens a *session*
on a Redis URL (one client, as one process of an application would have) and offers:

- ``lock(name)``: a context manager that blocks until the lock is held and releases it on
  exit. Scenarios build the uncontended cycle, the contention loops and the burst from it.
- ``hold_many(names, ttl, concurrency)``: take many leases and keep them alive with the
  peer's own renewal machinery until ``Holding.release_all()``.

Async peers run in asyncio tasks (``AsyncPeer``); blocking peers run in threads of the
same process (``ThreadPeer``). A peer that cannot take part in a scenario family says why
in ``unsupported``; the harness records the reason instead of a figure.
"""

from __future__ import annotations

import abc
import importlib.metadata
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import ClassVar

__all__ = [
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
]

#: Scenario families a peer may support.
CYCLE = "cycle"  # uncontended acquire + release, 1 and 16 workers
CONTEND = "contend"  # 8 contenders on one lock (handoffs, latency, fairness)
HOLD = "hold"  # many leases held and renewed at once
BURST = "burst"  # many leases acquired at once
FAMILIES = (CYCLE, CONTEND, HOLD, BURST)

#: TTL (seconds) of the locks in the cycle, contention and burst scenarios.
LOCK_TTL = 10.0


class Holding(abc.ABC):
    """Leases held at once by one session, renewed by the peer until released."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        """The Redis keys of the held leases (checked for existence at the end)."""
        self.failed: list[str] = []
        """Acquisitions that raised (their keys are not in ``keys``)."""

    @abc.abstractmethod
    def lost(self) -> int:
        """How many leases the peer itself reports lost so far."""

    @abc.abstractmethod
    async def release_all(self) -> None:
        """Stop renewing and release every lease."""


class AsyncSession(abc.ABC):
    """One client of an asyncio peer, in the running event loop."""

    @abc.abstractmethod
    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        """Block until ``name`` is held; release it when the block exits."""

    def lock_as(self, name: str, contender: int) -> AbstractAsyncContextManager[object]:
        """``lock(name)`` for the contender numbered ``contender`` of a hand-over
        scenario (a peer whose contenders differ, see ``Peer.reader``, overrides it)."""
        return self.lock(name)

    async def hold_many(self, names: Sequence[str], ttl: float, concurrency: int) -> Holding:
        """Acquire every name (at most ``concurrency`` at a time) and keep them renewed."""
        raise NotImplementedError

    async def warm_up(self, name: str) -> None:
        """Connect and load scripts before leases are held: one ``lock(name)`` cycle, so
        that the RSS measured around ``hold_many`` is the leases'. A peer without a lock
        API of its own overrides this."""
        async with self.lock(name):
            pass

    async def hold_tasks_only(self, names: Sequence[str], concurrency: int) -> Holding | None:
        """For a peer whose API holds each lease inside a task of the caller's: the same
        tasks as ``hold_many`` makes, each waiting in place of holding its lease (no lock
        taken), so that the report can tell the tasks' memory from the library's. None for
        a peer that holds leases without a task of the caller's."""
        return None

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the session's connections."""


class SyncSession(abc.ABC):
    """One client of a blocking peer, shared by the threads of a process."""

    @abc.abstractmethod
    def lock(self, name: str) -> AbstractContextManager[object]:
        """Block until ``name`` is held; release it when the block exits."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the session's connections."""


class Peer(abc.ABC):
    """A lock library as a user would configure it."""

    key: ClassVar[str]
    """Short identifier, used on the command line and in result files."""
    label: ClassVar[str]
    """Name shown in tables and charts."""
    dist: ClassVar[str | None]
    """The PyPI distribution whose version is reported (None: part of redis-py)."""
    config: ClassVar[str]
    """How the peer is configured, for the results."""
    unsupported: ClassVar[dict[str, str]] = {}
    """Scenario family -> why this peer does not take part in it."""
    holds_in_tasks: ClassVar[bool] = False
    """Whether each held lease needs a task of the caller's (see ``hold_tasks_only``)."""

    def probe(self) -> None:  # noqa: B027 - optional hook
        """Import the peer's package; raise if it cannot be used here."""

    def version(self) -> str:
        dist = self.dist or "redis"
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    def reader(self, contender: int) -> bool:
        """Whether the contender numbered ``contender`` of a hand-over scenario holds a
        shared (read) lease, which may overlap other readers' (never a writer's)."""
        return False

    def supports(self, family: str) -> bool:
        return family not in self.unsupported


class AsyncPeer(Peer):
    """A peer used from asyncio tasks."""

    @abc.abstractmethod
    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        """A session on ``url``, in the running event loop.

        ``max_connections`` sizes the client's connection pool (None: the library's default,
        100 for redis-py 8, which raises ``MaxConnectionsError`` when it is exhausted).
        """


class ThreadPeer(Peer):
    """A blocking peer used from threads."""

    @abc.abstractmethod
    def open(self, url: str, *, max_connections: int | None = None) -> SyncSession:
        """A session on ``url``, shared by the threads of this process (see AsyncPeer.open)."""
