"""Tests of asynclock.testing (the fault-injection kit) against real servers."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from asynclock.testing import (
    FaultProxy,
    ProxyMode,
    RedisServer,
    ServerInfo,
    ServerStartError,
    available_engines,
    find_server_binary,
    resp_command,
)

ENGINES: list[str | None] = list(available_engines()) or [None]
per_engine = pytest.mark.parametrize("private_server", ENGINES, indirect=True)

MakeClient = Callable[..., aioredis.Redis]

# Generous bound for anything that is awaited rather than slept for (seconds).
BOUND = 5.0
# Socket timeout for commands expected to hang (seconds).
SHORT = 0.3


def no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


async def eventually(check: Callable[[], Awaitable[bool]], within: float = BOUND) -> None:
    """Poll *check* until it returns True, failing after *within* seconds."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {within} s")
        await asyncio.sleep(0.01)


def need_local_binary() -> None:
    if ENGINES == [None]:
        pytest.skip("needs a local redis-server or valkey-server binary")


# --------------------------------------------------------------------------- #
# Binaries and the shared server fixtures
# --------------------------------------------------------------------------- #


def test_find_server_binary_matches_available_engines() -> None:
    engines = available_engines()
    for engine, path in engines.items():
        assert find_server_binary(engine) == (engine, path)
        assert os.access(path, os.X_OK)
    if engines:
        assert find_server_binary() == next(iter(engines.items()))
    else:
        with pytest.raises(RuntimeError, match="no Redis-compatible server"):
            find_server_binary()
    with pytest.raises(ValueError, match="unknown engine"):
        find_server_binary("memcached")


async def test_shared_server_round_trip(
    redis_server: ServerInfo, redis: aioredis.Redis, prefix: str
) -> None:
    assert redis_server.url.startswith("redis://")
    assert isinstance(redis_server.engine, str)
    await redis.set(f"{prefix}k", b"v", px=60_000)
    assert await redis.get(f"{prefix}k") == b"v"


async def test_make_client_defaults_to_shared_server(
    redis_server: ServerInfo, make_client: MakeClient, prefix: str
) -> None:
    a = make_client()
    b = make_client(redis_server.url, decode_responses=True)
    await a.set(f"{prefix}k", b"v", px=60_000)
    assert await b.get(f"{prefix}k") == "v"


# --------------------------------------------------------------------------- #
# RedisServer
# --------------------------------------------------------------------------- #


@per_engine
async def test_server_starts_and_answers(
    private_server: RedisServer, make_client: MakeClient
) -> None:
    server = private_server
    assert server.host == "127.0.0.1"
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert server.pid is not None
    assert server.is_running
    assert not server.is_paused
    assert server.version[0].isdigit()
    assert server.command("PING") == b"+PONG\r\n"
    # DEBUG is enabled so tests can use DEBUG SLEEP / SET-ACTIVE-EXPIRE.
    assert server.command("DEBUG", "SLEEP", "0") == b"+OK\r\n"
    assert server.command("CONFIG", "GET", "appendonly").endswith(b"no\r\n")
    assert server.command("CONFIG", "GET", "bind").endswith(b"127.0.0.1\r\n")
    client = make_client(server.url)
    assert await client.ping() is True


def test_context_manager_stops_and_cleans_up() -> None:
    need_local_binary()
    with RedisServer() as server:
        pid = server.pid
        directory = server.directory
        assert pid is not None
        assert directory is not None
        assert directory.is_dir()
        port = server.port
    assert server.pid is None
    assert not server.is_running
    assert not directory.exists()
    with pytest.raises(ConnectionRefusedError):
        resp_command("127.0.0.1", port, "PING", timeout=0.5)
    server.stop()  # idempotent


def test_start_failure_reports_log_tail() -> None:
    need_local_binary()
    server = RedisServer(extra_args=["--no-such-option", "1"])
    try:
        with pytest.raises(ServerStartError, match=r"(?i)no-such-option|bad directive"):
            server.start()
        assert not server.is_running
    finally:
        server.stop()


@per_engine
def test_start_retries_on_a_fresh_port_when_the_port_is_taken(
    private_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asynclock.testing._servers as kit

    taken = private_server.port  # held by another server that answers PING
    ports = iter([taken, kit._free_port()])
    monkeypatch.setattr(kit, "_free_port", lambda: next(ports))
    with RedisServer(private_server.engine) as server:
        assert server.port != taken
        assert server.command("PING") == b"+PONG\r\n"


@per_engine
async def test_pause_blocks_commands_and_resume_unblocks(
    private_server: RedisServer, make_client: MakeClient
) -> None:
    client = make_client(private_server.url, socket_timeout=SHORT, retry=no_retry())
    assert await client.ping() is True
    private_server.pause()
    assert private_server.is_paused
    with pytest.raises(RedisTimeoutError):
        await client.ping()
    with pytest.raises(TimeoutError):
        private_server.command("PING", timeout=SHORT)
    private_server.resume()
    assert not private_server.is_paused
    assert await client.ping() is True


@per_engine
async def test_stop_works_while_paused(private_server: RedisServer) -> None:
    private_server.pause()
    started = time.monotonic()
    private_server.stop()
    assert time.monotonic() - started < 2.0
    assert not private_server.is_running
    assert not private_server.is_paused


@per_engine
async def test_kill_and_restart_without_persistence_loses_data(
    private_server: RedisServer, make_client: MakeClient
) -> None:
    port = private_server.port
    old_pid = private_server.pid
    assert private_server.command("SET", "k", "v") == b"+OK\r\n"
    private_server.kill()
    assert not private_server.is_running
    with pytest.raises(ConnectionRefusedError):
        private_server.command("PING", timeout=0.5)
    private_server.restart()
    assert private_server.port == port
    assert private_server.pid != old_pid
    client = make_client(private_server.url)
    assert await client.get("k") is None


@pytest.mark.parametrize("engine", ENGINES)
async def test_restart_with_persistence_keeps_data(
    engine: str | None, make_client: MakeClient
) -> None:
    need_local_binary()
    with RedisServer(engine, persistence=True) as server:
        assert server.command("CONFIG", "GET", "appendonly").endswith(b"yes\r\n")
        client = make_client(server.url, retry=no_retry())
        await client.set("k", b"v")
        server.kill()
        server.restart()
        fresh = make_client(server.url)
        assert await fresh.get("k") == b"v"
        # A graceful restart keeps it too.
        server.restart()
        assert server.command("GET", "k") == b"$1\r\nv\r\n"


@per_engine
async def test_replica_replicates(private_server: RedisServer, make_client: MakeClient) -> None:
    replica = private_server.replica()
    try:
        assert replica.port != private_server.port
        assert replica.engine == private_server.engine
        primary = make_client(private_server.url)
        secondary = make_client(replica.url)
        await primary.set("k", b"v")

        async def replicated() -> bool:
            return bool(await secondary.get("k") == b"v")

        await eventually(replicated)
        info = await secondary.info("replication")
        assert info["role"] == "slave"
        assert info["master_link_status"] == "up"
        assert int(info["master_port"]) == private_server.port
    finally:
        replica.stop()


# --------------------------------------------------------------------------- #
# FaultProxy
# --------------------------------------------------------------------------- #


@per_engine
async def test_proxy_pass_round_trips(private_server: RedisServer, make_client: MakeClient) -> None:
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        assert proxy.url == f"redis://127.0.0.1:{proxy.port}/0"
        assert proxy.port != private_server.port
        client = make_client(proxy.url)
        await client.set("k", b"x" * 100_000)
        assert await client.get("k") == b"x" * 100_000
        assert proxy.connection_count == 1
        assert proxy.accepted_count == 1
        await client.aclose()

        async def drained() -> bool:
            return proxy.connection_count == 0

        await eventually(drained)
    assert private_server.command("GET", "k").startswith(b"$100000\r\n")


@per_engine
@pytest.mark.parametrize("direction", ["upstream", "downstream", "both"])
async def test_proxy_delay_adds_latency(
    private_server: RedisServer, make_client: MakeClient, direction: Any
) -> None:
    delay = 0.15
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = make_client(proxy.url)
        assert await client.ping() is True
        proxy.set_mode(ProxyMode.DELAY, direction=direction, delay=delay)
        started = time.monotonic()
        assert await client.ping() is True
        elapsed = time.monotonic() - started
        expected = 2 * delay if direction == "both" else delay
        assert elapsed >= expected * 0.95
        assert elapsed < expected + 1.0
        proxy.set_mode(ProxyMode.PASS)
        started = time.monotonic()
        assert await client.ping() is True
        assert time.monotonic() - started < delay


@per_engine
async def test_proxy_delay_with_jitter_keeps_order(private_server: RedisServer) -> None:
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        proxy.set_mode(ProxyMode.DELAY, direction="upstream", delay=0.03, jitter=0.03)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            for i in range(10):  # ten chunks, each an inline ECHO command
                writer.write(f"ECHO {i}\r\n".encode())
                await writer.drain()
                await asyncio.sleep(0.005)  # so the proxy sees separate chunks
            expected = b"".join(f"$1\r\n{i}\r\n".encode() for i in range(10))
            got = await asyncio.wait_for(reader.readexactly(len(expected)), BOUND)
            assert got == expected
        finally:
            writer.close()
            await writer.wait_closed()


@per_engine
async def test_proxy_blackhole_times_out_then_pass_works_on_new_connection(
    private_server: RedisServer, make_client: MakeClient
) -> None:
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = make_client(proxy.url, socket_timeout=SHORT, retry=no_retry())
        assert await client.ping() is True
        proxy.set_mode(ProxyMode.BLACKHOLE)
        assert proxy.mode("upstream") is ProxyMode.BLACKHOLE
        with pytest.raises(RedisTimeoutError):
            await client.set("k", b"v")
        assert private_server.command("EXISTS", "k") == b":0\r\n"
        proxy.set_mode(ProxyMode.PASS)
        fresh = make_client(proxy.url, socket_timeout=BOUND, retry=no_retry())
        assert await fresh.ping() is True
        assert proxy.accepted_count == 2
        # The client that timed out dropped its connection and reconnects too.
        assert await client.ping() is True


@per_engine
async def test_proxy_hold_stops_reading_until_released(
    private_server: RedisServer, make_client: MakeClient
) -> None:
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = make_client(proxy.url, socket_timeout=SHORT, retry=no_retry())
        assert await client.ping() is True
        proxy.set_mode(ProxyMode.HOLD, direction="upstream")
        with pytest.raises(RedisTimeoutError):
            await client.set("k", b"v")
        assert private_server.command("EXISTS", "k") == b":0\r\n"
        proxy.set_mode(ProxyMode.PASS, direction="upstream")

        async def arrived() -> bool:
            return private_server.command("EXISTS", "k") == b":1\r\n"

        await eventually(arrived)  # held bytes are forwarded on release


@per_engine
async def test_proxy_reset_all_breaks_current_connections(
    private_server: RedisServer, make_client: MakeClient
) -> None:
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = make_client(proxy.url, retry=no_retry())
        assert await client.ping() is True
        assert proxy.connection_count == 1
        await proxy.reset_all()
        assert proxy.connection_count == 0
        with pytest.raises(RedisConnectionError):
            await client.ping()
        assert await client.ping() is True  # a new connection works
        assert proxy.accepted_count == 2


@per_engine
async def test_proxy_refuse_new(private_server: RedisServer, make_client: MakeClient) -> None:
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        existing = make_client(proxy.url, retry=no_retry())
        assert await existing.ping() is True
        proxy.refuse_new = True
        refused = make_client(proxy.url, retry=no_retry(), socket_connect_timeout=BOUND)
        with pytest.raises(RedisConnectionError):
            await refused.ping()
        assert await existing.ping() is True  # established connections carry on
        assert proxy.connection_count == 1
        proxy.refuse_new = False
        assert await refused.ping() is True
        assert proxy.connection_count == 2


@per_engine
async def test_proxy_reset_on_next_reply_loses_only_the_reply(
    private_server: RedisServer, make_client: MakeClient
) -> None:
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = make_client(proxy.url, retry=no_retry())
        assert await client.ping() is True
        proxy.reset_on_next_reply()
        assert proxy.reset_armed
        with pytest.raises(RedisConnectionError):
            await client.set("k", b"v")
        assert not proxy.reset_armed
        # The server did execute the command.
        assert private_server.command("GET", "k") == b"$1\r\nv\r\n"
        # One-shot: the next command (on a new connection) gets its reply.
        assert await client.get("k") == b"v"


@per_engine
async def test_proxy_close_releases_everything(
    private_server: RedisServer, make_client: MakeClient
) -> None:
    proxy = FaultProxy("127.0.0.1", private_server.port)
    await proxy.start()
    clients = [make_client(proxy.url, retry=no_retry()) for _ in range(3)]
    for client in clients:
        assert await client.ping() is True
    proxy.set_mode(ProxyMode.DELAY, delay=10.0)  # pending timers must be cancelled
    pending = asyncio.ensure_future(clients[0].ping())

    async def delayed_chunk_queued() -> bool:
        return any(flow.queue for pair in proxy._pairs for flow in pair.flows())

    await eventually(delayed_chunk_queued)
    await proxy.aclose()
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(pending, BOUND)
    assert proxy.connection_count == 0
    with pytest.raises(ConnectionRefusedError):
        resp_command("127.0.0.1", proxy.port, "PING", timeout=0.5)
    await proxy.aclose()  # idempotent
