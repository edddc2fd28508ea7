"""Contention: 8 contenders on one lock, each going straight back after each release.

From the log of turns (entry and release-call stamps, ``time.monotonic()``, which is
system-wide on Linux) come handoffs per second, the release-to-next-holder latency and the
fairness figures; see ``stats.contention_metrics``. Across processes, the handoffs are also
told apart by whether the next holder is in another process (``stats.process_handoff_metrics``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from ..child import Child
from ..drive import GRACE, contend_async, contend_threads
from ..peers import AsyncPeer, AsyncSession, Peer, SyncSession, ThreadPeer, get_peer
from ..stats import Hold, contention_metrics, process_handoff_metrics
from .common import Context, Measurement, in_session

__all__ = ["child_contend", "handoff_one_process", "handoff_processes"]


def handoff_one_process(peer: Peer, ctx: Context) -> Measurement:
    """All contenders in this process (tasks, or threads), sharing one client."""
    p = ctx.profile
    name = ctx.name(peer, "handoff-1p")
    contenders = list(range(p.contenders))
    window: list[float] = []

    def plan() -> float:
        start = time.monotonic() + p.contend_warmup
        window[:] = [start, start + p.contend]
        return window[1]

    async def run_async(session: AsyncSession) -> list[Hold]:
        return await contend_async(session, name, contenders, plan(), p.max_ops)

    def run_threads(session: SyncSession) -> list[Hold]:
        return contend_threads(session, name, contenders, plan(), p.max_ops)

    holds = in_session(peer, ctx.url, run_async, run_threads)
    reader = _reader(peer)
    return Measurement(contention_metrics(holds, window[0], window[1], p.contenders, reader))


def handoff_processes(peer: Peer, ctx: Context) -> Measurement:
    """The contenders split over ``contend_processes`` processes, one client each."""
    return asyncio.run(_handoff_processes(peer, ctx))


async def _handoff_processes(peer: Peer, ctx: Context) -> Measurement:
    p = ctx.profile
    name = ctx.name(peer, "handoff-np")
    groups = [
        list(range(p.contenders))[i :: p.contend_processes] for i in range(p.contend_processes)
    ]
    process_of = {ident: index for index, group in enumerate(groups) for ident in group}
    children: list[Child] = []
    try:
        for group in groups:
            spec = {
                "mode": "contend",
                "peer": peer.key,
                "url": ctx.url,
                "name": name,
                "contenders": group,
                "max_ops": p.max_ops,
            }
            children.append(await Child.start(spec))
        for child in children:
            await child.expect_ready(60)
        start = time.monotonic() + p.contend_warmup
        end = start + p.contend
        for child in children:
            await child.send({"end_at": end})
        holds: list[Hold] = []
        for child in children:
            turns = await child.result(end - time.monotonic() + GRACE + 10)
            holds.extend(Hold(float(a), float(b), int(c)) for a, b, c in turns)
    finally:
        for child in children:
            await child.close()
    reader = _reader(peer)
    metrics = contention_metrics(holds, start, end, p.contenders, reader)
    metrics.update(process_handoff_metrics(holds, start, end, process_of, reader))
    return Measurement(metrics)


def _reader(peer: Peer) -> Callable[[int], bool] | None:
    """``peer.reader`` if any of the peer's contenders holds a shared lease."""
    return peer.reader if any(peer.reader(c) for c in range(64)) else None


# -- the child's side ------------------------------------------------------------------


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def child_contend(spec: dict[str, Any]) -> None:
    """In a child process: set up, say READY, contend until the given end, report turns."""
    peer = get_peer(spec["peer"])
    peer.probe()
    name: str = spec["name"]
    contenders: list[int] = spec["contenders"]
    max_ops: int = spec["max_ops"]
    if isinstance(peer, AsyncPeer):
        holds = asyncio.run(_child_async(peer, spec["url"], name, contenders, max_ops))
    elif isinstance(peer, ThreadPeer):
        holds = _child_threads(peer, spec["url"], name, contenders, max_ops)
    else:
        raise TypeError(repr(peer))
    _say("RESULT " + json_holds(holds))


def json_holds(holds: list[Hold]) -> str:
    return json.dumps([[h.t_in, h.t_release, h.contender] for h in holds])


def _orders() -> float:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("no orders: the harness went away")
    return float(json.loads(line)["end_at"])


async def _child_async(
    peer: AsyncPeer, url: str, name: str, contenders: list[int], max_ops: int
) -> list[Hold]:
    session = await peer.open(url)
    try:
        async with session.lock(name + ":warm-up"):  # connect, load scripts
            pass
        _say("READY")
        end_at = await asyncio.to_thread(_orders)
        return await contend_async(session, name, contenders, end_at, max_ops)
    finally:
        await session.aclose()


def _child_threads(
    peer: ThreadPeer, url: str, name: str, contenders: list[int], max_ops: int
) -> list[Hold]:
    session = peer.open(url)
    try:
        with session.lock(name + ":warm-up"):
            pass
        _say("READY")
        return contend_threads(session, name, contenders, _orders(), max_ops)
    finally:
        session.close()
