"""``python -m examples.demo`` (``./dev demo``, or ``asynclock demo`` in a clone): worker
processes compete for one lease, then a holder is killed and the lease key deleted."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from examples.demo import DemoConfig, run_demo


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    demo = argparse.ArgumentParser(
        prog="asynclock demo",
        description=(
            "Start a private Redis/Valkey server (unless --url is given) and worker "
            "processes that take turns holding one lease. A third into the run the holder "
            "is killed with SIGKILL and the others take over once its key expires; two "
            "thirds in, the lease key is deleted from outside and the holder's work is "
            "cancelled with LockLost. Prints a timeline and a summary; the exit status is "
            "0 when everything happened as expected."
        ),
    )
    demo.add_argument(
        "--url",
        help="use the Redis server at this URL instead of starting a private one "
        "(the demo only touches the keys of its lease)",
    )
    demo.add_argument(
        "--workers", type=int, default=4, metavar="N", help="worker processes (default 4)"
    )
    demo.add_argument(
        "--seconds",
        type=_positive_float,
        default=20.0,
        metavar="S",
        help="length of the run before the workers are stopped (default 20)",
    )
    demo.add_argument(
        "--ttl",
        type=_positive_float,
        default=1.5,
        metavar="S",
        help="the lease's time to live in seconds (default 1.5)",
    )
    demo.add_argument("--name", default="demo", help="the lock's name (default 'demo')")
    return demo


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.workers < 2:
        parser.error("--workers must be at least 2 (someone has to take over)")
    if args.workers > 32:
        parser.error("--workers must be at most 32")
    if not 0.1 <= args.ttl <= 10:
        parser.error("--ttl must be between 0.1 and 10 seconds")
    if args.seconds < 6 * args.ttl:
        parser.error(f"--seconds must be at least 6 x ttl ({6 * args.ttl:g}s) for the scenario")
    if not args.name:
        parser.error("--name must not be empty")
    config = DemoConfig(
        url=args.url,
        workers=args.workers,
        seconds=args.seconds,
        ttl=args.ttl,
        name=args.name,
    )
    return run_demo(config)


if __name__ == "__main__":
    sys.exit(main())
