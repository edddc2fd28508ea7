"""The renewal floor: one task renewing every held key in one pipeline per tick.

Keys are set with pipelined ``SET NX PX``; every ttl/3 one pipeline of compare-and-PEXPIRE
``EVALSHA`` calls (one per key, ``transaction=False``) renews all of them, and a reply other
than 1 counts the key as lost. This is what a hand-written renewer costs per renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import ClassVar

from redis.asyncio import Redis

from .base import BURST, CONTEND, CYCLE, AsyncPeer, AsyncSession, Holding

RENEW_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

DELETE_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_CHUNK = 1000  # keys per pipeline when acquiring and releasing
_ONLY_HOLD = "a renewal baseline only (no lock API of its own)"


class PipelinedPeer(AsyncPeer):
    key = "pipelined"
    label = "pipelined renewer"
    dist = None
    config = (
        "hand-written: SET NX PX per key, then one task sending every ttl/3 one pipeline "
        "of compare-and-PEXPIRE EVALSHA for all keys"
    )
    unsupported: ClassVar[dict[str, str]] = {
        CYCLE: _ONLY_HOLD,
        CONTEND: _ONLY_HOLD,
        BURST: _ONLY_HOLD,
    }

    async def open(self, url: str, *, max_connections: int | None = None) -> AsyncSession:
        return _Session(Redis.from_url(url, max_connections=max_connections))


class _Session(AsyncSession):
    def __init__(self, client: Redis) -> None:
        self.client = client

    def lock(self, name: str) -> AbstractAsyncContextManager[object]:
        raise NotImplementedError(_ONLY_HOLD)

    async def warm_up(self, name: str) -> None:
        return None  # no lock to warm up with; hold_many loads its scripts itself

    async def hold_many(self, names: Sequence[str], ttl: float, concurrency: int) -> Holding:
        holding = _Holding(self.client, names, ttl)
        await holding.start()
        return holding

    async def aclose(self) -> None:
        await self.client.aclose()


class _Holding(Holding):
    def __init__(self, client: Redis, names: Sequence[str], ttl: float) -> None:
        super().__init__(names)
        self._client = client
        self._ttl = ttl
        self._ttl_ms = int(ttl * 1000)
        self._tokens = [secrets.token_hex(16) for _ in names]
        self._lost: set[int] = set()
        self._task: asyncio.Task[None] | None = None
        self._renew_sha = ""
        self._delete_sha = ""

    async def start(self) -> None:
        self._renew_sha = await self._client.script_load(RENEW_IF_OWNER)
        self._delete_sha = await self._client.script_load(DELETE_IF_OWNER)
        for first in range(0, len(self.keys), _CHUNK):
            pipe = self._client.pipeline(transaction=False)
            for key, token in zip(
                self.keys[first : first + _CHUNK], self._tokens[first : first + _CHUNK], strict=True
            ):
                pipe.set(key, token, nx=True, px=self._ttl_ms)
            replies = await pipe.execute()
            if not all(replies):
                raise RuntimeError("pipelined renewer: a key was already held")
        self._task = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self._ttl / 3
        next_at = loop.time() + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at += interval
            pipe = self._client.pipeline(transaction=False)
            for key, token in zip(self.keys, self._tokens, strict=True):
                pipe.evalsha(self._renew_sha, 1, key, token, self._ttl_ms)
            replies = await pipe.execute(raise_on_error=False)
            for index, reply in enumerate(replies):
                if reply != 1:
                    self._lost.add(index)

    def lost(self) -> int:
        return len(self._lost)

    async def release_all(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for first in range(0, len(self.keys), _CHUNK):
            pipe = self._client.pipeline(transaction=False)
            for key, token in zip(
                self.keys[first : first + _CHUNK], self._tokens[first : first + _CHUNK], strict=True
            ):
                pipe.evalsha(self._delete_sha, 1, key, token)
            await pipe.execute()
