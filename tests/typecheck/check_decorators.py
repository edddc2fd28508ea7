"""Type-checked use of the decorators (issue 30): mypy runs this in ./dev lint."""

from __future__ import annotations

from typing import Any, assert_type

from redis.asyncio import Redis

import asynclock


def decorated(redis: Redis) -> None:
    @asynclock.exclusive(redis, "sync:{user_id}", ttl=20, max_hold=60)
    async def sync(user_id: int) -> str:
        return str(user_id)

    @asynclock.exclusive(lambda: redis, "sync:{user_id}", busy="skip")
    async def maybe(user_id: int) -> str:
        return str(user_id)

    @asynclock.exclusive(asynclock.client_from("ctx[redis]"), "job:{n}", busy="raise")
    async def job(ctx: dict[str, Any], n: int) -> int:
        return n

    @asynclock.idempotent(lambda: redis, key="charge:{order_id}")
    async def charge(order_id: int) -> float:
        return 1.5

    async def use() -> None:
        assert_type(await sync(1), str)
        assert_type(await maybe(1), str | None)
        assert_type(await job({}, 2), int)
        assert_type(await charge(3), float)
        await asynclock.once(redis, "charge:{order_id}", charge, 3)

    del use


def refused(redis: Redis) -> None:
    asynclock.exclusive(redis, "k", colour="red")  # type: ignore[call-overload]
    asynclock.exclusive(redis, "k", ttl="10")  # type: ignore[call-overload]
    asynclock.exclusive(redis, "k", busy="sometimes")  # type: ignore[call-overload]
