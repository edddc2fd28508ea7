"""``python -m chaos [--workers N] [--tasks N] [--seconds S] [--seed N] ...``:
the chaos run."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from ._run import FAILOVERS, ChaosConfig, new_seed, print_schedule, run
from ._soak import soak


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m chaos",
        description=(
            "Worker processes (each running a few contending tasks on one Redis client) "
            "contend for a few asynclock leases on a private Redis server, "
            "through a fault-injecting proxy, while a seeded nemesis injects faults (proxy "
            "delay, blackhole and reset, server stall, CLIENT KILL, FLUSHALL, restart "
            "without persistence, SIGSTOP of a holder). Then everything is healed, the "
            "workers stop, and every check runs. Prints one summary; exit status 0 when "
            "every must-be-0 figure is 0 and no worker died, 1 otherwise (with the command "
            "that replays the seed), 2 when the run could not be carried out."
        ),
    )
    parser.add_argument(
        "--workers", type=int, default=4, metavar="N", help="worker processes (default 4)"
    )
    parser.add_argument(
        "--tasks",
        type=int,
        default=2,
        metavar="N",
        help="contenders per worker process, sharing its one Redis client, so that a "
        "release can hand the lock to a waiter of the same client (default 2)",
    )
    parser.add_argument(
        "--seconds",
        type=_seconds,
        default=20.0,
        metavar="S",
        help="length of the run, faults included (default 20)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, metavar="N", help="seed (default: random, printed)"
    )
    parser.add_argument(
        "--locks", type=int, default=3, metavar="N", help="locks contended for (default 3)"
    )
    parser.add_argument(
        "--ttl", type=_seconds, default=0.8, metavar="S", help="lease TTL in seconds (default 0.8)"
    )
    parser.add_argument(
        "--engine",
        choices=("redis", "valkey"),
        default=None,
        help="server engine (default: redis-server if installed, else valkey)",
    )
    parser.add_argument("--json", action="store_true", help="also print the summary as JSON")
    parser.add_argument(
        "--keep", action="store_true", help="keep the history and fenced store when it passes"
    )
    parser.add_argument("--sabotage", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--detached",
        type=float,
        default=0.0,
        metavar="F",
        help="share of rounds (0 to 1) holding the lease with acquire(), guard() and "
        "release() instead of async with lease() (default 0)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=1,
        metavar="N",
        help="the semaphore mode: each lock is a semaphore of N permits, held with "
        "lease(..., limit=N); checked per permit, and no lock may have more than N "
        "unpaused holders at once (default 1: mutexes)",
    )
    parser.add_argument(
        "--failover",
        action="store_true",
        help="the failover mode: a primary and a replica; the only fault is a failover "
        "(SIGKILL of the primary right after a grant, the replica promoted, the workers' "
        "proxies repointed, a new replica started); leases use --min-replicas",
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        metavar="N",
        help="the leases' min_replicas in the failover mode (default 1; 0 shows the double "
        "grant a failover causes without it)",
    )
    parser.add_argument(
        "--failovers",
        type=int,
        default=None,
        metavar="N",
        help=f"failovers the failover mode schedules (default {FAILOVERS}; fewer when the "
        "run is too short: each needs about 4.6 TTLs)",
    )
    parser.add_argument(
        "--shared",
        type=float,
        default=0.0,
        metavar="F",
        help="the shared mode: the share of rounds (0 to 1) holding lease(..., shared=True) "
        "beside exclusive ones; no exclusive holder may overlap any other, and an exclusive "
        "waiter must get in unless another exclusive holder or a fault was in its way",
    )
    parser.add_argument(
        "--fair",
        action="store_true",
        help="the fair mode: every lease is fair=True; the nemesis also stops waiters "
        "(waiter_stop) and leaves out the faults that silence live waiters; grants must "
        "follow arrival among live waiters, and a dead waiter delay the queue within bound",
    )
    parser.add_argument(
        "--redlock",
        type=int,
        default=0,
        metavar="N",
        help="the Redlock mode: N independent servers (3 or 5), every lease held on a "
        "majority; the nemesis pauses, cuts off, kills and restarts (without persistence) "
        "one server at a time, and stops holders",
    )
    parser.add_argument(
        "--jobs",
        nargs="?",
        const="once",
        default=None,
        choices=("once", "fenced", "every", "run"),
        metavar="KIND",
        help="the jobs mode: KIND once (the default): every round calls once() for a job "
        "key of the moment; the callers of a key must all get one result (stored once), "
        "its runs never overlap. fenced: once() whose job applies an effect through the "
        "fence, runners killed (SIGKILL, restarted) and stopped; no effect applied twice, "
        "one result per key. every: every() in processes whose clocks are skewed by up to "
        "a quarter period (4 TTLs); each tick runs once. run: asynclock run commands on "
        "several machines (half ignoring SIGTERM), machines stopped, the server restarted; "
        "the commands' own intervals never overlap",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="the cluster mode: a Redis Cluster of 3 primaries with a replica each, workers "
        "on RedisCluster clients; the nemesis migrates the leased slots, kills primaries "
        "(replica promoted) and stops holders; leases use --min-replicas (default 1)",
    )
    parser.add_argument(
        "--soak",
        type=_seconds,
        default=None,
        metavar="MINUTES",
        help="the soak: rotate every mode (mutex, semaphore, shared, fair, failover, "
        "redlock, jobs, cluster, jobs fenced, jobs every, jobs run; every second pass "
        "with --detached 0.5) for MINUTES, run i with seed SEED + i, and print one table; "
        "--workers, --tasks, --ttl, --engine and --keep apply to every run",
    )
    parser.add_argument(
        "--print-schedule",
        action="store_true",
        help="print the faults the seed schedules, and exit without running",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run (or print the schedule); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not 2 <= args.workers <= 32:
        parser.error("--workers must be between 2 and 32")
    if not 1 <= args.tasks <= 16:
        parser.error("--tasks must be between 1 and 16")
    if not 0.0 <= args.detached <= 1.0:
        parser.error("--detached must be between 0 and 1")
    if not 1 <= args.locks <= 64:
        parser.error("--locks must be between 1 and 64")
    if not 1 <= args.limit <= 64:
        parser.error("--limit must be between 1 and 64")
    if not 0.1 <= args.ttl <= 10:
        parser.error("--ttl must be between 0.1 and 10 seconds")
    if args.seconds > 86_400:
        parser.error("--seconds must be at most a day")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        parser.error("--seed must be between 0 and 2**63 - 1")
    if not args.failover and args.failovers is not None:
        parser.error("--failovers needs --failover")
    if not (args.failover or args.cluster) and args.min_replicas is not None:
        parser.error("--min-replicas needs --failover or --cluster")
    min_replicas = 1 if args.min_replicas is None else args.min_replicas
    if not 0 <= min_replicas <= 1:
        parser.error("--min-replicas must be 0 or 1 (the run has one replica)")
    if args.redlock not in (0, 3, 5):
        parser.error("--redlock must be 3 or 5 (servers)")
    if not 0.0 <= args.shared <= 1.0:
        parser.error("--shared must be between 0 and 1")
    modes = [
        m
        for m, on in (
            ("--shared", args.shared > 0),
            ("--fair", args.fair),
            ("--failover", args.failover),
            ("--limit", args.limit > 1),
            ("--redlock", args.redlock > 0),
            ("--jobs", args.jobs is not None),
            ("--cluster", args.cluster),
        )
        if on
    ]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} are separate modes: choose one")
    failovers = FAILOVERS if args.failovers is None else args.failovers
    if not 1 <= failovers <= 100:
        parser.error("--failovers must be between 1 and 100")
    if args.soak is not None:
        if modes or args.detached or args.sabotage or args.print_schedule:
            parser.error("--soak chooses the modes itself: give no mode, --detached or --sabotage")
        if args.soak > 24 * 60:
            parser.error("--soak must be at most a day")
        base = ChaosConfig(
            seed=0,
            workers=args.workers,
            tasks=args.tasks,
            ttl=args.ttl,
            engine=args.engine,
            keep=args.keep,
        )
        seed = new_seed() if args.seed is None else args.seed
        return soak(seed, args.soak, base, as_json=args.json)
    config = ChaosConfig(
        seed=new_seed() if args.seed is None else args.seed,
        workers=args.workers,
        tasks=args.tasks,
        seconds=args.seconds,
        locks=args.locks,
        ttl=args.ttl,
        engine=args.engine,
        keep=args.keep,
        sabotage=args.sabotage,
        detached=args.detached,
        limit=args.limit,
        failover=args.failover,
        min_replicas=min_replicas if args.failover or args.cluster else 0,
        failovers=failovers,
        shared=args.shared,
        fair=args.fair,
        redlock=args.redlock,
        jobs=args.jobs == "once",
        jobs_mode=args.jobs if args.jobs not in (None, "once") else "",
        cluster=args.cluster,
    )
    if args.print_schedule:
        print_schedule(config)
        return 0
    return run(config, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
