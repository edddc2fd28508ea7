"""``python -m examples.jobqueue chaos --jobs N --workers W --seconds S --seed K``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from .chaos import ChaosConfig, run_chaos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.jobqueue")
    commands = parser.add_subparsers(dest="command", required=True)
    chaos = commands.add_parser("chaos", help="drain a queue under faults, then count")
    chaos.add_argument("--jobs", type=int, default=200)
    chaos.add_argument("--workers", type=int, default=4)
    chaos.add_argument("--seconds", type=float, default=20.0)
    chaos.add_argument("--seed", type=int, default=1)
    chaos.add_argument(
        "--fail-rate",
        type=float,
        default=0.1,
        help="chance that a job's first attempts fail (retried)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.workers < 1 or args.seconds < 0:
        parser.error("--jobs and --workers must be at least 1, --seconds not negative")
    config = ChaosConfig(
        jobs=args.jobs,
        workers=args.workers,
        seconds=args.seconds,
        seed=args.seed,
        fail_rate=args.fail_rate,
        redis_url=os.environ.get("REDIS_URL"),
        database_url=os.environ.get("DATABASE_URL"),
    )
    result = asyncio.run(run_chaos(config))
    print(
        f"jobs={result['jobs']} completed={result['completed']} effects={result['effects']} "
        f"duplicate_effects={result['duplicate_effects']} lost={result['lost']}"
        + (f" dead={result['dead']}" if result["dead"] else "")
    )
    ok = (
        result["duplicate_effects"] == 0
        and result["lost"] == 0
        and result["completed"] + result["dead"] == result["jobs"]
        and result["effects"] == result["completed"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
