"""Key templates and clients taken from a call (issue 30): ``"charge:{order_id}"`` for
``once()``, ``idempotent()`` and ``exclusive()``; ``client_from`` and client callables."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis

import asynclock
from asynclock._apps._template import KeyTemplate, is_template

# -- the template alone (no server) ---------------------------------------------------------


@dataclass
class Order:
    id: int
    lines: list[str]


async def charge(order: Order, cents: int, currency: str = "EUR", *, retry: int = 0) -> int:
    return cents


@pytest.mark.parametrize(
    ("template", "args", "kwargs", "key"),
    [
        ("charge:{order.id}", (Order(7, []), 5), {}, "charge:7"),
        ("charge:{order.id}:{currency}", (Order(7, []), 5), {}, "charge:7:EUR"),  # default
        (
            "charge:{order.id}:{currency}",
            (Order(7, []),),
            {"cents": 5, "currency": "USD"},
            "charge:7:USD",
        ),
        ("c:{order.lines[1]}:{retry}", (Order(1, ["a", "b"]), 5), {"retry": 2}, "c:b:2"),
        ("c:{cents:05d}", (Order(1, []), 42), {}, "c:00042"),
        ("c:{cents!r}:{{literal}}", (Order(1, []), 42), {}, "c:42:{literal}"),
        ("plain", (Order(1, []), 42), {}, "plain"),
        ("{{plain}}", (Order(1, []), 42), {}, "{plain}"),
    ],
)
def test_a_template_is_filled_from_the_bound_arguments(
    template: str, args: tuple[Any, ...], kwargs: dict[str, Any], key: str
) -> None:
    assert KeyTemplate(template, charge).render(args, kwargs) == key


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("charge:{order_id}", r"\{order_id\} names no parameter of charge \(its parameters: "),
        ("charge:{ordre.id}", r"\{ordre.id\} names no parameter"),
        ("charge:{0}", r"\{0\} must name a parameter"),
        ("charge:{}", r"\{\} must name a parameter"),
        ("c:{cents:{width}}", r"\{width\} names no parameter"),  # (nested in a spec)
        ("charge:{order", "not a valid template"),
        ("", "must not be empty"),
    ],
)
def test_a_field_naming_no_parameter_is_refused_when_made(template: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KeyTemplate(template, charge)


def test_var_arguments_are_not_fields() -> None:
    async def job(*args: int, **kwargs: int) -> None: ...

    with pytest.raises(
        ValueError, match=r"\{args\} names no parameter of .*job \(its parameters: none\)"
    ):
        KeyTemplate("j:{args}", job)
    with pytest.raises(ValueError, match=r"\{kwargs\}"):
        KeyTemplate("j:{kwargs}", job)


def test_a_call_that_does_not_fit_or_cannot_fill_the_template() -> None:
    template = KeyTemplate("charge:{order.id}", charge)
    with pytest.raises(TypeError, match=r"charge\(\) missing a required argument: 'cents'"):
        template.render((Order(1, []),), {})
    with pytest.raises(ValueError, match="could not be filled: AttributeError") as caught:
        template.render((object(), 5), {})
    assert isinstance(caught.value.__cause__, AttributeError)
    with pytest.raises(ValueError, match="gave ''"):
        KeyTemplate("{currency}", charge).render((Order(1, []), 5, ""), {})


def test_what_once_reads_as_a_template() -> None:
    """A key without a field, or that does not parse, stays a literal key (as before)."""
    assert is_template("charge:{order_id}")
    assert not is_template("charge:42")
    assert not is_template("job{")  # (a lone brace: a literal key, as it always was)
    assert not is_template("a{{b}}")


# -- once() and idempotent() with templates -------------------------------------------------


async def test_once_fills_its_key_from_the_jobs_arguments(client: Redis, prefix: str) -> None:
    runs: list[int] = []

    async def job(order_id: int, note: str = "x") -> int:
        runs.append(order_id)
        return order_id * 10

    assert await asynclock.once(client, "charge:{order_id}:{note}", job, 4, prefix=prefix) == 40
    assert await asynclock.once(client, "charge:{order_id}:{note}", job, 4, prefix=prefix) == 40
    assert await asynclock.once(client, "charge:{order_id}:{note}", job, 5, prefix=prefix) == 50
    assert runs == [4, 5]
    assert (
        await client.exists(f"{prefix}{{charge:4:x}}:result", f"{prefix}{{charge:5:x}}:result") == 2
    )
    # A literal key (no field) is used as it is, braces and all.
    assert await asynclock.once(client, "plain{", job, 6, prefix=prefix) == 60
    assert await client.exists(f"{prefix}{{plain{{}}:result") == 1
    before = await client.keys(prefix + "*")
    with pytest.raises(ValueError, match=r"\{order\} names no parameter of .*job"):
        await asynclock.once(client, "charge:{order}", job, 4, prefix=prefix)
    assert sorted(await client.keys(prefix + "*")) == sorted(before)  # (before any I/O)


async def test_idempotent_with_a_template(client: Redis, prefix: str) -> None:
    """Keyword and positional calls of the same order are one job; an argument that
    renders with braces is not read as a template again."""
    charges: list[tuple[int, int]] = []

    @asynclock.idempotent(client, key="charge:{order.id}", prefix=prefix)
    async def pay(order: Order, cents: int = 100) -> int:
        charges.append((order.id, cents))
        return cents

    assert await asyncio.gather(pay(Order(1, [])), pay(order=Order(1, []), cents=100)) == [100, 100]
    assert await pay(Order(2, []), 300) == 300
    assert charges == [(1, 100), (2, 300)]

    @asynclock.idempotent(client, key="raw:{name}", prefix=prefix)
    async def echo(name: str) -> str:
        return name

    assert await echo("{cents}") == "{cents}"
    assert await client.exists(f"{prefix}{{raw:{{cents}}}}:result") == 1


def test_idempotent_refuses_a_bad_template_when_decorating(redis: Redis) -> None:
    decorate = asynclock.idempotent(redis, key="charge:{order_id}")

    async def pay(order: Order) -> None: ...

    with pytest.raises(ValueError, match=r"key: the field \{order_id\} names no parameter"):
        decorate(pay)
    with pytest.raises(TypeError, match="key must be a template"):
        asynclock.idempotent(redis, key=3)  # type: ignore[arg-type]


# -- clients found at each call ---------------------------------------------------------------


async def test_a_client_callable_is_called_at_each_call(
    redis: Redis, make_client: Callable[..., Redis], prefix: str
) -> None:
    """The client is made after decorating (as in FastAPI's lifespan)."""
    state: dict[str, Redis] = {}
    calls = 0

    def current() -> Redis:
        nonlocal calls
        calls += 1
        return state["redis"]

    @asynclock.idempotent(current, key="job:{n}", prefix=prefix)
    async def job(n: int) -> int:
        return n

    @asynclock.exclusive(current, "ex:{n}", prefix=prefix)
    async def ex(n: int) -> int:
        return n + 1

    with pytest.raises(KeyError):
        await job(1)  # (no client yet: the callable's own error)
    state["redis"] = make_client()
    assert (await job(1), await ex(1)) == (1, 2)
    assert calls == 3
    assert await redis.exists(f"{prefix}{{job:1}}:result") == 1


async def test_client_from_takes_the_client_from_the_arguments(redis: Redis, prefix: str) -> None:
    """arq hands its job ``ctx`` with ``ctx["redis"]``."""

    @asynclock.idempotent(asynclock.client_from("ctx[redis]"), key="j:{n}", prefix=prefix)
    async def job(ctx: dict[str, Any], n: int) -> int:
        return n

    @asynclock.exclusive(asynclock.client_from("ctx[redis]"), "e:{n}", prefix=prefix)
    async def other(ctx: dict[str, Any], n: int) -> int:
        return -n

    assert await job({"redis": redis}, 3) == 3
    assert await other({"redis": redis}, 3) == -3
    assert await redis.exists(f"{prefix}{{j:3}}:result") == 1
    with pytest.raises(
        ValueError, match=r"client_from\('ctx\[redis\]'\) found no client .*KeyError"
    ):
        await job({}, 4)
    with pytest.raises(TypeError, match=r"redis must be a redis\.asyncio\.Redis"):
        await job({"redis": "not a client"}, 4)


def test_client_sources_are_checked_when_decorating(redis: Redis) -> None:
    async def job(ctx: dict[str, Any]) -> None: ...

    with pytest.raises(
        ValueError, match=r"redis: the field \{context\[redis\]\} names no parameter"
    ):
        asynclock.exclusive(asynclock.client_from("context[redis]"), "k")(job)
    with pytest.raises(ValueError, match=r"redis: the field \{context\.redis\}"):
        asynclock.idempotent(asynclock.client_from("context.redis"), key="k")(job)
    with pytest.raises(TypeError, match="must take no arguments"):
        asynclock.exclusive(lambda ctx: ctx["redis"], "k")
    with pytest.raises(TypeError, match=r"redis must be a redis\.asyncio\.Redis or RedisCluster"):
        asynclock.exclusive("redis://localhost", "k")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="field must name a parameter"):
        asynclock.client_from("")
    with pytest.raises(ValueError, match="ttl must be positive"):
        asynclock.idempotent(asynclock.client_from("ctx[redis]"), key="k", ttl=0)


async def test_a_client_callable_returning_an_awaitable_is_refused(prefix: str) -> None:
    async def make() -> Redis:
        return Redis()

    @asynclock.exclusive(make, "k", prefix=prefix)  # type: ignore[arg-type]
    async def job() -> None: ...

    with pytest.raises(TypeError, match="returned an awaitable"):
        await job()
