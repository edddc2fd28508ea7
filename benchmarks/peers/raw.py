"""The round-trip limit: raw redis-py asyncio, ``SET NX PX`` + an owner-checked delete.

No waiting (a busy lock raises), no renewal: the least a correct lease can cost.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import ClassVar

from redis.asyncio import Redis

from .base import CONTEND, HOLD, LOCK_TTL, AsyncPeer, AsyncSession

DELETE_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Busy(RuntimeError):
    """The raw client does not wait: the lock was held."""


class RawPeer(AsyncPeer):
    key = "raw"
    label = "raw SET NX PX + EVALSHA"
    dist = None
    config = (
        f"`SET key token NX PX {int(LOCK_TTL * 1000)}`, then `EVALSHA` of a compare-and-DEL "
        "script; no waiting, no renewal"
    )
    unsupported: ClassVar[dict[str, str]] = {
        CONTEND: "no waiting: it is the round-trip floor of one acquire + release",
        HOLD: "no renewal (see the pipelined renewer for the renewal floor)",
    }

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        client = Redis.from_url(url, max_connections=max_connections)
        sha = await client.script_load(DELETE_IF_OWNER)
        return _Session(client, sha)


class _Session(AsyncSession):
    def __init__(self, client: Redis, sha: str) -> None:
        self.client = client
        self.sha = sha
        self.ttl_ms = int(LOCK_TTL * 1000)

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        return self._lock(name)

    @asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[object]:
        token = secrets.token_hex(16)
        if not await self.client.set(name, token, nx=True, px=self.ttl_ms):
            raise Busy(name)
        try:
            yield token
        finally:
            await self.client.evalsha(self.sha, 1, name, token)

    async def aclose(self) -> None:
        await self.client.aclose()
