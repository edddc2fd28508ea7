"""The benchmark harness: start a private pinned server, run every scenario for every peer,
write ``results.json``, ``results.md`` and ``results.png``.

Every run writes into a folder of its own, ``benchmarks/runs/<UTC time>-<mode>/`` (git
ignores it), or ``--out DIR``; only ``--update`` (a full run of every scenario and peer)
replaces the committed ``benchmarks/results.*``.

Runs are interleaved (run 1 of every scenario for every peer, then run 2, ...), so the
ratios of one run compare peers measured minutes apart at most, on the same server.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import logging
import math
import signal
import sys
import time
import traceback
from pathlib import Path

import redis

from .config import FULL, QUICK, Profile
from .peers import ALL_PEERS, CYCLE, HOLD, AsyncPeer, Peer, ThreadPeer
from .results import PeerEntry, Record, Results
from .scenarios import SCENARIOS, Context, Measurement, Scenario
from .server import BLOCKS, QUICK_BLOCKS, count_commands
from .server import measure as server_time
from .system import (
    LogCollector,
    cpu_times,
    environment,
    load_note,
    plan_pinning,
    start_server,
)

__all__ = ["main"]

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs"  # a folder per run (git-ignored)


_LOGS = LogCollector()


class _Stop:
    """Ctrl-C once: finish the measurement under way, then report what was measured.
    Ctrl-C twice (or SIGTERM): abort at once; the server and child processes are stopped."""

    requested = False

    @classmethod
    def on_sigint(cls, signum: int, frame: object) -> None:
        if cls.requested:
            raise KeyboardInterrupt
        cls.requested = True
        print("\nstopping after this measurement (Ctrl-C again to abort)", file=sys.stderr)

    @staticmethod
    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark asynclock against the Redis locks a user would otherwise pick.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="short run (under two minutes); see README.md"
    )
    parser.add_argument("--runs", type=int, help="runs of every scenario (default 3)")
    parser.add_argument(
        "--scenarios",
        help="comma-separated subset of: " + ", ".join(s.key for s in SCENARIOS),
    )
    parser.add_argument(
        "--peers", help="comma-separated subset of: " + ", ".join(p.key for p in ALL_PEERS)
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        type=Path,
        help="folder for results.{json,md,png} (default: a new benchmarks/runs/<time>-<mode>/)",
    )
    where.add_argument(
        "--update",
        action="store_true",
        help="replace the committed benchmarks/results.{json,md,png} (a full run of every "
        "scenario and peer only)",
    )
    parser.add_argument("--engine", choices=("redis", "valkey"), help="server engine to start")
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin the server and the clients to CPUs"
    )
    parser.add_argument(
        "--report-only",
        type=Path,
        metavar="RESULTS_JSON",
        help="only write results.md and results.png again from a results.json (next to it "
        "unless --out or --update)",
    )
    return parser


def _out_folder(args: argparse.Namespace, mode: str) -> Path:
    """Where this run writes: a fresh folder unless ``--out`` or ``--update`` says otherwise.

    Refuses (``SystemExit``) to touch the committed results without ``--update``, and
    ``--update`` for anything but a full run of every scenario and peer.
    """
    if args.update:
        partial = [
            flag
            for flag, given in (
                ("--quick", mode != FULL.name),
                ("--runs", args.runs is not None),
                ("--scenarios", bool(args.scenarios)),
                ("--peers", bool(args.peers)),
            )
            if given
        ]
        if partial:
            raise SystemExit(
                f"--update replaces the committed results with a full run of every scenario "
                f"and peer: not with {', '.join(partial)} (or a {mode} run's results)"
            )
        return HERE
    if args.out is not None:
        out: Path = args.out
    elif args.report_only is not None:
        out = args.report_only.parent
    else:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        out = RUNS / f"{stamp}-{mode}"
        suffix = 1
        while out.exists():
            suffix += 1
            out = RUNS / f"{stamp}-{mode}-{suffix}"
    committed = out.resolve() == HERE
    if committed and not (args.report_only and args.report_only.resolve().parent == HERE):
        raise SystemExit(
            "benchmarks/ holds the committed results: pass --update (full runs only) to "
            "replace them, or choose another --out"
        )
    return out


def _pick(text: str | None, known: list[str], what: str) -> list[str]:
    if not text:
        return known
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)}")
    return [k for k in known if k in chosen]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .report import write_report

    if args.report_only is not None:
        results = Results.load(args.report_only)
        out = _out_folder(args, results.mode)
        out.mkdir(parents=True, exist_ok=True)
        if out.resolve() != args.report_only.resolve().parent:
            results.save(out / "results.json")
            print(f"wrote {out / 'results.json'}")
        for path in write_report(results, out):
            print(f"wrote {path}")
        return 0

    profile = QUICK if args.quick else FULL
    out = _out_folder(args, profile.name)
    if args.runs is not None:
        if args.runs < 1:
            raise SystemExit("--runs must be at least 1")
        profile = dataclasses.replace(
            profile, runs=args.runs, hold_runs=args.runs, burst_runs=args.runs
        )
    scenarios = [
        s
        for s in SCENARIOS
        if s.key in _pick(args.scenarios, [x.key for x in SCENARIOS], "scenario")
    ]
    peer_keys = _pick(args.peers, [p.key for p in ALL_PEERS], "peer")
    peers = [cls() for cls in ALL_PEERS if cls.key in peer_keys]

    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger().addHandler(_LOGS)
    # A handler of our own also keeps asyncio.run() from installing its own, which would
    # turn Ctrl-C into a cancellation that a shielded release may absorb.
    signal.signal(signal.SIGINT, _Stop.on_sigint)
    signal.signal(signal.SIGTERM, _Stop.on_sigterm)
    results = run(profile, scenarios, peers, engine=args.engine, pin=not args.no_pin)
    json_path = out / "results.json"
    results.save(json_path)
    print(f"wrote {json_path}")
    for path in write_report(results, out):
        print(f"wrote {path}")
    if out == HERE:
        print("replaced the committed results: update the README's Performance section too")
    else:
        print(f"results in {out}/ (a full run with --update replaces the committed ones)")
    failed = results.errors()
    if failed:
        print(f"{len(failed)} measurement(s) failed; see results.md", file=sys.stderr)
    return 0


def run(
    profile: Profile, scenarios: list[Scenario], peers: list[Peer], *, engine: str | None, pin: bool
) -> Results:
    started = time.monotonic()
    ticks = cpu_times()
    pinning = plan_pinning(pin)
    server = start_server(engine, pinning)
    try:
        probe = redis.Redis.from_url(server.url)
        entries = [_entry(peer) for peer in peers]
        print(f"server: {server.engine} {server.version} at {server.url}")
        print(f"pinning: {pinning.note}")
        usable = []
        for peer, entry in zip(peers, entries, strict=True):
            if not entry.skipped:
                entry.skipped = _smoke(peer, server.url)
            if entry.skipped:
                print(f"skipping {peer.key}: {entry.skipped}")
            else:
                usable.append(peer)
        results = Results(
            mode=profile.name,
            profile=profile.describe(),
            environment=environment(server, pinning),
            pinning=pinning.note,
            scenarios=[s.key for s in scenarios],
            titles={s.key: s.title(profile) for s in scenarios},
            families={s.key: s.family for s in scenarios},
            peers=entries,
            started=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        )
        total_runs = max((s.runs(profile) for s in scenarios), default=0)
        for run_index in range(total_runs):
            for scenario in scenarios:
                if run_index >= scenario.runs(profile):
                    continue
                if scenario.together is not None:
                    peers_now = [p for p in usable if p.supports(scenario.family)]
                    if peers_now and not _Stop.requested:
                        ctx = Context(server.url, profile, run_index, probe)
                        for record in _measure_together(scenario, peers_now, ctx):
                            results.records.append(record)
                            _progress(record, scenario, run_index, scenario.runs(profile))
                    continue
                for peer in usable:
                    if not peer.supports(scenario.family) or _Stop.requested:
                        continue
                    ctx = Context(server.url, profile, run_index, probe)
                    record = _measure(scenario, peer, ctx)
                    results.records.append(record)
                    _progress(record, scenario, run_index, scenario.runs(profile))
        if not _Stop.requested:  # the server's share of a cycle, kind by kind
            blocks, per_block = QUICK_BLOCKS if profile.name == "quick" else BLOCKS
            print("server time per cycle of every kind ...")
            spent = asyncio.run(server_time(server.url, blocks, per_block))
            results.server_us, results.server_thread = spent.commands, spent.thread
            results.server_rounds = spent.rounds
            results.server_commands = asyncio.run(count_commands(server.url))
        probe.close()
        results.environment["load"] = load_note(ticks)
        results.interrupted = _Stop.requested
    finally:
        server.stop()
    results.duration_s = time.monotonic() - started
    print(f"done in {results.duration_s:.0f} s")
    return results


def _entry(peer: Peer) -> PeerEntry:
    entry = PeerEntry(
        key=peer.key,
        label=peer.label,
        version="",
        config=peer.config,
        unsupported=dict(peer.unsupported),
    )
    try:
        peer.probe()
    except Exception as exc:
        entry.skipped = f"cannot be imported: {exc!r}"
        entry.version = "not usable"
        return entry
    entry.version = peer.version()
    return entry


def _smoke(peer: Peer, url: str) -> str:
    """One acquire + release (or one small holding) against the server; '' if it worked."""
    try:
        if isinstance(peer, AsyncPeer):
            asyncio.run(_smoke_async(peer, url))
        elif isinstance(peer, ThreadPeer):
            session = peer.open(url)
            try:
                with session.lock("bench:smoke"):
                    pass
            finally:
                session.close()
    except Exception as exc:
        return f"fails against this server and redis-py: {exc!r}"
    return ""


async def _smoke_async(peer: AsyncPeer, url: str) -> None:
    session = await peer.open(url)
    try:
        async with asyncio.timeout(30):
            if peer.supports(CYCLE):
                async with session.lock("bench:smoke"):
                    pass
            if peer.supports(HOLD):
                holding = await session.hold_many(["bench:smoke:1", "bench:smoke:2"], 3.0, 2)
                await holding.release_all()
    finally:
        await session.aclose()


def _measure(scenario: Scenario, peer: Peer, ctx: Context) -> Record:
    assert scenario.measure is not None
    ctx.reset()
    gc.collect()
    began = time.monotonic()
    result: Measurement | Exception
    try:
        result = scenario.measure(peer, ctx)
    except Exception as exc:
        detail = "".join(traceback.format_exception(exc)[-3:]).strip()
        print(f"  {scenario.key} / {peer.key} failed:\n{detail}", file=sys.stderr)
        result = exc
    return _record(scenario, peer, ctx, result, time.monotonic() - began, _LOGS.summary())


def _measure_together(scenario: Scenario, peers: list[Peer], ctx: Context) -> list[Record]:
    """``_measure`` for a scenario whose peers are measured together, taking turns."""
    assert scenario.together is not None
    ctx.reset()
    gc.collect()
    began = time.monotonic()
    try:
        outcome = scenario.together(peers, ctx)
    except Exception as exc:
        detail = "".join(traceback.format_exception(exc)[-3:]).strip()
        print(f"  {scenario.key} failed:\n{detail}", file=sys.stderr)
        outcome = {peer.key: exc for peer in peers}
    seconds = (time.monotonic() - began) / len(peers)
    logged = _LOGS.summary()
    return [
        _record(
            scenario,
            peer,
            ctx,
            outcome.get(peer.key, RuntimeError("not measured")),
            seconds,
            logged,
        )
        for peer in peers
    ]


def _record(
    scenario: Scenario,
    peer: Peer,
    ctx: Context,
    result: Measurement | Exception,
    seconds: float,
    logged: str,
) -> Record:
    record = Record(scenario.key, peer.key, ctx.run)
    if isinstance(result, Exception):
        record.error = f"{result!r}"
    else:
        record.metrics = result.metrics
        record.note = result.note
    record.seconds = seconds
    if logged:
        record.note = f"{record.note}; {logged}" if record.note else logged
    return record


def _progress(record: Record, scenario: Scenario, run_index: int, runs: int) -> None:
    head = f"[{run_index + 1}/{runs}] {scenario.key:<11} {record.peer:<18}"
    if record.error:
        print(f"{head} FAILED: {record.error[:120]}")
        return
    value = record.metrics.get(scenario.headline, math.nan)
    extra = f"  {record.note}" if record.note else ""
    print(f"{head} {scenario.headline}={value:,.1f}  ({record.seconds:.1f} s){extra}", flush=True)
