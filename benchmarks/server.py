"""The server's share of a lock cycle: µs of Redis's main thread per uncontended acquire +
release of each kind, beside the recipes: ``python -m benchmarks.server``.

Redis runs every command and script on its one main thread, so the server time a cycle
takes bounds how many cycles a shard can do, and is latency added to every other client
of that server. It is read from ``INFO commandstats`` (``usec`` per command), summing
the commands each kind sends itself (its scripts, whose time includes the commands they
call; never those called inside a script, which ``commandstats`` counts as well): a
snapshot before and after each block of cycles, the blocks of the kinds taking turns
(in an order reversed every other block) so that drift of the machine falls on all; each
ratio is the median of the ratios within each round of turns (``in_round``).

Beside them, the same blocks read the main thread's CPU time (``INFO cpu``,
``used_cpu_user_main_thread`` + ``used_cpu_sys_main_thread``): everything the thread did
for a cycle, reading its requests and writing its replies included, which on loopback is
most of it with one request in flight at a time (about 18 µs per round trip on the host
of 2026-11-28, where a ``GET`` runs in 0.3): what bounds the cycles one shard can do when
its clients wait for each reply. A server busy with many clients reads several requests
per wake-up, and the commands' own µs weigh more there.

Beside the µs, :func:`count_commands` counts the commands each cycle runs (those the kind
sends and those its scripts call, the scripts themselves not counted): a command called
from Lua costs from about 0.4 µs (a read of an absent key) to 2 µs (a key made and
removed, with its ``DEL``), and a script call about 2 µs (history.md, "Server time per
cycle"), so the count is a guide, not the figure.

``--instructions`` counts instead the server's instructions per cycle (valgrind's
callgrind, on a ``redis-server`` of its own): all of them, and those inside the
commands the kind sends (``call()``: what ``commandstats`` times). Instructions are not
µs (a cache miss costs more than an add), but the count is the same in every run,
whatever else the machine does: an A/B of a script's change reads it where the µs
move by 10 to 40% from run to run.

The recipes: ``SET NX PX`` + an ``EVALSHA`` owner-checked ``DEL`` (no fencing token, no
wake-up: the floor), and a minimal fenced lock with a wake-up check (``SET NX PX`` +
``INCR`` + ``PEXPIRE`` of the counter; an ``EVALSHA`` release that ``GET``s, ``DEL``s,
asks ``EXISTS`` of a waiters key and ``PUBLISH``es).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from redis.asyncio import Redis

import asynclock
from asynclock.testing import RedisServer

__all__ = [
    "BLOCKS",
    "KINDS",
    "QUICK_BLOCKS",
    "Kind",
    "ServerTime",
    "count_commands",
    "count_instructions",
    "in_round",
    "measure",
    "render",
    "render_instructions",
    "server_section",
]

_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_FENCED_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PUBLISH', KEYS[1], 'released')
end
return 1
"""

Cycle = Callable[[], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of cycle: its label, the commands it sends itself (lowercase), and how
    to make its cycle on a client under a key prefix."""

    label: str
    sends: tuple[str, ...]
    make: Callable[[Redis, str], Cycle]


_SCRIPTS = ("evalsha", "eval")


def _recipe(client: Redis, prefix: str) -> Cycle:
    delete = client.register_script(_DELETE)
    key = prefix + "recipe"

    async def cycle() -> None:
        token = uuid.uuid4().hex
        await client.set(key, token, nx=True, px=10_000)
        await delete(keys=[key], args=[token])

    return cycle


def _fenced(client: Redis, prefix: str) -> Cycle:
    release = client.register_script(_FENCED_RELEASE)
    key, fence, waiters = prefix + "fenced", prefix + "fenced:fence", prefix + "fenced:waiting"

    async def cycle() -> None:
        token = uuid.uuid4().hex
        await client.set(key, token, nx=True, px=10_000)
        await client.incr(fence)
        await client.pexpire(fence, 86_400_000)
        await release(keys=[key, waiters], args=[token])

    return cycle


def _lease(name: str, **options: object) -> Callable[[Redis, str], Cycle]:
    def make(client: Redis, prefix: str) -> Cycle:
        async def cycle() -> None:
            async with asynclock.lease(client, name, prefix=prefix, **options):  # type: ignore[call-overload]
                pass

        return cycle

    return make


def _once(client: Redis, prefix: str) -> Cycle:
    async def job() -> int:
        return 1

    async def cycle() -> None:
        await asynclock.once(client, uuid.uuid4().hex, job, prefix=prefix)

    return cycle


KINDS: tuple[Kind, ...] = (
    Kind("recipe: `SET NX PX` + `EVALSHA` owner-checked `DEL`", ("set", *_SCRIPTS), _recipe),
    Kind(
        "recipe, fenced, with a wake-up check",
        ("set", "incr", "pexpire", *_SCRIPTS),
        _fenced,
    ),
    Kind("asynclock mutex", _SCRIPTS, _lease("mutex")),
    Kind("asynclock semaphore, `limit=5`", _SCRIPTS, _lease("sem5", limit=5)),
    Kind("asynclock semaphore, `limit=1000`", _SCRIPTS, _lease("sem1000", limit=1000)),
    Kind("asynclock shared lease", _SCRIPTS, _lease("shared", shared=True)),
    Kind("asynclock fair lock", _SCRIPTS, _lease("fair", fair=True)),
    Kind("asynclock `once()` (a new job each time)", _SCRIPTS, _once),
)
"""Every kind measured, the first the reference of every ratio."""


@dataclass(frozen=True, slots=True)
class ServerTime:
    """Median server µs per cycle of each kind (by label): in the commands it sends
    (``INFO commandstats``), and of the main thread's CPU, all of it (``INFO cpu``);
    ``rounds``: the µs in the commands of each block, one per round of the kinds' turns,
    in order (what :func:`in_round` compares)."""

    commands: dict[str, float]
    thread: dict[str, float]
    rounds: dict[str, list[float]]


def in_round(rounds: dict[str, list[float]], label: str, against: str) -> float:
    """Median over the rounds of ``label``'s µs per cycle divided by ``against``'s in the
    same round: a drift of the machine (a VM's neighbours, its clock's speed) falls on
    both sides of each ratio, where it moves the two medians apart. NaN without rounds."""
    pairs = zip(rounds.get(label, ()), rounds.get(against, ()), strict=False)
    ratios = [mine / theirs for mine, theirs in pairs if theirs > 0]
    return statistics.median(ratios) if ratios else math.nan


async def _usec(client: Redis, commands: Sequence[str]) -> tuple[float, float]:
    """(µs in ``commands``, µs of the main thread's CPU) the server spent so far."""
    stats = await client.info("commandstats")
    spent = sum(int(stats.get(f"cmdstat_{command}", {}).get("usec", 0)) for command in commands)
    cpu = await client.info("cpu")  # (the process's, on a server that does not say)
    user = cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"])
    system = cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])
    return float(spent), (float(user) + float(system)) * 1e6


BLOCKS: Final = (80, 60)
"""Blocks and cycles per block of a full measure: many short blocks, so that each round
of turns is over before the machine drifts (the in-round ratios of 10 blocks of 500
cycles moved from 2.4x to 3.3x for one code on one host; of 100 blocks of 50, from 2.85x
to 3.01x: history.md)."""
QUICK_BLOCKS: Final = (12, 50)
"""The same for a quick look."""


async def measure(
    url: str, blocks: int = BLOCKS[0], per_block: int = BLOCKS[1], kinds: Sequence[Kind] = KINDS
) -> ServerTime:
    """Median server µs per cycle of each kind, over ``blocks`` blocks of ``per_block``
    cycles each, the kinds taking turns (each round of turns a block of each kind). Runs
    against the server at ``url``, which nothing else should use meanwhile; its keys
    are left to expire."""
    client, probe = Redis.from_url(url), Redis.from_url(url)
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    try:
        cycles = [(kind, kind.make(client, prefix)) for kind in kinds]
        for _, cycle in cycles:  # (warm-up: scripts loaded, connections open)
            for _ in range(20):
                await cycle()
        spent: dict[str, list[float]] = {kind.label: [] for kind in kinds}
        thread: dict[str, list[float]] = {kind.label: [] for kind in kinds}
        for block in range(blocks):
            for kind, cycle in cycles if block % 2 == 0 else list(reversed(cycles)):
                before = await _usec(probe, kind.sends)
                for _ in range(per_block):
                    await cycle()
                after = await _usec(probe, kind.sends)
                spent[kind.label].append((after[0] - before[0]) / per_block)
                thread[kind.label].append((after[1] - before[1]) / per_block)
    finally:
        await client.aclose()
        await probe.aclose()
    return ServerTime(_medians(spent), _medians(thread), spent)


def _medians(figures: dict[str, list[float]]) -> dict[str, float]:
    return {label: statistics.median(values) for label, values in figures.items()}


async def count_commands(
    url: str, cycles: int = 200, kinds: Sequence[Kind] = KINDS
) -> dict[str, float]:
    """Commands the server runs per uncontended cycle of each kind (by label): those the
    kind sends and those its scripts call, the scripts themselves not counted (``INFO
    commandstats`` calls, over ``cycles`` cycles after a warm-up)."""
    client, probe = Redis.from_url(url), Redis.from_url(url)
    prefix = f"count:{uuid.uuid4().hex[:6]}:"
    counts: dict[str, float] = {}
    try:
        for kind in kinds:
            cycle = kind.make(client, prefix)
            for _ in range(20):
                await cycle()
            before = await _calls(probe)
            for _ in range(cycles):
                await cycle()
            after = await _calls(probe)
            counts[kind.label] = (after - before) / cycles
    finally:
        await client.aclose()
        await probe.aclose()
    return counts


async def _calls(client: Redis) -> int:
    """Calls of every command so far, but scripts and ``INFO`` (``INFO commandstats``)."""
    stats = await client.info("commandstats")
    left_out = {f"cmdstat_{name}" for name in (*_SCRIPTS, "info")}
    return sum(int(v.get("calls", 0)) for k, v in stats.items() if k not in left_out)


async def count_instructions(
    cycles: int = 300, kinds: Sequence[Kind] = KINDS
) -> dict[str, tuple[float, float]]:
    """Instructions of a private ``redis-server`` (run under valgrind's callgrind) per
    uncontended cycle of each kind (by label), over ``cycles`` cycles after a warm-up:
    (all of the server's, those inside the commands it was sent: ``call()`` and what it
    calls, 0 when the binary does not name it). Needs ``valgrind`` and ``redis-server``
    on PATH (raises ``FileNotFoundError`` naming the one missing)."""
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate", "redis-server"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"{tool} is not on PATH")
    with socket.socket() as probe_port:
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    with tempfile.TemporaryDirectory() as scratch:
        dumps = Path(scratch)
        server = await asyncio.create_subprocess_exec(
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={dumps}/out.%p", "redis-server", "--port", str(port),
            "--save", "", "--appendonly", "no",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = Redis(port=port)
        try:
            for _ in range(300):  # (valgrind starts the server in a few seconds)
                try:
                    await client.ping()
                    break
                except (ConnectionError, OSError):
                    await asyncio.sleep(0.1)
            await asyncio.to_thread(_control, server.pid, "-i", "on")
            counts = {}
            for index, kind in enumerate(kinds):
                cycle = kind.make(client, f"count:{uuid.uuid4().hex[:6]}:")
                for _ in range(30):
                    await cycle()
                await asyncio.to_thread(_control, server.pid, "-z")
                for _ in range(cycles):
                    await cycle()
                await asyncio.to_thread(_control, server.pid, "-d", f"kind{index}")
                dump = await asyncio.to_thread(_dump_of, dumps, f"kind{index}")
                total, in_call = await asyncio.to_thread(_instructions, dump)
                counts[kind.label] = (total / cycles, in_call / cycles)
        finally:
            await client.aclose()
            server.terminate()
            await server.wait()
    return counts


def _control(pid: int, *args: str) -> None:
    """``callgrind_control`` of the server ``pid`` (instrumentation, zero, dump)."""
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def _dump_of(dumps: Path, trigger: str) -> Path:
    """The callgrind dump written for ``callgrind_control -d trigger`` (it may lag)."""
    for _ in range(100):
        for path in dumps.iterdir():
            if f"Trigger: dump {trigger}\n" in path.read_text(errors="replace"):
                return path
        time.sleep(0.1)
    raise TimeoutError(f"callgrind wrote no dump for {trigger}")


def _instructions(dump: Path) -> tuple[int, int]:
    """(instructions in all, inclusive instructions of ``call``) of a callgrind dump."""
    report = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", str(dump)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    total = re.search(r"^\s*([\d,]+) .*PROGRAM TOTALS", report, re.MULTILINE)
    in_call = re.search(r"^\s*([\d,]+) \(.*\)\s+\S*:call \[", report, re.MULTILINE)
    return tuple(  # type: ignore[return-value]
        int(found.group(1).replace(",", "")) if found else 0 for found in (total, in_call)
    )


def render_instructions(counts: dict[str, tuple[float, float]]) -> list[str]:
    """The table of ``counts`` (:func:`count_instructions`), each against the first kind's
    and the mutex's instructions inside the commands."""
    labels = list(counts)
    base, mutex = counts[labels[0]][1], counts.get("asynclock mutex", (0.0, 0.0))[1]
    lines = [
        "| cycle | server instructions per cycle (thousands) | in the commands sent "
        "| ÷ the recipe | ÷ the mutex |",
        "|---|---|---|---|---|",
    ]
    for label, (total, in_call) in counts.items():
        against = f"{in_call / mutex:.2f}x" if mutex else "-"
        ratio = f"{in_call / base:.2f}x" if base else "-"
        lines.append(
            f"| {label} | {total / 1000:.1f} | {in_call / 1000:.1f} | {ratio} | {against} |"
        )
    return lines


def render(
    figures: dict[str, float],
    commands: dict[str, float] | None = None,
    thread: dict[str, float] | None = None,
    rounds: dict[str, list[float]] | None = None,
) -> list[str]:
    """The table of ``figures`` (``ServerTime.commands``), each against the first kind,
    with the commands per cycle (from :func:`count_commands`) and the main thread's µs
    (``ServerTime.thread``), if given (results of older runs have neither). With
    ``rounds`` (``ServerTime.rounds``) the ratios are medians of in-round ratios
    (:func:`in_round`), else ratios of the medians (older results)."""
    labels = list(figures)
    base = labels[0]
    mutex = "asynclock mutex" if "asynclock mutex" in figures else None
    thread_base = (thread or {}).get(base)  # (None: no main thread column)

    def ratio(label: str, against: str) -> float:
        if rounds:
            return in_round(rounds, label, against)
        return figures[label] / figures[against]

    lines = [
        "| cycle | server µs per cycle | ÷ the recipe | ÷ the mutex |"
        + (" commands per cycle |" if commands else "")
        + (" main thread µs per cycle | ÷ the recipe |" if thread_base else ""),
        "|---|---|---|---|" + ("---|" if commands else "") + ("---|---|" if thread_base else ""),
    ]
    for label, us in figures.items():
        against = f"{ratio(label, mutex):.2f}x" if mutex else "-"
        row = f"| {label} | {us:.1f} | {ratio(label, base):.2f}x | {against} |"
        if commands:
            row += f" {commands[label]:.0f} |" if label in commands else " - |"
        if thread and thread_base:
            cpu = thread.get(label)
            row += f" {cpu:.1f} | {cpu / thread_base:.2f}x |" if cpu else " - | - |"
        lines.append(row)
    return lines


def server_section(
    figures: dict[str, float],
    commands: dict[str, float] | None = None,
    thread: dict[str, float] | None = None,
    rounds: dict[str, list[float]] | None = None,
) -> list[str]:
    """The section of a report on ``figures`` (and ``commands``, ``thread`` and
    ``rounds``, see :func:`render`): how they were measured, and the table."""
    return [
        "Server µs of Redis's main thread per uncontended acquire + release, from `INFO "
        "commandstats` (the commands each kind sends itself; a script's time includes the "
        "commands it calls), the kinds taking turns in blocks on the run's server "
        "(`benchmarks/server.py`; `python -m benchmarks.server` alone). The recipes are "
        "the floor: `SET NX PX` + an `EVALSHA` owner-checked `DEL`, and a fenced lock "
        "with a wake-up check (`SET NX PX` + `INCR` + `PEXPIRE`; release `GET`, `DEL`, "
        "`EXISTS`, `PUBLISH`). Read the ratios: the µs move with the machine. Each ratio "
        "is the median of the ratios within each round of turns (many short blocks), so "
        "that a drift of the machine falls on both of its sides. *Commands "
        "per cycle*: those the kind sends and those its scripts call (the scripts not "
        "counted); a command called from a script costs from about 0.4 µs (a read of an "
        "absent key) to 2 µs (a key made and removed), so the count is a guide, not the "
        "figure (what each script runs, and what each saved µs cost: "
        "[history.md](history.md#server-time-per-cycle)). *Main thread µs*: the main "
        "thread's CPU time over the same blocks (`INFO cpu`), everything it did for a "
        "cycle, reading the requests and writing the replies included: on loopback most "
        "of it is that I/O, the same for every kind (two round trips per cycle, one "
        "request in flight at a time: a server busy with many clients reads several per "
        "wake-up, and the commands' own µs weigh more there).",
        "",
        *render(figures, commands, thread, rounds),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer, shorter blocks")
    parser.add_argument("--url", help="measure on this server (else a private one)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count the server's instructions per cycle instead (valgrind's callgrind)",
    )
    args = parser.parse_args(argv)
    if args.instructions:
        if args.url:
            parser.error("--instructions runs a server of its own: no --url")
        counts = asyncio.run(count_instructions(100 if args.quick else 300))
        print("\n".join(render_instructions(counts)))
        return 0
    blocks, per_block = QUICK_BLOCKS if args.quick else BLOCKS
    if args.url:
        figures = asyncio.run(measure(args.url, blocks, per_block))
        commands = asyncio.run(count_commands(args.url))
    else:
        with RedisServer() as server:
            figures = asyncio.run(measure(server.url, blocks, per_block))
            commands = asyncio.run(count_commands(server.url))
    print("\n".join(render(figures.commands, commands, figures.thread, figures.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
