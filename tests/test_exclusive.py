"""``@asynclock.exclusive``: one call at a time per key (issue 30)."""

from __future__ import annotations

import asyncio
import inspect
import typing
from typing import Any

import pytest
from redis.asyncio import Redis

import asynclock
from asynclock import AcquireTimeout, LockBusy, LockLost, LossReason
from asynclock._apps._exclusive import LeaseKeywords


def test_lease_keywords_are_lease_s() -> None:
    """The decorators' keywords are lease()'s (but blocking), with their types: one
    TypedDict that lease() and acquire() take too, and whose names are the options the
    run-time check knows (with their defaults), plus on_event."""
    from asynclock._base._options import KEYWORDS
    from asynclock._lifecycle._context import LeaseKeywords as LeaseOwn

    assert set(LeaseKeywords.__annotations__) == set(LeaseOwn.__annotations__) - {"blocking"}
    assert set(LeaseOwn.__annotations__) == set(KEYWORDS) | {"on_event"}
    own_hints = typing.get_type_hints(LeaseOwn)
    for name, annotation in typing.get_type_hints(LeaseKeywords).items():
        assert annotation == own_hints[name], name
    assert not LeaseKeywords.__required_keys__
    assert not LeaseOwn.__required_keys__
    options = inspect.signature(asynclock.lease).parameters["options"]
    assert options.kind is inspect.Parameter.VAR_KEYWORD


def test_an_unknown_keyword_is_refused_before_any_io() -> None:
    client = Redis(host="127.0.0.1", port=1)  # (nothing listens: any I/O would fail)
    with pytest.raises(TypeError, match="'tll'"):
        asynclock.lease(client, "x", tll=5)  # type: ignore[call-arg]


async def test_one_call_at_a_time_per_key(client: Redis, prefix: str) -> None:
    """Calls for one key run one after another; calls for another key run meanwhile."""
    running: dict[int, int] = {}
    most: dict[int, int] = {}
    other_started = asyncio.Event()
    first_holds = asyncio.Event()
    release_first = asyncio.Event()

    @asynclock.exclusive(client, "sync:{user_id}", ttl=5, prefix=prefix)
    async def sync(user_id: int, hold: bool = False) -> int:
        running[user_id] = running.get(user_id, 0) + 1
        most[user_id] = max(most.get(user_id, 0), running[user_id])
        try:
            if user_id == 2:
                other_started.set()
            if hold:
                first_holds.set()
                await release_first.wait()
            await asyncio.sleep(0.01)
            return user_id
        finally:
            running[user_id] -= 1

    first = asyncio.create_task(sync(1, hold=True))
    await first_holds.wait()
    waiting = [asyncio.create_task(sync(user_id=1)) for _ in range(3)]
    # Another key is not held up by key 1's holder.
    assert await asyncio.wait_for(sync(2), 5) == 2
    assert other_started.is_set()
    assert not any(task.done() for task in waiting)
    release_first.set()
    assert await asyncio.gather(first, *waiting) == [1, 1, 1, 1]
    assert most == {1: 1, 2: 1}
    assert await client.exists(f"{prefix}{{sync:1}}") == 0  # (given back)


async def test_busy_policies(redis: Redis, prefix: str) -> None:
    """skip returns None without running; raise raises LockBusy; wait honours
    blocking_timeout; the function's own LockBusy is not taken for a busy key."""
    runs: list[str] = []

    async def body(name: str) -> str:
        runs.append(name)
        return name

    skip = asynclock.exclusive(redis, "k", busy="skip", prefix=prefix)(body)
    refuse = asynclock.exclusive(redis, "k", busy="raise", prefix=prefix)(body)
    wait = asynclock.exclusive(redis, "k", blocking_timeout=0.2, prefix=prefix)(body)
    holder = await asynclock.acquire(redis, "k", prefix=prefix)  # (held by no task)
    assert await skip("skip") is None
    with pytest.raises(LockBusy):
        await refuse("raise")
    with pytest.raises(AcquireTimeout):
        await wait("wait")
    await holder.release()
    assert runs == []
    assert (await skip("a"), await refuse("b"), await wait("c")) == ("a", "b", "c")
    assert runs == ["a", "b", "c"]

    @asynclock.exclusive(redis, "outer", busy="skip", prefix=prefix)
    async def nested() -> None:
        raise LockBusy("inner")

    with pytest.raises(LockBusy, match="inner"):
        await nested()


async def test_the_body_is_cancelled_when_the_lease_is_lost(redis: Redis, prefix: str) -> None:
    """The key deleted under the holder: the next renewal finds it gone, the body is
    cancelled mid-flight and LockLost raised."""
    started = asyncio.Event()
    cancelled = asyncio.Event()

    @asynclock.exclusive(redis, "job:{n}", ttl=0.3, prefix=prefix)
    async def job(n: int) -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # (forever, unless cancelled)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.create_task(job(3))
    await started.wait()
    assert await redis.delete(f"{prefix}{{job:3}}") == 1
    with pytest.raises(LockLost) as caught:
        await asyncio.wait_for(task, 5)
    assert caught.value.reason is LossReason.NOT_OWNER
    assert cancelled.is_set()


async def test_cancelling_a_call_gives_the_key_back(redis: Redis, prefix: str) -> None:
    started = asyncio.Event()

    @asynclock.exclusive(redis, "c", ttl=10, prefix=prefix)
    async def slow() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(slow())
    await started.wait()
    assert await redis.exists(f"{prefix}{{c}}") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await redis.exists(f"{prefix}{{c}}") == 0


async def test_lease_options_reach_the_lease(redis: Redis, prefix: str) -> None:
    """limit=2: two calls at once, not three; on_event sees the lease's events."""
    events: list[asynclock.LeaseEventKind] = []
    inside = 0
    most = 0
    gate = asyncio.Event()
    two_inside = asyncio.Event()

    @asynclock.exclusive(
        redis, "pool", limit=2, prefix=prefix, on_event=lambda e: events.append(e.kind)
    )
    async def use() -> None:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        if inside == 2:
            two_inside.set()
        await gate.wait()
        inside -= 1

    tasks = [asyncio.create_task(use()) for _ in range(3)]
    await two_inside.wait()
    await asyncio.sleep(0.1)  # (time for a third to get in, were it let in)
    assert inside == 2
    gate.set()
    await asyncio.gather(*tasks)
    assert most == 2
    assert events.count(asynclock.LeaseEventKind.ACQUIRED) == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ttl": 0}, ValueError, "ttl must be positive"),
        ({"busy": "maybe"}, ValueError, "busy must be one of"),
        ({"blocking": False}, TypeError, "busy='wait' or 'raise' says it"),
        ({"busy": "skip", "blocking_timeout": 1}, ValueError, "blocking_timeout can only"),
        ({"limit": 0}, ValueError, "limit must be between"),
        ({"on_event": 3}, TypeError, "on_event must be callable"),
        ({"prefix": "a{"}, ValueError, "prefix must not contain"),
        ({"colour": "red"}, TypeError, "colour"),
    ],
)
def test_bad_options_are_refused_when_decorating(
    redis: Redis, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        asynclock.exclusive(redis, "k", **kwargs)


def test_bad_options_are_refused_before_a_late_client_is_known() -> None:
    with pytest.raises(ValueError, match="max_hold"):
        asynclock.exclusive(lambda: None, "k", max_hold=-1)  # type: ignore[arg-type,return-value]

    async def job(user: int) -> None: ...

    with pytest.raises(ValueError, match=r"key: the field \{user_id\} names no parameter"):
        asynclock.exclusive(lambda: None, "sync:{user_id}")(job)  # type: ignore[arg-type]


def test_the_types_a_checker_sees() -> None:
    """busy="skip" makes the result optional (checked by mypy in tests/typecheck too)."""

    async def job(n: int) -> int:
        return n

    hints = typing.get_type_hints(asynclock.exclusive)
    assert "busy" in hints
    assert asynclock.exclusive(Redis(), "k")(job).__wrapped__ is job  # type: ignore[attr-defined]
