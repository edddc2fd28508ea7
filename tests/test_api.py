"""The public façade and input validation (DESIGN.md section 7)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from redis.asyncio import Redis

import asynclock


def test_public_names_are_pinned() -> None:
    """Nothing becomes public by accident, and every public name is importable."""
    assert asynclock.__all__ == sorted(asynclock.__all__)
    assert set(asynclock.__all__) == {
        "AcquireTimeout",
        "EventHook",
        "IdempotencyConflict",
        "Lease",
        "LeaseContext",
        "LeaseEvent",
        "LeaseEventKind",
        "LeaseGuard",
        "LeaseState",
        "LimitConflict",
        "LockBusy",
        "LockError",
        "LockInfo",
        "LockLost",
        "LockStatistics",
        "LossReason",
        "RedlockLease",
        "ReplicationTimeout",
        "ResultNotStored",
        "Serializer",
        "acquire",
        "current_lease",
        "client_from",
        "every",
        "exclusive",
        "forget",
        "idempotent",
        "inspect",
        "lease",
        "once",
        "statistics",
    }
    for name in asynclock.__all__:
        assert getattr(asynclock, name) is not None


def test_a_leases_public_members_are_pinned() -> None:
    """The holder's handle offers the public API only: the lease's machinery is its
    tenure's, which nothing public exposes."""
    public = {name for name in dir(asynclock.Lease) if not name.startswith("_")}
    assert public == {
        "extend",
        "fencing_token",
        "guard",
        "is_held",
        "key",
        "lost_reason",
        "name",
        "release",
        "safe_until",
        "state",
        "time_left",
        "token",
        "ttl",
    }


def test_exception_tree() -> None:
    """Every error derives from LockError; AcquireTimeout is also a TimeoutError."""
    for error in (
        asynclock.LockLost,
        asynclock.LockBusy,
        asynclock.AcquireTimeout,
        asynclock.IdempotencyConflict,
        asynclock.ResultNotStored,
    ):
        assert issubclass(error, asynclock.LockError)
    assert issubclass(asynclock.IdempotencyConflict, ValueError)
    assert issubclass(asynclock.ResultNotStored, TypeError)  # (once() raised TypeError)
    assert issubclass(asynclock.AcquireTimeout, TimeoutError)
    assert asynclock.LockLost.__module__ == "asynclock"


def test_errors_pickle_round_trip() -> None:
    """Errors survive pickling (they cross process boundaries in worker pools)."""
    import pickle

    lost = asynclock.LockLost("orders:42", asynclock.LossReason.DEADLINE, "timer")
    copy = pickle.loads(pickle.dumps(lost))
    assert (copy.name, copy.reason, str(copy)) == (lost.name, lost.reason, str(lost))
    timeout = pickle.loads(pickle.dumps(asynclock.AcquireTimeout("x", 1.5)))
    assert timeout.timeout == 1.5
    conflict = asynclock.LimitConflict("api", "held with limit=3, not 4")
    again = pickle.loads(pickle.dumps(conflict))
    assert (again.name, again.detail, str(again)) == ("api", conflict.detail, str(conflict))
    unstored = asynclock.ResultNotStored("charge:42", "TypeError: not JSON serializable")
    back = pickle.loads(pickle.dumps(unstored))
    assert (back.key, back.cause, str(back)) == ("charge:42", unstored.cause, str(unstored))


@pytest.fixture
async def unreachable() -> Any:
    """A client whose server does not exist: any I/O through it would fail."""
    client = Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    yield client
    await client.aclose()


BAD_INPUTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"name": ""}, ValueError, "name"),
    ({"name": 42}, TypeError, "name"),
    ({"name": None}, TypeError, "name"),
    ({"ttl": 0}, ValueError, "ttl"),
    ({"ttl": -1}, ValueError, "ttl"),
    ({"ttl": math.nan}, ValueError, "ttl"),
    ({"ttl": math.inf}, ValueError, "ttl"),
    ({"ttl": 0.01}, ValueError, "ttl"),
    ({"ttl": "10"}, TypeError, "ttl"),
    ({"ttl": True}, TypeError, "ttl"),
    ({"blocking": "yes"}, TypeError, "blocking"),
    ({"blocking_timeout": -1}, ValueError, "blocking_timeout"),
    ({"blocking_timeout": math.nan}, ValueError, "blocking_timeout"),
    ({"blocking": False, "blocking_timeout": 1}, ValueError, "blocking_timeout"),
    ({"release_timeout": 0}, ValueError, "release_timeout"),
    ({"release_timeout": -0.5}, ValueError, "release_timeout"),
    ({"prefix": 7}, TypeError, "prefix"),
    ({"prefix": "a{b"}, ValueError, "prefix"),
    ({"on_event": "print"}, TypeError, "on_event"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"), BAD_INPUTS, ids=[repr(b[0]) for b in BAD_INPUTS]
)
async def test_bad_input_raises_before_io(
    unreachable: Redis, kwargs: dict[str, Any], error: type[Exception], argument: str
) -> None:
    """Bad arguments raise TypeError/ValueError naming the argument, with no I/O."""
    arguments: dict[str, Any] = {"name": "job", "ttl": 5.0, **kwargs}
    name = arguments.pop("name")
    with pytest.raises(error, match=argument):
        asynclock.lease(unreachable, name, **arguments)


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"), BAD_INPUTS, ids=[repr(b[0]) for b in BAD_INPUTS]
)
async def test_bad_input_is_refused_after_equal_good_input(
    unreachable: Redis, kwargs: dict[str, Any], error: type[Exception], argument: str
) -> None:
    """Validated options are reused for equal arguments; a bad argument that compares
    equal to a good one (``ttl=True`` and ``ttl=1``, ``blocking=1`` and ``True``) is still
    refused."""
    good: dict[str, Any] = {"ttl": 1, "blocking": True, "blocking_timeout": 1, "prefix": "p:"}
    asynclock.lease(unreachable, "job", **good)
    arguments = {**good, **kwargs}
    if arguments.get("blocking") is False:
        arguments.pop("blocking_timeout")
        arguments.update(kwargs)
    name = arguments.pop("name", "job")
    with pytest.raises(error, match=argument):
        asynclock.lease(unreachable, name, **arguments)
    with pytest.raises(TypeError, match="blocking"):
        asynclock.lease(unreachable, "job", **{**good, "blocking": 1})


@pytest.mark.parametrize("client", [None, "redis://x", object()])
def test_non_client_is_a_type_error(client: object) -> None:
    """Only a redis-py asyncio client is accepted."""
    with pytest.raises(TypeError, match="redis"):
        asynclock.lease(client, "job")  # type: ignore[arg-type]


def test_sync_client_is_a_type_error() -> None:
    """A synchronous redis-py client is refused before any I/O."""
    import redis

    sync_client = redis.Redis(host="127.0.0.1", port=1)
    with pytest.raises(TypeError, match=r"redis\.asyncio"):
        asynclock.lease(sync_client, "job")  # type: ignore[arg-type]
    sync_client.close()
