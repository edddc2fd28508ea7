"""The failover mode's servers: a primary, its replica, and the replication link between.

Design note. The replica replicates through a :class:`~asynclock.testing.FaultProxy` of
its own (the *link*), so the nemesis can make it lag: in ``HOLD`` mode the proxy stops
reading the primary's replication stream (it piles up in kernel buffers) and the
replica's acknowledgements, so a write the primary answered meanwhile is on the primary
alone, as after any moment of replication lag. A failover kills the primary
(``SIGKILL``), resets the link's connections (what it held back is never delivered),
promotes the replica (``REPLICAOF NO ONE``), and the caller repoints the workers'
proxies at it; :meth:`Replication.add_replica` then starts a fresh replica of the new
primary through the same link (a full sync) and waits until it acknowledges a write, so
the next failover has a replica again. Every server is a private
:class:`~asynclock.testing.RedisServer` without persistence. Blocking server calls run in
threads (the proxies run on the caller's loop). All times are seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from redis.asyncio import Redis

from asynclock.testing import LOOPBACK, FaultProxy, ProxyMode, RedisServer

__all__ = ["Replication"]

_SYNC_TIMEOUT: Final = 15.0  # seconds for a new replica to acknowledge a write
_SYNC_ATTEMPTS: Final = 200  # probes (each one WAITs up to _PROBE_WAIT) within that
_PROBE_WAIT: Final = 0.2  # seconds one probe's WAIT waits for the replica
_PROBE_KEY: Final = "chaos:replication-probe"  # outside asynclock's prefix: not a lease key


class Replication:
    """A primary and one replica replicating through a link proxy; see the design note.

    Use as an async context manager (servers and link are started, the first replica
    synced, and everything stopped on exit). :attr:`primary` is the server the workers
    must reach now; :attr:`replica` is None between a failover and the next
    :meth:`add_replica`.
    """

    def __init__(self, engine: str | None = None) -> None:
        self._engine = engine
        self.primary = RedisServer(engine)
        self.replica: RedisServer | None = None
        self._link: FaultProxy | None = None
        self.replicas_started = 0

    @property
    def link(self) -> FaultProxy:
        """The proxy the replica replicates through."""
        if self._link is None:
            raise RuntimeError("the replication has not been started")
        return self._link

    async def __aenter__(self) -> Replication:
        try:
            await asyncio.to_thread(self.primary.start)
            self._link = await FaultProxy(self.primary.host, self.primary.port).start()
            await self.add_replica()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the link and every server. Idempotent."""
        if self._link is not None:
            await self._link.aclose()
        for server in (self.replica, self.primary):
            if server is not None:
                await asyncio.to_thread(server.stop)

    def hold_link(self) -> None:
        """Replication lag: the link stops carrying the stream and the acknowledgements."""
        self.link.set_mode(ProxyMode.HOLD)

    async def kill_primary(self) -> None:
        """``SIGKILL`` of the primary; then the link's connections are reset, so nothing
        it held back reaches the replica, and it carries traffic again."""
        await asyncio.to_thread(self.primary.kill)
        link = self.link
        await link.reset_all()
        link.set_mode(ProxyMode.PASS)

    async def promote(self) -> RedisServer:
        """``REPLICAOF NO ONE`` on the replica, which becomes :attr:`primary` (the dead
        primary's files are deleted); returns it. Does nothing more when the primary runs.

        Raises:
            RuntimeError: the primary is dead and there is no replica to promote, or the
                replica refused.
        """
        if self.primary.is_running:
            return self.primary
        replica = self.replica
        if replica is None:
            raise RuntimeError("the primary is dead and there is no replica to promote")
        reply = await asyncio.to_thread(replica.command, "REPLICAOF", "NO", "ONE")
        if reply != b"+OK\r\n":
            raise RuntimeError(f"REPLICAOF NO ONE answered {reply!r}")
        dead, self.primary, self.replica = self.primary, replica, None
        await asyncio.to_thread(dead.stop)
        self.link.target_host, self.link.target_port = replica.host, replica.port
        return replica

    async def add_replica(self) -> RedisServer:
        """Start a fresh replica of :attr:`primary` through the link and wait (at most
        15 s) until it acknowledges a write (``WAIT 1``): it holds everything before.

        Raises:
            RuntimeError: there is a replica already, or it did not sync in time.
        """
        if self.replica is not None:
            raise RuntimeError("the primary has a replica already")
        link = self.link
        link.target_host, link.target_port = self.primary.host, self.primary.port
        replica = RedisServer(self._engine, extra_args=("--replicaof", LOOPBACK, str(link.port)))
        await asyncio.to_thread(replica.start)
        self.replica = replica
        self.replicas_started += 1
        await self._wait_synced()
        return replica

    async def _wait_synced(self) -> None:
        client = Redis.from_url(self.primary.url, socket_timeout=5.0, socket_connect_timeout=5.0)
        try:
            async with asyncio.timeout(_SYNC_TIMEOUT):
                for attempt in range(_SYNC_ATTEMPTS):
                    await client.set(_PROBE_KEY, attempt, px=60_000)
                    acked = await client.wait(1, int(_PROBE_WAIT * 1000))
                    if int(acked) >= 1:
                        await client.delete(_PROBE_KEY)
                        return
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()
        raise RuntimeError(f"the new replica did not sync within {_SYNC_TIMEOUT:g} s")
