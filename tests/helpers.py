"""Small helpers shared by the lease tests (not fixtures; those live in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import OutOfMemoryError

import asynclock
from asynclock.testing import RedisServer


class Monitor:
    """Collects the commands a server executes, from a MONITOR connection.

    ``await monitor.mark()`` returns once every command sent before the call (on any
    connection whose reply was already received) has been seen, by sending a unique
    ECHO and waiting for it to come through.
    """

    def __init__(self, url: str) -> None:
        client = Redis.from_url(url)
        kwargs = client.connection_pool.connection_kwargs
        self._connection = Connection(host=kwargs["host"], port=kwargs["port"])
        self._client = client
        self.lines: list[str] = []
        self._waiting: dict[str, asyncio.Future[int]] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Monitor:
        await self._connection.connect()
        await self._connection.send_command("MONITOR")
        reply = await self._connection.read_response()
        assert reply in (b"OK", "OK"), reply
        self._task = asyncio.get_running_loop().create_task(self._read())
        await self.mark()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._connection.disconnect()
        await self._client.aclose()

    async def _read(self) -> None:
        while True:
            raw = await self._connection.read_response(timeout=math.inf)
            line = raw.decode() if isinstance(raw, bytes) else str(raw)
            self.lines.append(line)
            for marker, future in list(self._waiting.items()):
                if marker in line and not future.done():
                    future.set_result(len(self.lines) - 1)

    async def mark(self) -> int:
        """Index in ``lines`` of a marker executed after everything sent before now."""
        marker = f"mark-{uuid.uuid4().hex}"
        future = asyncio.get_running_loop().create_future()
        self._waiting[marker] = future
        await self._client.echo(marker)
        async with asyncio.timeout(5):
            index = await future
        del self._waiting[marker]
        return index

    def client_commands(self, start: int, end: int) -> list[str]:
        """Command names sent by clients (not from inside scripts) between two marks."""
        names = []
        for line in self.lines[start + 1 : end]:
            if " lua]" in line or "mark-" in line:
                continue
            names.append(line.split('"')[1].upper())
        return names


async def server_checked(client: Redis) -> Any:
    """The companion of ``client``, once its one-time server check has finished (the
    eviction policy, whether it renews by command: ``Companion.check_server_once``).

    Call it inside a lease's block: the first lease starts the check in the background,
    and the end of a client's last lease cuts a check still running short, to be made
    again (``HELLO``, ``CONFIG GET``) by the next lease, where a test counting that
    lease's commands would see them."""
    from asynclock._session._connections import companion_for

    companion = companion_for(client)
    check = companion._server_check
    assert check is not None, "no server check: call this inside a lease's block"
    await asyncio.wait_for(asyncio.shield(check), 5)
    return companion


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], limit: float = 5.0, what: str = "condition"
) -> None:
    """Check ``predicate`` until it holds; fail after ``limit`` seconds.

    For state that changes in another process (a server's client list) where there is
    nothing to await.
    """
    deadline = time.monotonic() + limit
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit}s waiting for {what}")
        await asyncio.sleep(0.01)


class StoppedServerProbe:
    """The SIGSTOP fault, from inside guarded code: after a renewal, read the key's
    absolute expiry with the server's own clock (PEXPIRETIME), stop the server, and wait
    to be cancelled, recording when (wall clock, ms: this host is the server's host)."""

    def __init__(self, server: RedisServer, observer: Redis) -> None:
        self.server = server
        self.observer = observer
        self.renewed = asyncio.Event()
        self.expires_at_ms = 0
        self.paused_at = 0.0  # time.monotonic()
        self.cancelled_at_ms: float | None = None

    def on_event(self, event: asynclock.LeaseEvent) -> None:
        if event.kind is asynclock.LeaseEventKind.RENEWED:
            self.renewed.set()

    async def stop_and_wait(self, key: str) -> None:
        await self.renewed.wait()
        self.expires_at_ms = int(await self.observer.execute_command("PEXPIRETIME", key))
        self.server.pause()
        self.paused_at = time.monotonic()
        try:
            await anyio.sleep_forever()
        except BaseException:
            self.cancelled_at_ms = time.time() * 1000
            assert self.server.is_paused  # no command could have returned
            raise


async def commandstat(client: Redis, command: str) -> int:
    """How many times the server executed ``command`` (from INFO commandstats)."""
    info: dict[str, Any] = await client.info("commandstats")
    return int(info.get(f"cmdstat_{command}", {}).get("calls", 0))


@contextlib.asynccontextmanager
async def running(coro: Awaitable[Any]) -> AsyncIterator[asyncio.Task[Any]]:
    """Run ``coro`` as a task for the duration of the block, cancelling it on exit."""
    task = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


SECRET: str = "hunter2-not-for-logs"
"""A password no message of asynclock may print (see ``urls_with_a_secret``)."""


async def urls_with_a_secret(server: RedisServer) -> list[tuple[str, str, dict[str, str]]]:
    """Ways to hand a command ``SECRET`` (or a wrong password that contains it) in a
    URL: ``(label, url, environment)`` for ``user:password@``, ``:password@``,
    ``?password=``, ``$REDIS_URL``, an unreachable server and a URL that does not parse.
    Sets ``requirepass`` on ``server`` (a private one): the first URL is right (the
    command runs), the others are refused or fail."""
    admin = Redis.from_url(server.url)
    try:
        await admin.config_set("requirepass", SECRET)
    finally:
        await admin.aclose()
    host = f"127.0.0.1:{server.port}"
    wrong = f"wrong-{SECRET}"
    return [
        ("right", f"redis://:{SECRET}@{host}/0", {}),
        ("user:password", f"redis://default:{wrong}@{host}/0", {}),
        (":password", f"redis://:{wrong}@{host}/0", {}),
        ("password=", f"redis://{host}/0?password={wrong}", {}),
        ("REDIS_URL", "", {"REDIS_URL": f"redis://:{wrong}@{host}/0"}),
        ("unreachable", f"redis://:{SECRET}@127.0.0.1:1/0", {}),
        ("unparsable", f"redis://:{SECRET}@127.0.0.1:port/0", {}),
    ]


async def run_out_of_memory(client: Redis, prefix: str) -> None:
    """Fill the server under ``noeviction`` until writes are refused, then lower
    ``maxmemory`` clearly below what is used: refused writes leave used memory right at
    the limit, where a little freed buffer space can let the next write through."""
    await client.config_set("maxmemory-policy", "noeviction")
    await client.config_set("maxmemory", "2mb")
    with pytest.raises(OutOfMemoryError):
        for i in range(100_000):
            await client.set(f"{prefix}fill:{i}", "x" * 1000)
    used = (await client.info("memory"))["used_memory"]
    await client.config_set("maxmemory", used - 64 * 1024)
