"""The README's compatibility table, cell by cell (issue 21, E).

Every cell marked ✓ in the README's table is one case here, run against a real
deployment the test starts: Redis standalone, Valkey standalone, a Sentinel over a
primary and its replica, a cluster of three primaries; each with RESP2 and RESP3 and
``decode_responses`` both ways, and on uvloop; through redis-py's clients, and (the rows
marked "valkey-py") through valkey-py's: ``Valkey``, a valkey-py ``Sentinel``'s
``master_for()``, ``ValkeyCluster`` (issue 30). ``test_readme_table_is_what_runs_here``
fails if the README marks a cell that no case here runs (or leaves one out). The
redis-py versions are the matrix's (``tests/matrix.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from deployments import SERVICE, SentinelProcess, cluster_nodes, sentinel_ready, synced_replica
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel

import asynclock
from asynclock import LockBusy
from asynclock.testing import RedisServer, available_engines, keys_left

ROOT = Path(__file__).resolve().parents[1]
VALKEY_PY = "valkey-py"  # (the rows through valkey-py's clients: "<deployment>-valkey-py")
DEPLOYMENTS = (
    *("redis", "valkey", "sentinel", "cluster"),
    *(f"{d}-{VALKEY_PY}" for d in ("valkey", "sentinel", "cluster")),
)
COLUMNS = ("resp2-bytes", "resp2-str", "resp3-bytes", "resp3-str", "uvloop")
HEADINGS = {
    "redis": "Redis standalone",
    "valkey": "Valkey standalone",
    "sentinel": "Sentinel (primary + replica)",
    "cluster": "Cluster (3 primaries)",
    f"valkey-{VALKEY_PY}": f"Valkey standalone, {VALKEY_PY}",
    f"sentinel-{VALKEY_PY}": f"Sentinel (primary + replica), {VALKEY_PY}",
    f"cluster-{VALKEY_PY}": f"Cluster (3 primaries), {VALKEY_PY}",
}

Client = Redis | RedisCluster


@dataclasses.dataclass
class Deployment:
    """A running deployment: its kind (standalone, sentinel, cluster), the port its
    clients start from, its primaries' ports (where its keys are), and the library of
    its clients (``"redis"``: redis-py, ``"valkey"``: valkey-py)."""

    kind: str
    port: int
    primaries: list[int]
    library: str = "redis"

    def make(self, protocol: int, decode: bool) -> Client:
        client_class, cluster_class, sentinel_class = _classes(self.library)
        if self.kind == "sentinel":
            manager = sentinel_class([("127.0.0.1", self.port)], socket_timeout=2.0)
            client = manager.master_for(SERVICE, protocol=protocol, decode_responses=decode)
            client.test_manager = manager  # (see _close)
            return client  # type: ignore[no-any-return]
        if self.kind == "cluster":
            return cluster_class(  # type: ignore[no-any-return]
                host="127.0.0.1", port=self.port, protocol=protocol, decode_responses=decode
            )
        return client_class(  # type: ignore[no-any-return]
            host="127.0.0.1", port=self.port, protocol=protocol, decode_responses=decode
        )

    def spec(self, prefix: str) -> str:
        """This deployment and ``prefix`` as a string (for ``on_uvloop``)."""
        primaries = ":".join(map(str, self.primaries))
        return f"{self.kind},{self.port},{primaries},{self.library},{prefix}"


def _classes(library: str) -> tuple[Any, Any, Any]:
    """The client, cluster client and Sentinel classes of redis-py or valkey-py."""
    if library == "redis":
        return Redis, RedisCluster, Sentinel
    import valkey.asyncio

    return valkey.asyncio.Valkey, valkey.asyncio.ValkeyCluster, valkey.asyncio.Sentinel


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Deployment]]:
    started: dict[str, Deployment] = {}
    stops: list[Callable[[], None]] = []
    engines = available_engines()
    try:
        if "redis" in engines:
            server = RedisServer("redis").start()
            stops.append(server.stop)
            started["redis"] = Deployment("standalone", server.port, [server.port])
        if "valkey" in engines:
            server = RedisServer("valkey").start()
            stops.append(server.stop)
            started["valkey"] = Deployment("standalone", server.port, [server.port])
        if engines:
            primary = RedisServer().start()
            stops.append(primary.stop)
            replica = synced_replica(primary)
            stops.append(replica.stop)
            sentinel = SentinelProcess(primary, tmp_path_factory.mktemp("sentinel"))
            stops.append(sentinel.stop)
            asyncio.run(_ready(sentinel.port))
            started["sentinel"] = Deployment("sentinel", sentinel.port, [primary.port])
            nodes = cluster_nodes(3)
            servers = nodes.__enter__()
            stops.append(lambda: nodes.__exit__(None, None, None))
            ports = [node.port for node in servers]
            started["cluster"] = Deployment("cluster", servers[0].port, ports)
        if find_spec("valkey") is not None:  # (the same deployments, valkey-py's clients)
            for name in ("valkey", "sentinel", "cluster"):
                if name in started:
                    through = dataclasses.replace(started[name], library="valkey")
                    started[f"{name}-{VALKEY_PY}"] = through
        yield started
    finally:
        for stop in reversed(stops):
            stop()


async def _ready(port: int) -> None:
    manager = Sentinel([("127.0.0.1", port)], socket_timeout=2.0)
    try:
        await sentinel_ready(manager)
    finally:
        for server in manager.sentinels:
            await server.aclose()


async def _scenario(deployment: Deployment, protocol: int, decode: bool, prefix: str) -> None:
    """Two clients: a waiter woken by the release (renewals past the TTL before it), a
    semaphore held by both at once, shared leases, once() and statistics(); nothing
    left behind."""
    first = deployment.make(protocol, decode)
    second = deployment.make(protocol, decode)
    try:
        entered = asyncio.Event()

        async def holder() -> None:
            async with asynclock.lease(first, "job", ttl=0.9, prefix=prefix) as lock:
                entered.set()
                await asyncio.sleep(0.7)  # (renewed at 0.3 s and 0.6 s)
                assert lock.state is asynclock.LeaseState.HELD

        async def waiter() -> float:
            await entered.wait()
            started = time.monotonic()
            async with asynclock.lease(second, "job", ttl=30.0, prefix=prefix):
                return time.monotonic() - started

        _, waited = await asyncio.gather(holder(), waiter())
        assert waited < 3.0, waited
        async with (
            asynclock.lease(first, "sem", limit=2, prefix=prefix),
            asynclock.lease(second, "sem", limit=2, prefix=prefix),
        ):
            with pytest.raises(LockBusy):
                async with asynclock.lease(first, "sem", limit=2, blocking=False, prefix=prefix):
                    pass
            stats = await asynclock.statistics(second, "sem", prefix=prefix)
            assert (stats.permits_in_use, stats.limit) == (2, 2)
        async with (
            asynclock.lease(first, "rw", shared=True, prefix=prefix),
            asynclock.lease(second, "rw", shared=True, prefix=prefix),
        ):
            pass

        async def job() -> dict[str, int]:
            return {"answer": 42}

        assert await asynclock.once(first, "once", job, prefix=prefix) == {"answer": 42}
        assert await asynclock.once(second, "once", job, prefix=prefix) == {"answer": 42}
        assert await asynclock.forget(first, "once", prefix=prefix)
    finally:
        await _close(first)
        await _close(second)
    for port in deployment.primaries:
        plain = Redis(host="127.0.0.1", port=port)
        try:
            assert await keys_left(plain, prefix) == []
        finally:
            await plain.aclose()


def on_uvloop(spec: str) -> None:
    """Run the scenario on uvloop (in a process of its own; see ``test_cell``)."""
    import uvloop

    kind, port, primaries, library, prefix = spec.split(",")
    deployment = Deployment(kind, int(port), [int(p) for p in primaries.split(":")], library)

    async def main() -> None:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        await _scenario(deployment, 2, False, prefix)

    uvloop.run(main())
    print("ran on uvloop")


async def _close(client: Client) -> None:
    """Close a client, and a Sentinel client's connections to its sentinels too."""
    await client.aclose()
    manager = getattr(client, "test_manager", None)
    if manager is not None:
        for sentinel in manager.sentinels:
            await sentinel.aclose()


CASES = [(d, c) for d in DEPLOYMENTS for c in COLUMNS]


@pytest.mark.parametrize(("deployment", "column"), CASES, ids=[f"{d}-{c}" for d, c in CASES])
def test_cell(
    deployments: dict[str, Deployment], deployment: str, column: str, prefix: str
) -> None:
    if deployment not in deployments:
        pytest.skip(f"no {deployment} server installed")
    target = deployments[deployment]
    if column == "uvloop":  # (in a process of its own, as an application on uvloop runs)
        code = f"import test_compat_table as t; t.on_uvloop({target.spec(prefix)!r})"
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT / "tests",
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() == "ran on uvloop"
        return
    protocol = 3 if column.startswith("resp3") else 2
    run: Awaitable[None] = _scenario(target, protocol, column.endswith("str"), prefix)
    asyncio.run(run)  # type: ignore[arg-type]


def test_readme_table_is_what_runs_here() -> None:
    """The README's table marks exactly the cells this module runs."""
    text = (ROOT / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in HEADINGS.values():
            rows[cells[0]] = cells[1 : 1 + len(COLUMNS)]
    assert set(rows) == set(HEADINGS.values()), "the README's table lacks a deployment"
    for _deployment, heading in HEADINGS.items():
        marked = [
            column for column, cell in zip(COLUMNS, rows[heading], strict=True) if cell == "✓"
        ]
        assert marked == list(COLUMNS), f"{heading}: {rows[heading]}"
    header = next(line for line in text.splitlines() if line.startswith("| deployment |"))
    assert re.sub(r"\s+", " ", header).count("|") == len(COLUMNS) + 2
