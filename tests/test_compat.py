"""What differs between redis-py majors and Pythons (``asynclock._redis._compat``).

The shims are checked here against stand-ins for the older APIs, whatever redis-py is
installed; ``./dev test`` also runs the contract tests on the oldest and the newest
redis-py, on every Python the package claims and on both parsers (``tests/matrix.py``).
The reset storm is the check for Python 3.12 and 3.13, where a write to a connection that
was just reset raises ``AttributeError`` from inside asyncio.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
import redis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError

import asynclock
from asynclock import AcquireTimeout, LockLost, LossReason
from asynclock._redis._compat import (
    as_connection_error,
    as_max_connections_error,
    connection_errors,
    fit_settings,
    get_connection,
)
from asynclock._session._connections import connection_settings
from asynclock.testing import FaultProxy, RedisServer

# -- redis-py's APIs -------------------------------------------------------------------


class _Closed:
    """The end of the line: no ``**kwargs``."""

    def __init__(self, *, db: int = 0, lib_name: str | None = None, lib_version: str = "") -> None:
        pass


class _LegacyConnection(_Closed):
    def __init__(self, *, host: str = "localhost", **kwargs: Any) -> None:
        super().__init__(**kwargs)


def test_settings_keep_only_what_the_connection_class_takes():
    settings = {"host": "h", "db": 1, "driver_info": object(), "protocol": 2, "socket_timeout": 1}
    fitted = fit_settings(_LegacyConnection, settings)
    # (before redis-py 7.2: no driver_info, CLIENT SETINFO off through lib_name/lib_version)
    assert fitted == {"host": "h", "db": 1, "lib_name": None, "lib_version": None}


def test_settings_of_this_redis_py_build_a_connection():
    client = Redis(host="127.0.0.1", port=1, db=2, client_name="app")
    connection_class, settings = connection_settings(client)
    connection = connection_class(**settings)  # (no unexpected keyword argument)
    assert connection.db == 2
    assert settings["protocol"] == 2
    assert settings["health_check_interval"] == 0
    if "driver_info" in settings:  # redis-py 7.2 and later
        assert settings["driver_info"] is None
        assert "lib_name" not in settings
    else:
        assert settings["lib_name"] is None
        assert settings["lib_version"] is None


class _Pool:
    def __init__(self) -> None:
        self.asked: list[tuple[Any, ...]] = []

    async def get_connection(self, *args: Any) -> str:
        self.asked.append(args)
        return "connection"


class _LegacyPool(_Pool):
    async def get_connection(self, command_name: str, *keys: Any, **options: Any) -> str:  # type: ignore[override]
        self.asked.append((command_name,))
        return "connection"


async def test_get_connection_passes_a_command_name_only_where_one_is_required():
    legacy, current = _LegacyPool(), _Pool()
    assert await get_connection(legacy) == await get_connection(current) == "connection"
    assert legacy.asked == [("EVALSHA",)]
    assert current.asked == [()]


def test_a_full_pool_of_any_redis_py_is_max_connections_error():
    old = RedisConnectionError("Too many connections")  # redis-py before 8
    translated = as_max_connections_error(old)
    assert isinstance(translated, MaxConnectionsError)
    assert translated.__cause__ is old
    new = MaxConnectionsError("Too many connections")
    assert as_max_connections_error(new) is new
    other = RedisConnectionError("Error 111 connecting")
    assert as_max_connections_error(other) is other


# -- what the interpreter raises for a dropped connection ------------------------------


def _transport_error() -> AttributeError:
    """The AttributeError of asyncio's writelines() on a transport whose connection was
    lost (Python 3.12, 3.13), raised from asyncio's own code as it is there."""

    class Transport:
        _loop = None

    code = compile(
        "def write(transport):\n    transport._loop._add_writer(0, None)\n",
        asyncio.selector_events.__file__,
        "exec",
    )
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    try:
        namespace["write"](Transport())
    except AttributeError as error:
        return error
    raise AssertionError("no AttributeError")


def test_a_dropped_transport_is_a_connection_error():
    error = _transport_error()
    translated = as_connection_error(error)
    assert isinstance(translated, RedisConnectionError)
    assert translated.__cause__ is error
    with pytest.raises(RedisConnectionError) as caught, connection_errors():
        raise error
    assert caught.value.__cause__ is error


def test_other_attribute_errors_stay_what_they_are():
    with pytest.raises(AttributeError) as caught:
        _ = None.missing  # type: ignore[attr-defined]  # (raised here, not in asyncio)
    assert as_connection_error(caught.value) is caught.value
    mine = AttributeError("no such setting")
    assert as_connection_error(mine) is mine
    with pytest.raises(AttributeError), connection_errors():
        raise mine


# -- a reset storm ---------------------------------------------------------------------

_EXPECTED = (RedisError, OSError, TimeoutError, LockLost, AcquireTimeout)


async def test_reset_storm_gives_connection_errors_never_attribute_errors(
    private_server: RedisServer, prefix: str
):
    """Leases, verified checks and releases while every connection is reset every few
    milliseconds: each failure is a connection error, a timeout or a loss by deadline or
    owner, never the interpreter's AttributeError (Python 3.12/3.13) nor a dead watchdog
    (``watchdog_failed``), and no internal task ends with an unretrieved exception."""
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    failures: list[BaseException] = []
    rounds = 0
    rng = random.Random(17)
    async with FaultProxy("127.0.0.1", private_server.port) as proxy:
        client = Redis.from_url(proxy.url, socket_timeout=1.0)
        stop = time.monotonic() + 4.0

        async def worker(index: int) -> None:
            nonlocal rounds
            while time.monotonic() < stop:
                try:
                    async with asynclock.lease(
                        client,
                        f"storm-{index % 3}",
                        ttl=0.6,
                        prefix=prefix,
                        blocking_timeout=0.5,
                        release_timeout=0.3,
                    ) as lock:
                        for _ in range(4):
                            await lock.is_held(verify=True)
                            await asyncio.sleep(rng.uniform(0, 0.03))
                    rounds += 1
                except _EXPECTED as exc:
                    failures.append(exc)
                except Exception as exc:  # (AttributeError: the bug)
                    failures.append(exc)

        async def storm() -> None:
            while time.monotonic() < stop:
                await asyncio.sleep(rng.uniform(0.005, 0.03))
                await proxy.reset_all()

        try:
            await asyncio.gather(storm(), *(worker(i) for i in range(6)))
        finally:
            await client.aclose()
    await asyncio.sleep(0.1)  # (anything left to report)
    loop.set_exception_handler(None)
    foreign = [exc for exc in failures if not isinstance(exc, _EXPECTED)]
    assert not foreign, f"{len(foreign)} unexpected errors, e.g. {foreign[0]!r}"
    attribute = [exc for exc in failures if isinstance(exc.__cause__, AttributeError)]
    dead = [
        exc
        for exc in failures
        if isinstance(exc, LockLost) and exc.reason is LossReason.WATCHDOG_FAILED
    ]
    assert not dead, f"renewals died: {dead[0]!r} (cause {dead[0].__cause__!r})"
    # (asynclock's own tasks; the proxy's callbacks may trip over sockets reset under them)
    ours = [
        context
        for context in unhandled
        if isinstance(context.get("exception"), AttributeError)
        or "asynclock" in repr(context.get("future") or context.get("task"))
    ]
    assert not ours, ours[0]
    assert failures, "the storm broke nothing: it tested nothing"
    assert rounds, "nothing succeeded between resets"
    print(  # (-s shows how hard the storm hit, and what became of the transport errors)
        f"redis-py {redis.__version__}: {rounds} rounds, {len(failures)} failures, "
        f"{len(attribute)} from the transport's AttributeError"
    )


def test_the_declared_floor_is_the_oldest_redis_py_tested():
    """pyproject.toml's ``redis`` floor and ``tests/matrix.py``'s oldest leg are one
    version: a floor nobody tests would be a claim again (issue 17)."""
    import tomllib
    from pathlib import Path

    from tests import matrix

    root = Path(__file__).resolve().parent.parent
    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [d for d in dependencies if d.startswith("redis")]
    assert requirement.endswith(f">={matrix.OLDEST}"), requirement
    assert {leg.redis for leg in matrix.LEGS} == {matrix.OLDEST, matrix.NEWEST}
    assert {leg.python for leg in matrix.LEGS} == {"3.11", "3.12", "3.13"}
    assert {leg.hiredis for leg in matrix.LEGS} == {True, False}
