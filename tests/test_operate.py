"""Operating locks (issue 22, A): ``inspect()``, and the ``asynclock inspect | list |
release`` commands run as subprocesses against a real server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from deployments import cluster_nodes
from helpers import SECRET, urls_with_a_secret
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

import asynclock
from asynclock import LockLost, LossReason
from asynclock.testing import RedisServer, ServerInfo

ROOT = Path(__file__).resolve().parents[1]


async def _cli(
    *args: str,
    stdin: str | None = None,
    environ: dict[str, str] | None = None,
    outside: Path | None = None,
) -> tuple[int, str, str]:
    """``python -m asynclock ARGS`` (stdin: what is typed, else none; ``environ``: more
    environment variables, ``REDIS_URL`` unset otherwise; ``outside``: a directory to
    run in without the clone on the path, as an installed package runs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REDIS_URL", None)
    if outside is not None:
        env.pop("PYTHONPATH")
    env.update(environ or {})
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asynclock",
        *args,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=outside,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_inspect_tells_every_kind(client: Redis, prefix: str) -> None:
    before = time.time()
    plain = await asynclock.acquire(client, "orders:1", ttl=30, prefix=prefix)
    permits = [await asynclock.acquire(client, "sem", limit=3, ttl=30, prefix=prefix)]
    permits.append(await asynclock.acquire(client, "sem", limit=3, ttl=30, prefix=prefix))
    reader = await asynclock.acquire(client, "rw", shared=True, ttl=30, prefix=prefix)
    try:
        info = await asynclock.inspect(client, "orders:1", prefix=prefix)
        assert info.held
        assert info.kind == "mutex"
        assert info.fencing_token == plain.fencing_token
        assert info.holder == plain.token[:8]
        assert info.time_left is not None
        assert 25 < info.time_left <= 30
        assert info.acquired_at is not None
        assert before - 5 < info.acquired_at < time.time() + 5
        assert info.last_fencing_token == plain.fencing_token
        assert info.fence_retention is not None
        assert info.fence_retention > 30
        assert info.retention.keys() == {"fence"}
        assert info.retention["fence"] == info.fence_retention
        sem = await asynclock.inspect(client, "sem", prefix=prefix)
        assert (sem.kind, sem.permits_in_use, sem.limit) == ("semaphore", 2, 3)
        assert {"fence", "limit"} <= sem.retention.keys()
        assert sem.fencing_token == max(p.fencing_token for p in permits)
        rw = await asynclock.inspect(client, "rw", prefix=prefix)
        assert (rw.kind, rw.shared_holders, rw.holder) == ("shared", 1, None)
        free = await asynclock.inspect(client, "nobody", prefix=prefix)
        assert (free.held, free.kind, free.time_left, free.fencing_token) == (
            False,
            "free",
            None,
            None,
        )
    finally:
        for lease in (plain, *permits, reader):
            await lease.release()
    with pytest.raises(ValueError, match="name"):
        await asynclock.inspect(client, "", prefix=prefix)


async def test_inspect_tells_how_long_auxiliary_keys_are_kept(
    redis_server: ServerInfo, client: Redis, prefix: str
) -> None:
    async def job() -> int:
        return 1

    assert await asynclock.once(client, "report", job, result_ttl=600, prefix=prefix) == 1
    info = await asynclock.inspect(client, "report", prefix=prefix)
    assert not info.held
    assert {"fence", "result"} <= info.retention.keys()
    result_left = info.retention["result"]
    assert result_left is not None
    assert 590 < result_left <= 600
    common = ("--url", redis_server.url, "--prefix", prefix)
    code, out, _ = await _cli("inspect", "report", "--json", *common)
    assert code == 0
    assert 590 < json.loads(out)["retention"]["result"] <= 600
    code, out, _ = await _cli("inspect", "report", *common)
    assert code == 0
    assert "result 59" in out or "result 600" in out  # (a table: retention  fence ..., result ...)


async def test_release_by_hand_cancels_the_holder_and_wakes_a_waiter(
    redis_server: ServerInfo, make_client: Callable[..., Redis], prefix: str
) -> None:
    """``asynclock release --force --yes NAME``: the holder's block is cancelled at its
    next renewal (LockLost(not_owner)), a waiter of another client gets the lock at once
    (not at the holder's TTL), and the fencing counter is kept (the waiter's token is
    higher)."""
    url = redis_server.url
    holder_client: Redis = make_client(url)
    waiter_client: Redis = make_client(url)
    entered = asyncio.Event()
    tokens: list[int] = []

    async def holder() -> None:
        async with asynclock.lease(holder_client, "job", ttl=3.0, prefix=prefix) as lock:
            tokens.append(lock.fencing_token)
            entered.set()
            await asyncio.Event().wait()

    async def waiter() -> float:
        await entered.wait()
        started = time.monotonic()
        async with asynclock.lease(waiter_client, "job", ttl=30.0, prefix=prefix) as lock:
            tokens.append(lock.fencing_token)
            return time.monotonic() - started

    holding = asyncio.create_task(holder())
    waiting = asyncio.create_task(waiter())
    await entered.wait()
    code, out, err = await _cli(
        "release", "--force", "--yes", "job", "--url", url, "--prefix", prefix
    )
    assert code == 0, err
    assert "released 'job'" in out
    waited = await asyncio.wait_for(waiting, 10)
    assert waited < 2.5, waited  # (the holder's key would have lived 3 s)
    with pytest.raises(LockLost) as lost:
        await asyncio.wait_for(holding, 10)
    assert lost.value.reason is LossReason.NOT_OWNER
    assert tokens[1] > tokens[0]


async def test_the_commands_exit_codes_and_output(
    redis_server: ServerInfo, client: Redis, prefix: str
) -> None:
    url = redis_server.url
    lease = await asynclock.acquire(client, "orders:7", ttl=30, prefix=prefix)
    try:
        common = ("--url", url, "--prefix", prefix)
        code, out, _ = await _cli("inspect", "orders:7", "--json", *common)
        assert code == 0
        assert json.loads(out)["fencing_token"] == lease.fencing_token
        code, out, _ = await _cli("inspect", "orders:7", *common)
        assert code == 0
        assert "holder" in out
        assert lease.token[:8] in out
        code, out, _ = await _cli("list", *common)
        assert code == 0
        header, row = out.splitlines()[:2]
        assert header.split() == ["NAME", "KIND", "HOLDER", "FENCE", "TIME", "LEFT", "WAITERS"]
        assert row.split()[:4] == ["orders:7", "mutex", lease.token[:8], str(lease.fencing_token)]
        code, out, _ = await _cli("list", "nothing*", "--json", *common)
        assert (code, json.loads(out)) == (0, {"locks": [], "complete": True})
        # not confirmed (a typed "n", and no terminal at all): nothing released
        code, _, err = await _cli("release", "--force", "orders:7", *common, stdin="n\n")
        assert code == 3
        assert "not released" in err
        code, _, _ = await _cli("release", "--force", "orders:7", *common)
        assert code == 3
        assert lease.state is asynclock.LeaseState.HELD
        code, _, err = await _cli("release", "orders:7", *common)  # (--force is required)
        assert code == 2
        assert "--force" in err
        code, _, err = await _cli("release", "--force", "--yes", "nobody", *common)
        assert code == 1
        code, _, err = await _cli("inspect", "", *common)
        assert code == 2
        code, _, err = await _cli("list", "--url", "redis://127.0.0.1:1/0")
        assert code == 69
        assert "cannot reach Redis" in err
    finally:
        await lease.release()


async def test_release_by_hand_releases_only_the_holder_shown(
    redis_server: ServerInfo, client: Redis, prefix: str
) -> None:
    """The holder the command showed is the one released: a fencing token given to
    force_release that the key no longer holds releases nothing; a confirmed release
    with --json prints the prompt on stderr, and only JSON on stdout."""
    first = await asynclock.acquire(client, "job", ttl=30, prefix=prefix)
    await first.release()
    second = await asynclock.acquire(client, "job", ttl=30, prefix=prefix)
    try:
        stale = first.fencing_token
        assert await asynclock_force_release(client, "job", prefix, stale) is None
        assert second.state is asynclock.LeaseState.HELD
        assert await client.exists(second.key) == 1
        common = ("--url", redis_server.url, "--prefix", prefix)
        code, out, err = await _cli("release", "--force", "job", "--json", *common, stdin="y\n")
        assert code == 0, err
        assert json.loads(out) == {"released": "job", "keys_deleted": 1}
        assert "[y/N]" in err
        assert await client.exists(second.key) == 0
    finally:
        with contextlib.suppress(LockLost):
            await second.release()


async def test_ctrl_c_at_the_question_stops_at_once(
    redis_server: ServerInfo, client: Redis, prefix: str
) -> None:
    """Ctrl-C (SIGINT) while the command waits for the answer: it stops at once, not
    confirmed (exit 3), and the holder keeps its lease."""
    lease = await asynclock.acquire(client, "asked", ttl=30, prefix=prefix)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asynclock",
        "release",
        "--force",
        "asked",
        "--url",
        redis_server.url,
        "--prefix",
        prefix,
        stdin=subprocess.PIPE,  # (kept open: the read waits)
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(30):
            asked = b""
            while b"[y/N]" not in asked:
                chunk = await proc.stderr.read(100)
                assert chunk, asked
                asked += chunk
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(5):
            code = await proc.wait()
        assert code == 3
        assert lease.state is asynclock.LeaseState.HELD
        assert await client.exists(lease.key) == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await lease.release()


async def asynclock_force_release(
    client: Redis, name: str, prefix: str, fencing_token: int
) -> int | None:
    from asynclock._apps._inspect import force_release

    return await force_release(client, name, prefix=prefix, fencing_token=fencing_token)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:pw-1@h:6379/0", "redis://user:***@h:6379/0"),
        ("redis://:pw-1@h/0", "redis://:***@h/0"),
        ("redis://token-1@h", "redis://***@h"),
        ("rediss://u:p@w/d@h/0?password=pw-1&db=1", "rediss://u:***@h/0?password=***&db=1"),
        ("redis://h/0?db=1&ssl_password=pw-1#f", "redis://h/0?db=1&ssl_password=***#f"),
        ("unix://:pw-1@/tmp/redis.sock?db=0", "unix://:***@/tmp/redis.sock?db=0"),
        ("user:pw-1@h", "user:***@h"),
        ("redis://h:6379/0?db=1", "redis://h:6379/0?db=1"),
    ],
)
def test_safe_url_masks_every_credential(url: str, shown: str) -> None:
    from asynclock._base._urls import safe_url

    assert safe_url(url) == shown


@pytest.mark.parametrize(
    "command",
    [["inspect", "job"], ["list"], ["release", "--force", "--yes", "job"]],
    ids=["inspect", "list", "release"],
)
async def test_no_command_prints_the_password(
    private_server: RedisServer, command: list[str]
) -> None:
    """The password of a URL (user:password@, :password@, ?password=, $REDIS_URL) is in
    none of the command's output, whether it ran, was refused, could not reach the
    server or could not parse the URL; the messages still name the server, masked."""
    for label, url, environ in await urls_with_a_secret(private_server):
        args = [*command, "--url", url] if url else command
        code, out, err = await _cli(*args, environ=environ)
        assert SECRET not in out + err, (label, out, err)
        assert "Traceback" not in err, (label, err)
        if label == "right":  # (release: nothing held, exit 1)
            assert code in (0, 1), (label, err)
            continue
        assert code == (2 if label == "unparsable" else 69), (label, err)
        assert "***" in err, (label, err)


async def test_a_server_that_does_not_answer_is_reported(private_server: RedisServer) -> None:
    """A server that accepts connections but never answers (SIGSTOP): the command
    reports it with exit status 69 (the client's 5 s time limit), not a traceback."""
    private_server.pause()
    try:
        code, _, err = await _cli("inspect", "job", "--url", private_server.url)
    finally:
        private_server.resume()
    assert code == 69, err
    assert "cannot reach Redis" in err
    assert "Traceback" not in err


async def test_list_covers_every_primary_of_a_cluster(prefix: str) -> None:
    with cluster_nodes(3) as nodes:
        cluster = RedisCluster(host="127.0.0.1", port=nodes[0].port)
        names = [f"n{i}" for i in range(12)]
        leases = [await asynclock.acquire(cluster, n, ttl=30, prefix=prefix) for n in names]
        try:
            url = f"redis://127.0.0.1:{nodes[1].port}/0"
            code, out, err = await _cli(
                "list", "--cluster", "--json", "--url", url, "--prefix", prefix
            )
            assert code == 0, err
            listed = json.loads(out)
            assert listed["complete"]
            assert sorted(i["name"] for i in listed["locks"]) == sorted(names)
        finally:
            for lease in leases:
                await lease.release()
            await cluster.aclose()


async def test_version_and_help_list_what_runs_here(tmp_path: Path) -> None:
    """``--version`` prints the package's version; ``--help`` lists ``demo`` in a clone
    only: an installed package (here: run where ``examples`` cannot be imported) cannot
    run it, and ``asynclock demo`` there says where it lives instead."""
    code, out, err = await _cli("--version")
    assert (code, out.strip()) == (0, f"asynclock {asynclock.__version__}"), err
    code, out, _ = await _cli("--help")
    assert code == 0
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert {"run", "inspect", "list", "release", "demo"} <= listed, out
    code, out, _ = await _cli("--help", outside=tmp_path)
    assert code == 0
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert "run" in listed
    assert "demo" not in listed, out
