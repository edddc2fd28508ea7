"""What every scenario gets, and how a peer's session is opened around a measurement."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import redis

from ..config import Profile
from ..peers import AsyncPeer, AsyncSession, Peer, SyncSession, ThreadPeer

__all__ = ["Context", "Measurement", "in_session"]

T = TypeVar("T")


@dataclass
class Measurement:
    """The figures of one scenario for one peer in one run."""

    metrics: dict[str, float]
    note: str = ""


@dataclass
class Context:
    """One run against the private server."""

    url: str
    profile: Profile
    run: int
    probe: redis.Redis = field(repr=False)  # the harness's own client (INFO, FLUSHALL)

    def name(self, peer: Peer, scenario: str) -> str:
        """A lock name used by nobody else in the whole benchmark."""
        return f"bench:{self.run}:{scenario}:{peer.key}"

    def connected_clients(self) -> int:
        return int(self.probe.info("clients")["connected_clients"])

    def reset(self) -> None:
        """Empty the server between measurements (scripts stay cached)."""
        self.probe.flushall()


def in_session(
    peer: Peer,
    url: str,
    run_async: Callable[[AsyncSession], Awaitable[T]],
    run_threads: Callable[[SyncSession], T],
    max_connections: int | None = None,
) -> T:
    """Open a session of ``peer`` (in a fresh event loop for asyncio peers), run the
    measurement in it, and close it."""
    if isinstance(peer, AsyncPeer):

        async def main() -> T:
            session = await peer.open(url, max_connections=max_connections)
            try:
                return await run_async(session)
            finally:
                await session.aclose()

        return asyncio.run(main())
    if isinstance(peer, ThreadPeer):
        session = peer.open(url, max_connections=max_connections)
        try:
            return run_threads(session)
        finally:
            session.close()
    raise TypeError(f"{peer!r} is neither an AsyncPeer nor a ThreadPeer")
