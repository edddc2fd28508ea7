"""The command line on valkey-py (issue 30): ``--client valkey`` makes ``run``,
``inspect``, ``list`` and ``release`` use valkey-py's clients (a cluster's too).

That valkey-py is what they use shows in the URL they take: valkey-py reads
``valkey://`` URLs, which redis-py refuses (``--client redis``, the default, exits 2
naming ``--url``, before any I/O).
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import pytest
from deployments import cluster_nodes
from redis.asyncio import Redis
from test_operate import _cli

import asynclock
from asynclock import LockLost
from asynclock.testing import ServerInfo

pytest.importorskip("valkey")

import valkey.asyncio


def valkey_url(redis_server: ServerInfo) -> str:
    """The server's URL in valkey-py's own scheme (``valkey://``), which redis-py refuses."""
    assert redis_server.url.startswith("redis://"), redis_server.url
    return "valkey://" + redis_server.url.removeprefix("redis://")


async def test_inspect_list_and_release(
    redis_server: ServerInfo, redis: Redis, prefix: str
) -> None:
    url = valkey_url(redis_server)
    holder = await asynclock.acquire(redis, "orders:1", ttl=30, prefix=prefix)
    try:
        ops = ("--client", "valkey", "--url", url, "--prefix", prefix, "--json")
        code, out, err = await _cli("inspect", "orders:1", *ops)
        assert code == 0, err
        info = json.loads(out)
        assert info["held"]
        assert info["fencing_token"] == holder.fencing_token
        code, out, err = await _cli("list", *ops)
        assert code == 0, err
        assert [lock["name"] for lock in json.loads(out)["locks"]] == ["orders:1"]
        code, out, err = await _cli("release", "orders:1", "--force", "--yes", *ops)
        assert code == 0, err
        assert json.loads(out) == {"released": "orders:1", "keys_deleted": 1}
        with pytest.raises(LockLost):
            await holder.extend()
    finally:
        with contextlib.suppress(LockLost):  # (released by the CLI: lost)
            await holder.release()


async def test_run(redis_server: ServerInfo, redis: Redis, prefix: str) -> None:
    """``run --client valkey`` runs the command under the lease; a lock held elsewhere
    runs nothing (--busy-exit)."""
    url = valkey_url(redis_server)
    run = ("--client", "valkey", "--url", url, "--prefix", prefix)
    show = "import sys; print('ran', sys.argv[1])"
    code, out, err = await _cli("run", "job", *run, "--", sys.executable, "-c", show, "x")
    assert (code, out) == (0, "ran x\n"), err
    async with asynclock.lease(redis, "job", ttl=30, prefix=prefix):
        code, out, err = await _cli("run", "job", *run, "--busy-exit", "9", "--", "false")
    assert (code, out) == (9, ""), err
    assert "held by another holder" in err


async def test_a_cluster(prefix: str) -> None:
    """``list --cluster --client valkey`` covers every primary (a ValkeyCluster client);
    inspect finds a lock on its own node."""
    with cluster_nodes(3) as nodes:
        cluster = valkey.asyncio.ValkeyCluster(host="127.0.0.1", port=nodes[0].port)
        names = [f"n{i}" for i in range(6)]
        leases = [await asynclock.acquire(cluster, n, ttl=30, prefix=prefix) for n in names]
        try:
            url = f"valkey://127.0.0.1:{nodes[1].port}/0"
            ops = ("--cluster", "--client", "valkey", "--url", url, "--prefix", prefix, "--json")
            code, out, err = await _cli("list", *ops)
            assert code == 0, err
            listed = json.loads(out)
            assert listed["complete"]
            assert sorted(i["name"] for i in listed["locks"]) == names
            code, out, err = await _cli("inspect", "n3", *ops)
            assert code == 0, err
            assert json.loads(out)["fencing_token"] == leases[3].fencing_token
        finally:
            for lease in leases:
                await lease.release()
            await cluster.aclose()


async def test_an_unreachable_server_exits_69(prefix: str) -> None:
    """valkey-py's errors are told as redis-py's are: exit 69, no traceback."""
    for command in (["inspect", "x"], ["list"], ["run", "x"]):
        tail = ["--", "true"] if command[0] == "run" else []
        args = [*command, "--client", "valkey", "--url", "valkey://127.0.0.1:1/0", *tail]
        code, _, err = await _cli(*args)
        assert code == 69, err
        assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "x", "--client", "valkey2"], "argument --client: invalid choice"),
        (["list", "--url", "valkey://127.0.0.1:1/0"], "--url valkey://127.0.0.1:1/0"),
        (["run", "x", "--url", "valkey://127.0.0.1:1/0", "--", "true"], "--url valkey://"),
        (["list", "--client", "valkey", "--url", "http://x"], "--url http://x"),
    ],
)
async def test_bad_usage_exits_2_before_any_io(args: list[str], message: str) -> None:
    """A library that is not one, a URL the chosen library does not read (redis-py:
    ``valkey://``)."""
    code, _, err = await _cli(*args)
    assert code == 2, err
    assert message in err


def test_valkey_py_not_installed_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from asynclock.__main__ import main

    found = importlib.util.find_spec

    def without_valkey(name: str, *args: Any) -> Any:
        return None if name == "valkey" else found(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_valkey)
    with pytest.raises(SystemExit) as exited:
        main(["list", "--client", "valkey", "--url", "redis://127.0.0.1:1/0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--client valkey: valkey-py is not installed" in err
    assert 'pip install "asynclock[valkey]"' in err
