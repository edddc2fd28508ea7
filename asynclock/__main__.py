"""Command line of asynclock (the ``asynclock`` console script, or ``python -m asynclock``).

- ``asynclock run NAME [--url URL] [--ttl S] [--hold-at-least S] [--wait S] -- CMD ARGS...``
  runs a command under a lease (see ``asynclock._runner``): a ``crontab`` line on every
  machine, of which one runs the command.
- ``asynclock inspect NAME``, ``asynclock list [PATTERN]``, ``asynclock release --force
  NAME``: who holds what, and releasing by hand (see ``asynclock._apps._inspect``); human
  output as an aligned table, ``--json`` for scripts.
- ``--client redis|valkey``: the client library these commands use, redis-py (the default,
  installed with asynclock) or valkey-py (``pip install "asynclock[valkey]"``); chosen,
  not detected: redis-py is always installed, and either talks to Redis and Valkey.
- ``asynclock demo`` runs ``examples/demo`` from a clone of the repository: worker
  processes compete for one lease while the demo kills a holder and deletes the lease key
  from outside.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import __version__
from ._base._urls import safe_url
from ._lifecycle._context import lease
from ._redis._valkey import LIBRARIES, family_named, redis_errors


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _seconds(text: str) -> float:
    """A number of seconds, 0 allowed."""
    if text.strip() == "0":
        return 0.0
    return _positive_float(text)


_RUN_EPILOG = """\
exit status: the command's (128 + N if it died of signal N); --busy-exit (0) when another
holder has the lock (or --wait ran out); 75 when the lease was lost and the command was
stopped (SIGTERM, then SIGKILL after --grace, before the lease's safe deadline); 69 when
Redis could not be reached; 2 for bad usage; 126/127 when the command cannot be run.

a reaper process (Linux) stops the command at the lease's safe deadline even if this
process is stopped, killed or stalled: SIGTERM --grace before it, SIGKILL just before it
(at once, and SIGKILL after --grace, if this process dies).

the command's environment: ASYNCLOCK_FENCING_TOKEN (the lease's fencing token, to fence
its writes with), ASYNCLOCK_LEASE_KEY (the lease's Redis key), ASYNCLOCK_LEASE_TTL (its
TTL in seconds).
"""


def _add_client(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client",
        choices=list(LIBRARIES),
        default="redis",
        help="the client library: redis (redis-py, the default) or valkey (valkey-py, "
        'pip install "asynclock[valkey]"); either talks to Redis and Valkey',
    )


def _add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = commands.add_parser(
        "run",
        help="run a command under a lease (one machine of many runs it)",
        description=(
            "Take the lease NAME and run CMD under it, exiting with its status. Put the "
            "same line in the crontab of every machine: one of them runs the command. "
            "If the lease is lost, the command is stopped before another holder could "
            "take the lock."
        ),
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s NAME [options] -- CMD [ARGS...]",
    )
    run.add_argument("name", metavar="NAME", help="the lock's name")
    run.add_argument(
        "--url",
        default=os.environ.get("REDIS_URL", "redis://localhost:6379/0"),
        help="the Redis server (default: $REDIS_URL, else redis://localhost:6379/0)",
    )
    run.add_argument(
        "--ttl",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="the lease's time to live, renewed every ttl/3 (default 30)",
    )
    run.add_argument(
        "--hold-at-least",
        type=_positive_float,
        default=None,
        metavar="S",
        help="keep the lock taken at least S seconds after it was acquired, even if the "
        "command ends sooner, so a machine whose clock is late by less finds it taken",
    )
    run.add_argument(
        "--wait",
        type=_seconds,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the lock (default 0: do not wait)",
    )
    run.add_argument(
        "--grace",
        type=_positive_float,
        default=None,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when the command must stop "
        "(default ttl/6, at most 10)",
    )
    run.add_argument(
        "--busy-exit",
        type=int,
        default=0,
        metavar="CODE",
        help="exit status when another holder has the lock (default 0)",
    )
    run.add_argument("--prefix", default="asynclock:", help="key prefix (default asynclock:)")
    _add_client(run)
    run.set_defaults(run_parser=run)


_OPS_EPILOG = """\
exit status: 0 done; 1 (release) nothing held to release; 3 (release) not confirmed;
4 (list) the scan ran out of time, the list is partial; 69 Redis could not be reached;
2 bad usage.
"""


def _add_operations(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument(
        "--url",
        default=os.environ.get("REDIS_URL", "redis://localhost:6379/0"),
        help="the Redis server (default: $REDIS_URL, else redis://localhost:6379/0)",
    )
    shared.add_argument(
        "--cluster", action="store_true", help="the URL names a node of a Redis Cluster"
    )
    shared.add_argument("--prefix", default="asynclock:", help="key prefix (default asynclock:)")
    shared.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_client(shared)
    inspect = commands.add_parser(
        "inspect",
        parents=[shared],
        help="who holds a lock, since when, until when, who waits",
        epilog=_OPS_EPILOG,
    )
    inspect.add_argument("name", metavar="NAME", help="the lock's name")
    listing = commands.add_parser(
        "list",
        parents=[shared],
        help="the locks held now (by SCAN, on every primary of a cluster)",
        epilog=_OPS_EPILOG,
    )
    listing.add_argument(
        "pattern", metavar="PATTERN", nargs="?", default="*", help="a glob of names (default *)"
    )
    listing.add_argument(
        "--time-limit",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="stop scanning after S seconds (default 5; the list is then partial, exit 4)",
    )
    listing.add_argument("--all", action="store_true", help="also locks nothing holds now")
    release = commands.add_parser(
        "release",
        parents=[shared],
        help="release a lock by hand: its holder is cancelled at its next renewal",
        description=(
            "Delete the lease of NAME, whoever holds it, and wake its waiters. The "
            "holder finds out at its next renewal (within a third of its TTL): its "
            "block is cancelled with LockLost(not_owner). The fencing counter is kept, "
            "so later holders' tokens still rise."
        ),
        epilog=_OPS_EPILOG,
    )
    release.add_argument("name", metavar="NAME", help="the lock's name")
    release.add_argument(
        "--force", action="store_true", required=True, help="required: this takes a lock away"
    )
    release.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def _check_client(parser: argparse.ArgumentParser, command: str, args: argparse.Namespace) -> None:
    """A ``--client`` whose library is not installed, or a ``--url`` (or ``$REDIS_URL``)
    that it cannot parse, is a usage error (exit 2, before any I/O), the URL shown
    masked."""
    if importlib.util.find_spec(args.client) is None:
        parser.error(
            f"{command}: --client {args.client}: {LIBRARIES[args.client]} is not installed "
            f'(pip install "asynclock[{args.client}]")'
        )
    try:
        family_named(args.client).parse_url(args.url)
    except ValueError as exc:
        parser.error(f"{command}: --url {safe_url(args.url)}: {exc}")


def _client(args: argparse.Namespace) -> Any:
    """A client of ``--url`` made with the library of ``--client`` (its cluster client
    with ``--cluster``); seconds: 5 to connect and for each reply."""
    family = family_named(args.client)
    if args.cluster:
        return family.cluster.from_url(args.url, socket_timeout=5.0)
    return family.client.from_url(args.url, socket_timeout=5.0, socket_connect_timeout=5.0)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _show(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{key} {_show(left)}" for key, left in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


async def _operate(args: argparse.Namespace) -> int:
    """``inspect``, ``list`` or ``release``: the exit status (see ``_OPS_EPILOG``)."""
    client = _client(args)
    try:  # (a valkey-py client's errors as redis-py's too: see _redis._valkey)
        return await redis_errors(_operate_on(client, args))
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        where = f"asynclock {args.subcommand}: cannot reach Redis at {safe_url(args.url)}"
        print(f"{where}: {exc}", file=sys.stderr)
        return 69
    except RedisError as exc:  # (refused: NOAUTH, NOPERM, a wrong type, ...)
        where = f"asynclock {args.subcommand}: Redis at {safe_url(args.url)}"
        print(f"{where} said: {exc}", file=sys.stderr)
        return 69
    finally:
        await client.aclose()


async def _operate_on(client: Any, args: argparse.Namespace) -> int:
    from ._apps._inspect import inspect, list_locks

    if args.subcommand == "inspect":
        info = await inspect(client, args.name, prefix=args.prefix)
        if args.json:
            print(json.dumps(info.as_dict()))
        else:
            print(_table([[key, _show(value)] for key, value in info.as_dict().items()]))
        return 0
    if args.subcommand == "list":
        infos, complete = await list_locks(
            client,
            args.pattern,
            prefix=args.prefix,
            time_limit=args.time_limit,
            held_only=not args.all,
        )
        if args.json:
            print(json.dumps({"locks": [i.as_dict() for i in infos], "complete": complete}))
        else:
            rows = [["NAME", "KIND", "HOLDER", "FENCE", "TIME LEFT", "WAITERS"]]
            for i in infos:
                fence, left = _show(i.fencing_token), _show(i.time_left)
                rows.append([i.name, i.kind, _show(i.holder), fence, left, str(i.waiters)])
            print(_table(rows))
            if not complete:
                print("(partial: the scan ran out of time; see --time-limit)")
        return 0 if complete else 4
    return await _release(client, args)


async def _release(client: Any, args: argparse.Namespace) -> int:
    from ._apps._inspect import force_release, inspect

    info = await inspect(client, args.name, prefix=args.prefix)
    if not info.held:
        print(f"asynclock release: {args.name!r} is not held", file=sys.stderr)
        return 1
    if not args.yes:
        question = (
            f"release {args.name!r} ({info.kind}, holder {_show(info.holder)}, fencing "
            f"token {_show(info.fencing_token)})? The holder is cancelled. [y/N] "
        )
        # On stderr (stdout may be --json), read here: nothing else runs on the loop
        # meanwhile (input() in a thread would be waited for at exit), with Python's
        # own SIGINT handler, so that Ctrl-C interrupts the read at once (asyncio's
        # only cancels the task, which the read does not see).
        # (the handler first: a Ctrl-C right after the question must interrupt too)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            print(question, end="", file=sys.stderr, flush=True)
            answer = sys.stdin.readline()  # ("" without a terminal)
        except KeyboardInterrupt:
            answer = ""
            print(file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous)
        if answer.strip().lower() not in ("y", "yes"):
            print("not released", file=sys.stderr)
            return 3
    # (only the holder that was shown: another may have taken the lock since)
    holder = info.fencing_token if info.kind == "mutex" else None
    deleted = await force_release(client, args.name, prefix=args.prefix, fencing_token=holder)
    if deleted is None:
        print(
            f"asynclock release: {args.name!r} changed holders since; nothing released",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps({"released": args.name, "keys_deleted": deleted}))
    else:
        print(f"released {args.name!r} ({deleted} key(s) deleted); waiters woken")
    return 0


def _add_acl(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    acl = commands.add_parser(
        "acl",
        help="print the ACL rules a Redis user of asynclock needs (least privilege)",
        description=(
            "Print the ACL SETUSER command and the ACL file line for a user that may do "
            "what asynclock does and nothing else: its keys and channels under the "
            "prefix, and every command it sends, those its Lua scripts call included "
            "(Redis 7 checks those against the user too)."
        ),
    )
    acl.add_argument("--prefix", default="asynclock:", help="key prefix (default asynclock:)")
    acl.add_argument("--cluster", action="store_true", help="for a Redis Cluster (sharded pub/sub)")
    acl.add_argument(
        "--readonly",
        action="store_true",
        help="only what inspect and list need (an operator's account)",
    )
    acl.add_argument("--user", default="asynclock", help="the user's name (default asynclock)")


def _acl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._apps._acl import render

    try:
        text = render(args.prefix, cluster=args.cluster, readonly=args.readonly, user=args.user)
    except (TypeError, ValueError) as exc:
        parser.error(f"acl: {exc}")
    print(text, end="")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asynclock",
        description="asynclock: distributed leases on Redis for asyncio.",
    )
    parser.add_argument("--version", action="version", version=f"asynclock {__version__}")
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    _add_run(commands)
    _add_operations(commands)
    _add_acl(commands)
    if _demo_available():  # (listed only where it runs; elsewhere _demo() says why)
        commands.add_parser(
            "demo",
            help="worker processes compete for one lease; a holder is killed, a key "
            "deleted (from a clone of the repository: examples/demo)",
            add_help=False,
        )
    return parser


def _run(args: argparse.Namespace, command: list[str]) -> int:
    from ._apps._runner import RunConfig, run_command

    parser: argparse.ArgumentParser = args.run_parser
    if not command:
        parser.error("run: give the command after --, e.g. asynclock run NAME -- make report")
    if not args.name:
        parser.error("run: NAME must not be empty")
    if args.grace is not None and args.grace >= args.ttl / 3:
        parser.error(
            "run: --grace must be shorter than ttl/3 (the command is stopped "
            "between a failing renewal and the lease's safe deadline)"
        )
    if not 0 <= args.busy_exit <= 255:
        parser.error("run: --busy-exit must be between 0 and 255")
    config = RunConfig(
        name=args.name,
        command=command,
        url=args.url,
        ttl=args.ttl,
        hold_at_least=args.hold_at_least,
        wait=args.wait,
        grace=args.grace,
        busy_exit=args.busy_exit,
        prefix=args.prefix,
        client=args.client,
    )
    try:  # (checked before any I/O: a bad name or prefix is a usage error)
        lease(Redis(), config.name, ttl=config.ttl, prefix=config.prefix)
    except (TypeError, ValueError) as exc:
        parser.error(f"run: {exc}")
    _check_client(parser, "run", args)
    return asyncio.run(run_command(config))


def _demo_available() -> bool:
    """Whether ``examples.demo`` can be imported: in a clone of the repository, not from
    an installed package (the demo is not part of it)."""
    try:
        return importlib.util.find_spec("examples.demo") is not None
    except ImportError:  # (no package ``examples`` at all)
        return False


def _demo(argv: list[str]) -> int:
    """``asynclock demo ARGS``: the demo is not part of the package (it lives beside it,
    in ``examples/demo``, and uses the public API only); run it from a clone."""
    try:  # (looked up at run time: the package itself never depends on its examples)
        demo_main = importlib.import_module("examples.demo.__main__").main
    except ImportError:
        print(
            "asynclock demo: the demo lives in asynclock's source repository, not in the "
            "package: in a clone, run ./dev demo (or python -m examples.demo)",
            file=sys.stderr,
        )
        return 2
    return int(demo_main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    command: list[str] = []
    if argv[:1] == ["run"] and "--" in argv:  # (what follows -- is the command's)
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    args = parser.parse_args(argv)
    if args.subcommand == "run":
        return _run(args, command)
    if args.subcommand in ("inspect", "list", "release"):
        try:  # (checked before any I/O: a bad name or prefix is a usage error)
            lease(Redis(), getattr(args, "name", "x"), prefix=args.prefix)
        except (TypeError, ValueError) as exc:
            parser.error(f"{args.subcommand}: {exc}")
        _check_client(parser, args.subcommand, args)
        return asyncio.run(_operate(args))
    if args.subcommand == "acl":
        return _acl(args, parser)
    return 2  # (unreachable: argparse knows only these commands)


if __name__ == "__main__":
    sys.exit(main())
