"""The FastAPI app that tests/test_uvicorn.py serves with ``uvicorn --workers 2``.

Configured by the environment: ``UVICORN_TEST_URL`` (the server), ``UVICORN_TEST_PREFIX``
(the test's key prefix) and ``UVICORN_TEST_DIR`` (where a cancelled endpoint leaves a
file). ``/sync`` ends its lease before the response is sent (``scope="function"``),
``/queue`` after it (FastAPI's default). Every response names the worker process that
made it (``X-Worker``: its pid).

An endpoint pushes ``"<pid> <token>"`` to ``<prefix>entered:<account>`` once it runs
under its lease, then waits (30 s at most) for an element of ``<prefix>release:<account>``;
cancelled (its lease lost), it writes ``cancelled-<account>`` (its pid) in the directory.
"""

# (no "from __future__ import annotations": FastAPI reads the endpoints' annotations)

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, Request, Response
from redis.asyncio import Redis

import asynclock
from asynclock.fastapi import held_lease

URL = os.environ["UVICORN_TEST_URL"]
PREFIX = os.environ["UVICORN_TEST_PREFIX"]
RECORDS = Path(os.environ["UVICORN_TEST_DIR"])
PID = str(os.getpid())


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.redis = Redis.from_url(URL)
    yield
    await app.state.redis.aclose()


app = FastAPI(lifespan=lifespan)


@app.middleware("http")
async def name_the_worker(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    response = await call_next(request)
    response.headers["X-Worker"] = PID
    return response


def _redis() -> Redis:
    client: Redis = app.state.redis
    return client


raising = held_lease(_redis, "sync:{account}", ttl=0.5, prefix=PREFIX)
waiting = held_lease(_redis, "sync:{account}", ttl=0.5, prefix=PREFIX, busy="wait")


async def _work(account: int, lease: asynclock.Lease) -> dict[str, int]:
    redis = _redis()
    await redis.rpush(f"{PREFIX}entered:{account}", f"{PID} {lease.fencing_token}")
    try:
        await redis.blpop([f"{PREFIX}release:{account}"], timeout=30)
    except asyncio.CancelledError:
        (RECORDS / f"cancelled-{account}").write_text(PID)
        raise
    return {"account": account, "token": lease.fencing_token, "worker": int(PID)}


@app.post("/accounts/{account}/sync")
async def sync(
    account: int, lease: Annotated[asynclock.Lease, Depends(raising, scope="function")]
) -> dict[str, int]:
    return await _work(account, lease)


@app.post("/accounts/{account}/queue")
async def queue(
    account: int, lease: Annotated[asynclock.Lease, Depends(waiting)]
) -> dict[str, int]:
    return await _work(account, lease)
