"""Least privilege (issue 32): ``asynclock acl`` prints the ACL rules a user needs, derived
from the code, and the contract holds under a user made from exactly those rules (every
kind, once(), every(), waiters woken by pub/sub, the CLI), with nothing refused on the
way (``ACL LOG`` empty); a user without one of the rules gets an error that names it
at once, and a renewal refused by the ACL loses the lease at once, not at its deadline."""

from __future__ import annotations

import ast
import asyncio
import importlib
import pkgutil
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from deployments import SERVICE, SentinelProcess, cluster_nodes, sentinel_ready, synced_replica
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import NoPermissionError
from test_operate import _cli

import asynclock
from asynclock import AcquireTimeout, LeaseEventKind, LockBusy, LockLost, LossReason
from asynclock._apps import _acl
from asynclock._redis._scripts import Script
from asynclock.testing import RedisServer, available_engines, keys_left

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asynclock"
USER, PASSWORD = "locker", "s3cret-pw"
ENGINES = list(available_engines())

pytestmark = pytest.mark.skipif(not ENGINES, reason="needs a server binary")


def acl_setuser(*options: str) -> list[str]:
    """The ``ACL SETUSER`` command that ``asynclock acl OPTIONS`` prints, as arguments,
    for USER with PASSWORD."""
    out = subprocess.run(
        [sys.executable, "-m", "asynclock", "acl", "--user", USER, *options],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=ROOT,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("ACL SETUSER ")]
    assert len(lines) == 1, out
    file_lines = [line for line in out.splitlines() if line.startswith(f"user {USER} ")]
    assert len(file_lines) == 1, out
    words = lines[0].split()
    assert words[:5] == ["ACL", "SETUSER", USER, "on", ">PASSWORD"], words
    assert file_lines[0].split()[4:] == words[5:]  # (the ACL file's line: the same rules)
    return [*words[:4], f">{PASSWORD}", *words[5:]]


def create_user(server: RedisServer, command: list[str]) -> None:
    reply = server.command(*command)
    assert reply == b"+OK\r\n", reply
    server.command("ACL", "LOG", "RESET")


def user_url(server: RedisServer, user: str = USER) -> str:
    scheme, rest = server.url.split("://", 1)
    return f"{scheme}://{user}:{PASSWORD}@{rest}"


async def acl_refusals(server: RedisServer, url: str | None = None, **kwargs: Any) -> list[str]:
    """What the server's ACL refused since the log was reset (``object (reason, context)``),
    but for what asynclock leaves out of its rules on purpose (``_acl.TOLERATED``)."""
    admin = Redis.from_url(url or server.url, **kwargs)
    try:
        entries = await admin.acl_log()
    finally:
        await admin.aclose()
    refused = []
    for entry in entries:
        item = {_text(k): _text(v) for k, v in entry.items()}
        if item["object"] not in _acl.TOLERATED:
            refused.append(
                f"{item['object']} ({item['reason']}, {item['context']}, {item['username']})"
            )
    return refused


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- the rules against the code -----------------------------------------------------------


def _all_modules() -> Iterator[Any]:
    for info in pkgutil.walk_packages([str(PACKAGE)], "asynclock."):
        if info.name.startswith("asynclock.__main__"):
            continue
        yield importlib.import_module(info.name)


def test_every_script_of_asynclock_is_counted() -> None:
    """Every Script defined anywhere in asynclock is among those the rules are made from,
    and no source file calls Redis from Lua outside a Script that the rules count."""
    counted = {id(s) for s in _acl.scripts()}
    found = {}
    for module in _all_modules():
        for value in vars(module).values():
            if isinstance(value, Script):
                found[id(value)] = f"{module.__name__}: {value.name}"
    missing = [where for key, where in found.items() if key not in counted]
    assert not missing, f"scripts the ACL rules do not count: {missing}"
    assert len(found) >= 15
    # (a Lua source outside a Script object, e.g. sent with EVAL by hand, is caught here)
    rules = set(_acl.acl_rules()) | set(_acl.acl_rules(cluster=True))
    for path in PACKAGE.rglob("*.py"):
        for command in re.findall(r"""redis\.p?call\(\s*['"]([A-Za-z]+)""", path.read_text()):
            assert f"+{command.lower()}" in rules, f"{path.name} calls {command}"


def test_a_script_calling_a_command_the_rules_leave_out_fails_the_check() -> None:
    """The check reads each script's commands from its source: a script that calls one
    more command needs one more rule, and a call whose command is not a literal is
    refused rather than guessed."""
    base = set(_acl.acl_rules())
    extra = Script("extra", "redis.call('GET', KEYS[1]) return redis.pcall('LPUSH', KEYS[1], 1)")
    assert _acl.script_commands(extra.source) == {"get", "lpush"}
    assert "+lpush" not in base
    with pytest.raises(ValueError, match="not a string literal"):
        _acl.script_commands("local c = 'GET' return redis.call(c, KEYS[1])")


_CLIENTS = {"redis", "client", "node", "pipe", "cluster", "target", "observer"}


async def test_every_command_the_python_code_sends_is_declared(redis: Redis) -> None:
    """As far as the source shows: command names given as literals (``pack``,
    ``send_command``, tuples such as ``("WAIT", n, ms)``) and redis-py command methods
    called on a client (``redis.set``, ``pipe.pttl``, ``client.script_load``) are all
    declared in ``_acl`` (sent and in the rules, or left out on purpose and said why)."""
    table = await redis.command_list()
    commands = {_text(name).lower() for name in table}
    assert {"get", "evalsha", "config"} <= commands
    declared = set(_acl.DIRECT) | set(_acl.CLUSTER) | set(_acl.TOLERATED)
    found: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "testing" or path.name == "_acl.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if text.isupper() and text.isalpha() and text.lower() in commands:
                    found.setdefault(text.lower(), f"{path.name}:{node.lineno}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in _CLIENTS
            ):
                name = _command_of(node.func.attr, commands)
                if name is not None:
                    found.setdefault(name, f"{path.name}:{node.lineno}")
    undeclared = {name: where for name, where in found.items() if name not in declared}
    assert not undeclared, f"commands sent but not declared in _acl: {undeclared}"
    # (the scan sees what it should: a few that are known to be sent)
    assert {"hdel", "wait", "set", "del", "scan", "script|load"} <= found.keys()


def _command_of(method: str, commands: set[str]) -> str | None:
    """The command a redis-py client method sends, if it is one."""
    if method == "delete":
        return "del"
    if method in commands:
        return method
    head, _, tail = method.partition("_")
    if tail and head in _CONTAINERS and tail.isalpha():
        return f"{head}|{tail}"
    return None


# Commands with subcommands, which redis-py's methods name as ``<command>_<subcommand>``.
_CONTAINERS = {"acl", "client", "cluster", "command", "config", "function", "memory", "object"}
_CONTAINERS |= {"pubsub", "script", "slowlog", "xinfo", "latency", "module"}


def test_the_rules_for_each_use() -> None:
    plain = _acl.acl_rules("jobs:")
    assert plain[:5] == ["resetkeys", "resetchannels", "-@all", "~jobs:*", "&jobs:*"]
    assert {"+evalsha", "+eval", "+publish", "+subscribe", "+pexpire", "+zadd"} <= set(plain)
    assert not {"+spublish", "+ssubscribe", "+keys", "+flushall", "+config"} & set(plain)
    sharded = _acl.acl_rules("jobs:", cluster=True)
    assert {"+spublish", "+ssubscribe", "+sunsubscribe", "+asking", "+cluster|slots"} <= set(
        sharded
    )
    assert not {"+publish", "+subscribe"} & set(sharded)
    readonly = _acl.acl_rules("jobs:", readonly=True)
    assert "&jobs:*" not in readonly  # (no channels)
    writes = {"+set", "+del", "+pexpire", "+hset", "+zadd", "+publish", "+hdel", "+zrem"}
    assert not writes & set(readonly)
    assert {"+evalsha", "+scan", "+get", "+pttl"} <= set(readonly)
    assert _acl.acl_rules("a*b?:")[3] == r"~a\*b\?:*"
    for bad in ("with space:", "tab\t", "{x}"):
        with pytest.raises(ValueError, match="prefix"):
            _acl.acl_rules(bad)
    with pytest.raises(TypeError, match="prefix"):
        _acl.acl_rules(b"bytes:")  # type: ignore[arg-type]


async def test_acl_command_line_errors() -> None:
    code, _, err = await _cli("acl", "--prefix", "has space:")
    assert code == 2
    assert "prefix" in err
    code, out, _ = await _cli("acl", "--readonly", "--cluster")
    assert code == 0
    assert "+cluster|slots" in out
    assert "+set" not in out.split()


# -- the contract under the user -----------------------------------------------------------


async def exercise(url: str | Callable[..., Redis], prefix: str, **kwargs: Any) -> None:
    """The contract, briefly, through clients of ``url`` (or made by calling it with
    settings; ``kwargs``: more settings for them): every kind, renewals, a waiter woken
    by pub/sub, a waiter that gives up, the overflow pool, once(), forget(), every(),
    inspect(), statistics(), extend() and is_held(verify=True). Nothing is left behind."""
    if isinstance(url, str):
        make: Callable[..., Redis] = partial(Redis.from_url, url, **kwargs)
    else:
        make = partial(url, **kwargs)
    a = make()
    b = make(decode_responses=True)
    small = make(max_connections=4)
    try:
        renewed = asyncio.Event()

        def on_event(event: asynclock.LeaseEvent) -> None:
            if event.kind is LeaseEventKind.RENEWED:
                renewed.set()

        async with asynclock.lease(a, "m", ttl=1.5, prefix=prefix, on_event=on_event) as held:
            with pytest.raises(LockBusy):
                async with asynclock.lease(b, "m", blocking=False, prefix=prefix):
                    pass
            async with asyncio.timeout(10):
                await renewed.wait()  # (by the watchdog, on its own connection)
            assert await held.is_held(verify=True)
            await held.extend()
            info = await asynclock.inspect(b, "m", prefix=prefix)
            assert (info.kind, info.fencing_token) == ("mutex", held.fencing_token)
            assert held.state is asynclock.LeaseState.HELD

        # a waiter of another client, woken by the release's publication (TTL 30 s)
        entered = asyncio.Event()

        async def holder() -> None:
            async with asynclock.lease(a, "w", ttl=30, prefix=prefix):
                entered.set()
                await asyncio.sleep(0.3)

        async def waiter() -> float:
            await entered.wait()
            started = time.monotonic()
            async with asynclock.lease(b, "w", ttl=30, prefix=prefix):
                return time.monotonic() - started

        async with asyncio.timeout(20):
            _, waited = await asyncio.gather(holder(), waiter())
        assert waited < 5.0, waited

        # a waiter that gives up, and one cancelled while it waits
        async with asynclock.lease(a, "g", ttl=10, prefix=prefix):
            with pytest.raises(AcquireTimeout):
                async with asynclock.lease(b, "g", blocking_timeout=0.3, prefix=prefix):
                    pass
            task = asyncio.ensure_future(_enter(b, "g", prefix))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        # semaphore, shared (and an exclusive waiter), fair
        async with (
            asynclock.lease(a, "sem", limit=2, prefix=prefix),
            asynclock.lease(b, "sem", limit=2, prefix=prefix),
        ):
            with pytest.raises(LockBusy):
                async with asynclock.lease(a, "sem", limit=2, blocking=False, prefix=prefix):
                    pass
            assert (await asynclock.statistics(a, "sem", prefix=prefix)).permits_in_use == 2
        async with (
            asynclock.lease(a, "rw", shared=True, prefix=prefix),
            asynclock.lease(b, "rw", shared=True, prefix=prefix),
        ):
            assert (await asynclock.statistics(b, "rw", prefix=prefix)).shared_holders == 2
            with pytest.raises(AcquireTimeout):  # (an exclusive waiter of a third client)
                async with asynclock.lease(small, "rw", blocking_timeout=0.3, prefix=prefix):
                    pass
        async with asynclock.lease(a, "fair", fair=True, ttl=30, prefix=prefix):
            fair_waiter = asyncio.ensure_future(_enter(b, "fair", prefix, fair=True))
            await asyncio.sleep(0.2)
        async with asyncio.timeout(10):
            await fair_waiter

        # once(), forget(), every()
        async def job() -> int:
            return 42

        assert await asynclock.once(a, "job", job, prefix=prefix) == 42
        assert await asynclock.once(b, "job", job, prefix=prefix) == 42  # (stored)
        assert await asynclock.forget(a, "job", prefix=prefix)
        runs = asyncio.Event()
        count = 0

        async def tick() -> None:
            nonlocal count
            count += 1
            if count == 2:
                runs.set()

        ticking = asyncio.ensure_future(asynclock.every(a, "tick", 0.3, tick, prefix=prefix))
        try:
            async with asyncio.timeout(10):
                await runs.wait()
        finally:
            ticking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await ticking

        # a burst larger than the caller's pool: the overflow goes through asynclock's own
        inside = 0
        all_in = asyncio.Event()

        async def one(i: int) -> None:
            nonlocal inside
            async with asynclock.lease(small, f"burst{i}", ttl=5, prefix=prefix, blocking=False):
                inside += 1
                if inside == 20:
                    all_in.set()
                await all_in.wait()

        async with asyncio.timeout(30):
            await asyncio.gather(*(one(i) for i in range(20)))
    finally:
        for client in (a, b, small):
            await client.aclose()
    observer = make()
    try:
        left = [key for key in await keys_left(observer, prefix) if ":fence" not in key]
        assert [key for key in left if ":tick:" not in key and ":result" not in key] == []
    finally:
        await observer.aclose()


async def _enter(client: Redis, name: str, prefix: str, **options: Any) -> None:
    async with asynclock.lease(client, name, ttl=10, prefix=prefix, **options):
        pass


@pytest.fixture(params=ENGINES)
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    with RedisServer(request.param) as started:
        yield started


async def test_the_contract_holds_under_a_user_with_exactly_the_rules(
    server: RedisServer, prefix: str
) -> None:
    create_user(server, acl_setuser("--prefix", prefix))
    await exercise(user_url(server), prefix)
    assert await acl_refusals(server) == []


async def test_the_command_line_under_the_user(
    server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """``run``, ``inspect``, ``list`` and ``release --force --yes`` under the user; and
    ``inspect``/``list`` under an operator's read-only user, whose release is refused."""
    create_user(server, acl_setuser("--prefix", prefix))
    operator = acl_setuser("--prefix", prefix, "--readonly")
    operator[2] = "operator"
    create_user(server, operator)
    url, readonly = user_url(server), user_url(server, "operator")
    common = ("--prefix", prefix)
    marker = tmp_path / "ran"
    code, _, err = await _cli(
        "run", "job", "--url", url, "--ttl", "1.5", *common, "--", sys.executable, "-c",
        f"import time; time.sleep(1.2); open({str(marker)!r}, 'w').write('x')",
    )  # fmt: skip
    assert (code, marker.read_text()) == (0, "x"), err
    client = Redis.from_url(url)
    try:
        held = await asynclock.acquire(client, "held", ttl=30, prefix=prefix)
        for who in (url, readonly):
            code, out, err = await _cli("inspect", "held", "--json", "--url", who, *common)
            assert code == 0, err
            assert '"kind": "mutex"' in out
            code, out, err = await _cli("list", "--url", who, *common)
            assert code == 0, err
            assert "held" in out
        code, _, err = await _cli("release", "held", "--force", "--yes", "--url", readonly, *common)
        assert code == 69
        assert "permission" in err.lower()
        code, out, err = await _cli("release", "held", "--force", "--yes", "--url", url, *common)
        assert code == 0, err
        with pytest.raises(LockLost):
            await held.release()
    finally:
        await client.aclose()
    # the read-only user was refused its release (ZRANGE, its first write-side command),
    # and nobody anything else
    assert await acl_refusals(server) == ["zrange (command, toplevel, operator)"]


# -- a missing rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("left_out", "named"),
    [
        ("+evalsha", "+evalsha"),  # (refused at the top level: NOPERM names it)
        ("+mget", "+mget"),  # (called by the acquire script, first thing)
        ("+zadd", "+zadd"),  # (the fair lock's queue)
        ("~", "key pattern"),
    ],
)
async def test_a_user_missing_a_rule_is_told_at_once(
    server: RedisServer, prefix: str, left_out: str, named: str
) -> None:
    """The lease is refused at once with an error naming the missing rule (Redis 7.0 does
    not name a command refused inside a script: asynclock finds it in the script by the
    line Redis gives) and pointing at ``asynclock acl``: nothing is held, nothing waits
    for a deadline."""
    command = [w for w in acl_setuser("--prefix", prefix) if not w.startswith(left_out)]
    create_user(server, command)
    client = Redis.from_url(user_url(server))
    holder = Redis.from_url(server.url)  # (the default user: a fair lock to queue for)
    try:
        started = time.monotonic()
        async with asynclock.lease(holder, "x", ttl=10, prefix=prefix):
            with pytest.raises(NoPermissionError) as caught:
                async with asynclock.lease(client, "x", ttl=10, fair=True, prefix=prefix):
                    pass
        assert time.monotonic() - started < 5
        assert named in str(caught.value)
        assert "asynclock acl" in str(caught.value)
    finally:
        await client.aclose()
        await holder.aclose()


async def test_a_user_without_the_channels_is_warned_and_waits_for_the_time_left(
    server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Without ``&<prefix>*`` the waiters' subscription is refused (and the release's
    publication: the release does not complete): a warning names the rule, and a waiter
    still gets the lock, by the holder's time left."""
    command = [w for w in acl_setuser("--prefix", prefix) if not w.startswith("&")]
    create_user(server, command)
    client = Redis.from_url(user_url(server))
    try:
        async with asynclock.lease(client, "x", ttl=1, prefix=prefix):
            waiter = asyncio.ensure_future(_enter(client, "x", prefix))
            await asyncio.sleep(0.2)
        async with asyncio.timeout(10):
            await waiter
    finally:
        await client.aclose()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("channel pattern (&<prefix>*)" in w for w in warnings), warnings
    # (refused: the subscription, and the release script's PUBLISH, so that the release
    # did not complete and the key expired by its TTL, as the release's warning said)
    assert {r.split()[0] for r in await acl_refusals(server)} == {f"{prefix}{{x}}:released"}


async def test_a_renewal_refused_by_the_acl_loses_the_lease_at_once(
    server: RedisServer, prefix: str
) -> None:
    """The user loses ``+pexpire`` (called by the renewal script) and ``+set`` (the
    renewal as one command, on Valkey) while a lease is held: its next renewal is
    refused, and the block is cancelled then, with LockLost whose cause names the rule,
    long before the lease's deadline; never SUSPECT."""
    create_user(server, acl_setuser("--prefix", prefix))
    client = Redis.from_url(user_url(server))
    kinds: list[LeaseEventKind] = []
    try:
        started = time.monotonic()
        with pytest.raises(LockLost) as caught:
            async with asynclock.lease(
                client, "r", ttl=6, prefix=prefix, on_event=lambda e: kinds.append(e.kind)
            ):
                assert server.command("ACL", "SETUSER", USER, "-pexpire", "-set") == b"+OK\r\n"
                await asyncio.sleep(30)
        lost_after = time.monotonic() - started
    finally:
        await client.aclose()
    assert caught.value.reason is LossReason.WATCHDOG_FAILED
    cause = caught.value.__cause__
    assert isinstance(cause, NoPermissionError)
    assert "+pexpire" in str(cause)
    assert "asynclock acl" in str(cause)
    assert 1.5 < lost_after < 4.0  # (the first renewal is due at ttl/3 = 2 s; deadline ~6 s)
    assert LeaseEventKind.RENEW_FAILED not in kinds


# -- Redis Cluster -------------------------------------------------------------------------


@pytest.fixture
def nodes() -> Iterator[list[RedisServer]]:
    with cluster_nodes(3) as servers:
        yield servers


@pytest.fixture
async def cluster_user(nodes: list[RedisServer], prefix: str) -> AsyncIterator[Callable[..., Any]]:
    command = acl_setuser("--prefix", prefix, "--cluster")
    for node in nodes:
        create_user(node, command)
    clients: list[RedisCluster] = []

    def make() -> RedisCluster:
        client = RedisCluster(
            host="127.0.0.1", port=nodes[0].port, username=USER, password=PASSWORD
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


async def test_a_cluster_under_a_user_with_exactly_the_rules(
    nodes: list[RedisServer], cluster_user: Callable[[], RedisCluster], prefix: str
) -> None:
    """Sharded pub/sub (a waiter woken on the lock's node), every kind, once(), and the
    CLI's inspect and list across the primaries, with nothing refused on any node."""
    one, other = cluster_user(), cluster_user()
    entered = asyncio.Event()

    async def holder() -> None:
        async with asynclock.lease(one, "w", ttl=30, prefix=prefix):
            entered.set()
            await asyncio.sleep(0.3)

    async def waiter() -> float:
        await entered.wait()
        started = time.monotonic()
        async with asynclock.lease(other, "w", ttl=30, prefix=prefix):
            return time.monotonic() - started

    async with asyncio.timeout(20):
        _, waited = await asyncio.gather(holder(), waiter())
    assert waited < 5.0, waited
    for name in ("a", "b", "c", "d"):
        async with asynclock.lease(one, name, ttl=1.5, prefix=prefix) as held:
            await asyncio.sleep(0.6)  # (a renewal, at ttl/3)
            assert await held.is_held(verify=True)
    async with asynclock.lease(one, "sem", limit=2, prefix=prefix):
        pass
    async with asynclock.lease(one, "rw", shared=True, prefix=prefix):
        pass
    async with asynclock.lease(one, "fair", fair=True, prefix=prefix):

        async def job() -> int:
            return 7

        assert await asynclock.once(other, "job", job, prefix=prefix) == 7
        url = f"redis://{USER}:{PASSWORD}@127.0.0.1:{nodes[1].port}/0"
        code, out, err = await _cli("list", "--cluster", "--url", url, "--prefix", prefix)
        assert code == 0, err
        assert "fair" in out
    for node in nodes:
        assert await acl_refusals(node) == [], node.port


# -- Sentinel --------------------------------------------------------------------------------


async def test_through_sentinel_under_a_user_with_exactly_the_rules(
    server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """A Sentinel client whose connections to the primary log in as the user (the
    sentinels themselves are asked without one): the contract, nothing refused. (ACLs
    are not replicated: the user is made on the replica too, as after a failover it
    must be there.)"""
    replica = synced_replica(server)
    sentinel = SentinelProcess(server, tmp_path)
    manager = Sentinel([("127.0.0.1", sentinel.port)], socket_timeout=1.0)
    try:
        await sentinel_ready(manager)
        command = acl_setuser("--prefix", prefix)
        create_user(server, command)
        create_user(replica, command)

        def make(**settings: Any) -> Redis:
            client: Redis = manager.master_for(
                SERVICE, username=USER, password=PASSWORD, **settings
            )
            return client

        await exercise(make, prefix)
        assert await acl_refusals(server) == []
    finally:
        sentinel.stop()
        for client in manager.sentinels:
            await client.aclose()
        replica.stop()
