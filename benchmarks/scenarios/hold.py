"""Many leases at once: held and renewed for a window (in a child process), and a burst.

Holding: a fresh child process opens a session, measures its RSS, acquires every lease
(``hold_concurrency`` acquisitions in flight), measures its RSS again, then over the
window measures its own CPU time (``time.process_time()``, all threads) and the renewals
the server executed (``INFO commandstats``: EVALSHA + EVAL calls; nothing else runs a
script during the window). At the end it counts leases lost: those the peer reported
lost, and keys no longer in Redis.

A peer whose API holds each lease inside a task of the caller's (asynclock's
``async with``) is measured once more, in another fresh child: the same tasks, each
waiting where it would hold its lease, and no lock taken. The report shows the RSS per
lease beyond those tasks next to the whole figure; for the other peers (asynclock's
``acquire()`` among them) the two are the same, since they hold leases without a task
of the caller's.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import time
from typing import Any

from redis.asyncio import Redis

from ..child import Child
from ..drive import BurstResult, burst_async, burst_threads
from ..peers import AsyncPeer, AsyncSession, Peer, SyncSession, get_peer
from ..system import LogCollector, renewal_calls, rss_bytes
from .common import Context, Measurement, in_session

__all__ = ["burst", "burst_pool", "burst_pool_size", "child_hold", "hold_many"]

_BURST_LIMIT = 120.0  # seconds a burst may take before it is abandoned


def hold_many(peer: Peer, ctx: Context) -> Measurement:
    """Hold ``hold_leases`` leases in a child process for ``hold_window`` seconds."""
    return asyncio.run(_hold_many(peer, ctx))


async def _hold_many(peer: Peer, ctx: Context) -> Measurement:
    p = ctx.profile
    spec = {
        "mode": "hold",
        "peer": peer.key,
        "url": ctx.url,
        "prefix": ctx.name(peer, "hold"),
        "leases": p.hold_leases,
        "ttl": p.hold_ttl,
        "window": p.hold_window,
        "concurrency": p.hold_concurrency,
    }
    child = await Child.start(spec)
    try:
        answer = await child.result(p.hold_window + 300)
    finally:
        await child.close()
    metrics = {k: float(v) for k, v in answer["metrics"].items()}
    metrics["kib_beyond_tasks"] = metrics["kib_per_lease"]
    if peer.holds_in_tasks:
        child = await Child.start({**spec, "tasks_only": True})
        try:
            tasks = await child.result(300)
        finally:
            await child.close()
        metrics["kib_per_task"] = float(tasks["metrics"]["kib_per_lease"])
        metrics["kib_beyond_tasks"] -= metrics["kib_per_task"]
    return Measurement(metrics, answer["note"])


def child_hold(spec: dict[str, Any]) -> None:
    """In a child process: the measurement of ``hold_many``; prints ``RESULT <json>``."""
    peer = get_peer(spec["peer"])
    peer.probe()
    if not isinstance(peer, AsyncPeer):
        raise TypeError(f"{peer.key} cannot hold many leases from one event loop")
    if spec.get("tasks_only"):
        kib = asyncio.run(
            _child_tasks(
                peer, spec["url"], spec["prefix"], int(spec["leases"]), int(spec["concurrency"])
            )
        )
        sys.stdout.write(
            "RESULT " + json.dumps({"metrics": {"kib_per_lease": kib}, "note": ""}) + "\n"
        )
        sys.stdout.flush()
        return
    logs = LogCollector()
    logging.getLogger().addHandler(logs)
    metrics, note = asyncio.run(
        _child_hold(
            logs,
            peer,
            spec["url"],
            spec["prefix"],
            int(spec["leases"]),
            float(spec["ttl"]),
            float(spec["window"]),
            int(spec["concurrency"]),
        )
    )
    sys.stdout.write("RESULT " + json.dumps({"metrics": metrics, "note": note}) + "\n")
    sys.stdout.flush()


async def _child_hold(
    logs: LogCollector,
    peer: AsyncPeer,
    url: str,
    prefix: str,
    leases: int,
    ttl: float,
    window: float,
    concurrency: int,
) -> tuple[dict[str, float], str]:
    probe = Redis.from_url(url)  # the harness's own connection: INFO and the final check
    await probe.ping()
    session = await peer.open(url)
    try:
        await session.warm_up(prefix + ":warm-up")  # connect, load scripts
        names = [f"{prefix}:{i}" for i in range(leases)]
        gc.collect()
        rss_before = rss_bytes()
        started = time.perf_counter()
        holding = await session.hold_many(names, ttl, concurrency)
        acquire_s = time.perf_counter() - started
        on_acquire = logs.summary()
        gc.collect()
        rss_after = rss_bytes()

        calls_before = renewal_calls(await probe.info("commandstats"))
        cpu_before, wall_before = time.process_time(), time.monotonic()
        await asyncio.sleep(window)
        cpu_after, wall_after = time.process_time(), time.monotonic()
        calls_after = renewal_calls(await probe.info("commandstats"))

        reported = holding.lost()
        missing = await _missing(probe, holding.keys)
        clients = int((await probe.info("clients"))["connected_clients"])
        while_held = logs.summary()
        await holding.release_all()
        on_release = logs.summary()
    finally:
        await session.aclose()
        await probe.aclose()
    cpu = cpu_after - cpu_before
    wall = wall_after - wall_before
    renewals = calls_after - calls_before
    held = len(holding.keys)
    notes = []
    if holding.failed:
        notes.append(f"{len(holding.failed)} acquisitions failed, e.g. {holding.failed[0][:160]}")
    for when, logged in (
        ("acquiring", on_acquire),
        ("holding", while_held),
        ("releasing all at once", on_release),
    ):
        if logged:
            notes.append(f"while {when}: {logged}")
    note = "; ".join(notes)
    return {
        "leases": float(held),
        "acquire_failed": float(len(holding.failed)),
        "acquire_s": acquire_s,
        "cpu_pct": 100 * cpu / wall,
        "renewals_per_s": renewals / wall,
        "us_per_renewal": cpu / renewals * 1e6 if renewals else float("nan"),
        "kib_per_lease": (rss_after - rss_before) / held / 1024 if held else float("nan"),
        "lost": float(max(reported, missing)),
        "lost_reported": float(reported),
        "missing_keys": float(missing),
        "clients": float(clients),
    }, note


async def _child_tasks(
    peer: AsyncPeer, url: str, prefix: str, leases: int, concurrency: int
) -> float:
    """RSS per task of the tasks ``hold_many`` would make, each waiting without a lease
    (measured as ``_child_hold`` measures its leases, after the same warm-up)."""
    session = await peer.open(url)
    try:
        await session.warm_up(prefix + ":warm-up")  # the same connections and scripts
        names = [f"{prefix}:{i}" for i in range(leases)]
        gc.collect()
        rss_before = rss_bytes()
        holding = await session.hold_tasks_only(names, concurrency)
        if holding is None:
            raise TypeError(f"{peer.key} does not hold leases in tasks of the caller's")
        gc.collect()
        rss_after = rss_bytes()
        await holding.release_all()
    finally:
        await session.aclose()
    return (rss_after - rss_before) / leases / 1024


async def _missing(probe: Redis, keys: list[str]) -> int:
    missing = 0
    for first in range(0, len(keys), 1000):
        pipe = probe.pipeline(transaction=False)
        for key in keys[first : first + 1000]:
            pipe.exists(key)
        missing += sum(1 for found in await pipe.execute() if not found)
    return missing


def burst(peer: Peer, ctx: Context) -> Measurement:
    """Enter ``burst_leases`` locks (distinct names) at once on a default client."""
    return _burst(peer, ctx, "burst", None)


def burst_pool(peer: Peer, ctx: Context) -> Measurement:
    """The same burst on a client whose pool has a connection for every lease."""
    return _burst(peer, ctx, "burst-pool", burst_pool_size(ctx.profile.burst_leases))


def burst_pool_size(leases: int) -> int:
    return leases + 100


def _burst(peer: Peer, ctx: Context, scenario: str, max_connections: int | None) -> Measurement:
    base = ctx.name(peer, scenario)
    names = [f"{base}:{i}" for i in range(ctx.profile.burst_leases)]

    async def run_async(session: AsyncSession) -> BurstResult:
        return await burst_async(session, names, ctx.connected_clients, _BURST_LIMIT)

    def run_threads(session: SyncSession) -> BurstResult:
        return burst_threads(session, names, ctx.connected_clients, _BURST_LIMIT)

    result = in_session(peer, ctx.url, run_async, run_threads, max_connections)
    metrics = {
        "acquire_ms": result.acquire_s * 1e3,
        "total_ms": result.total_s * 1e3,
        "leases_per_s": result.held / result.acquire_s if result.acquire_s else 0.0,
        "held": float(result.held),
        "errors": float(len(result.errors)),
        "clients": float(result.clients),
    }
    note = ""
    if result.errors:
        kinds = sorted(set(result.errors))
        note = f"{len(result.errors)} errors, e.g. {kinds[0][:160]}"
    return Measurement(metrics, note)
