"""Real deployments the tests start: a sentinel over a primary and its replica, and a
cluster of primaries (shared by test_sentinel, test_cluster and test_compat_table)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from redis.asyncio.sentinel import Sentinel

from asynclock.testing import RedisServer

SERVICE = "asynclock-test"
SLOTS = 16384


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``check`` (a state of another process) until true; AssertionError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:g} s")
        time.sleep(0.02)


class SentinelProcess:
    """One ``redis-server --sentinel`` watching ``primary``: it marks a primary down after
    0.5 s without an answer, and fails over on its own (a quorum of 1)."""

    def __init__(self, primary: RedisServer, directory: Path) -> None:
        binary = primary.binary  # (redis-server or valkey-server: both run sentinels)
        self.port = free_port()
        config = directory / "sentinel.conf"
        config.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            "protected-mode no\n"
            f"dir {directory}\n"
            f"logfile {directory / 'sentinel.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 500\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
        )
        self.log = directory / "sentinel.log"
        self.proc = subprocess.Popen(
            [binary, str(config), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def synced_replica(primary: RedisServer) -> RedisServer:
    """A replica of ``primary``, its link up (a sentinel promotes only such a one)."""
    replica = primary.replica()
    try:
        wait_until(
            lambda: b"master_link_status:up" in replica.command("INFO", "replication"),
            "the replica did not sync",
        )
    except BaseException:
        replica.stop()
        raise
    return replica


async def sentinel_ready(manager: Sentinel) -> None:
    """Wait until the sentinel has found the replica and read its INFO (it promotes only
    a replica whose INFO is fresh and whose link is up)."""
    import asyncio

    async with asyncio.timeout(15):
        while True:
            with contextlib.suppress(Exception):
                replicas = await manager.sentinels[0].sentinel_slaves(SERVICE)
                if any(
                    r.get("master-link-status") == "ok" and int(r["info-refresh"]) < 5000
                    for r in replicas
                ):
                    return
            await asyncio.sleep(0.05)


def slot_bounds(count: int) -> list[int]:
    return [SLOTS * i // count for i in range(count + 1)]


@contextlib.contextmanager
def cluster_nodes(count: int = 3, engine: str | None = None) -> Iterator[list[RedisServer]]:
    """``count`` primaries owning equal ranges of the slots, the cluster's state ok."""
    servers: list[RedisServer] = []
    try:
        for _ in range(count):
            servers.append(RedisServer(engine, cluster=True).start())
        bounds = slot_bounds(count)
        for server, low, high in zip(servers, bounds, bounds[1:], strict=False):
            server.command("CLUSTER", "ADDSLOTSRANGE", low, high - 1)
        for server in servers[1:]:
            servers[0].command("CLUSTER", "MEET", "127.0.0.1", server.port)
        for server in servers:
            wait_until(
                lambda s=server: b"cluster_state:ok" in s.command("CLUSTER", "INFO"),
                f"node {server.port} did not see the cluster ok",
            )
        yield servers
    finally:
        for server in servers:
            server.stop()
