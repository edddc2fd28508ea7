"""asynclock.fastapi: a dependency holding a lease for the request, through a real FastAPI
app and httpx's ASGI transport (issue 30)."""

# (no "from __future__ import annotations": FastAPI reads the endpoints' annotations at
# run time, and a Depends() naming a local of make_app() must not be a string)

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import pytest
from redis.asyncio import Redis

import asynclock
from asynclock.testing import ServerInfo

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi import Depends, FastAPI  # noqa: E402

from asynclock.fastapi import held_lease  # noqa: E402


class Probe:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.finished = 0


def make_app(url: str, prefix: str, probe: Probe, **options: object) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.redis = Redis.from_url(url)
        yield
        await app.state.redis.aclose()

    app = FastAPI(lifespan=lifespan)
    dependency = held_lease(
        lambda: app.state.redis, "sync:{account_id}", ttl=0.3, prefix=prefix, **options
    )

    @app.post("/accounts/{account_id}/sync")
    async def sync(
        account_id: int, lease: Annotated[asynclock.Lease, Depends(dependency)]
    ) -> dict[str, int]:
        probe.entered.set()
        try:
            await probe.release.wait()
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        probe.finished += 1
        return {"account": account_id, "token": lease.fencing_token}

    return app


@asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


async def test_busy_answers_409_and_the_lease_is_given_back(
    redis_server: ServerInfo, redis: Redis, prefix: str
) -> None:
    probe = Probe()
    app = make_app(redis_server.url, prefix, probe)
    async with serve(app) as http:
        first = asyncio.create_task(http.post("/accounts/7/sync"))
        await probe.entered.wait()
        busy = await http.post("/accounts/7/sync")
        assert busy.status_code == 409
        assert 1 <= int(busy.headers["retry-after"]) <= 1  # (ttl 0.3 s, rounded up)
        other = asyncio.create_task(http.post("/accounts/8/sync"))  # (another key)
        await asyncio.sleep(0.05)
        probe.release.set()
        done = await first
        assert done.status_code == 200
        assert done.json()["account"] == 7
        assert (await other).status_code == 200
    assert probe.finished == 2
    assert await redis.exists(f"{prefix}{{sync:7}}", f"{prefix}{{sync:8}}") == 0


async def test_wait_policy_waits(redis_server: ServerInfo, prefix: str) -> None:
    probe = Probe()
    app = make_app(redis_server.url, prefix, probe, busy="wait")
    async with serve(app) as http:
        first = asyncio.create_task(http.post("/accounts/1/sync"))
        await probe.entered.wait()
        second = asyncio.create_task(http.post("/accounts/1/sync"))
        await asyncio.sleep(0.2)
        assert not second.done()
        probe.release.set()
        answers = await asyncio.gather(first, second)
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[1].json()["token"] > answers[0].json()["token"]


async def test_a_lost_lease_cancels_the_endpoint_and_answers_503(
    redis_server: ServerInfo, redis: Redis, prefix: str
) -> None:
    probe = Probe()
    app = make_app(redis_server.url, prefix, probe)
    async with serve(app) as http:
        request = asyncio.create_task(http.post("/accounts/3/sync"))
        await probe.entered.wait()
        assert await redis.delete(f"{prefix}{{sync:3}}") == 1  # (taken away mid-request)
        answer = await asyncio.wait_for(request, 5)
    assert answer.status_code == 503
    assert "lost" in answer.json()["detail"]
    assert probe.cancelled.is_set()
    assert probe.finished == 0


def test_bad_options_are_refused_when_made() -> None:
    with pytest.raises(ValueError, match="ttl must be positive"):
        held_lease(lambda: None, "k", ttl=0)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="busy must be"):
        held_lease(lambda: None, "k", busy="skip")  # type: ignore[arg-type,return-value]
