"""What differs between the redis-py versions and Pythons asynclock runs on, in one place.

Design note. asynclock talks to redis-py's asyncio connections and pools directly (see
``_lane``), below the client's command layer, where redis-py's majors differ:

* ``ConnectionPool.get_connection()`` takes no arguments from redis-py 5.3 on, and warns
  when given a command name from 8.0 on; up to 5.2 the command name is required.
  :func:`get_connection` passes one only to a pool class that requires it.
* A connection class takes the settings its ``__init__`` names, and nothing else:
  ``driver_info`` (which turns ``CLIENT SETINFO`` off when None) came in 7.2, where
  ``lib_name``/``lib_version`` did that before and are deprecated since.
  :func:`fit_settings` keeps only what the class accepts (worked out once per class) and
  turns the handshake's ``CLIENT SETINFO`` off the way that class understands.
* A pool that has no connection left raises ``MaxConnectionsError`` from redis-py 8 on,
  a plain ``ConnectionError("Too many connections")`` before: :func:`exhausted` knows both.

And where a dropped connection surfaces as something else than a connection error: on
Python 3.12 and 3.13 (seen on 3.12.1 and 3.13.0), asyncio's ``writelines()`` on a socket
transport whose connection was lost registers a writer through the transport's loop, which
``connection_lost`` has already cleared, and raises ``AttributeError: 'NoneType' object has
no attribute '_add_writer'``; redis-py writes commands with ``writelines()`` and passes that
on as it is. :func:`as_connection_error` turns it (and any ``AttributeError`` on a ``None``
that a connection's torn-down transport, stream or parser raises inside asyncio or
redis-py's or valkey-py's connection code) into the ``redis.exceptions.ConnectionError`` it is, the
original chained, at the boundaries where asynclock exchanges commands: every caller then
classifies it as it classifies any connection error (``UNKNOWN_OUTCOME``: a renewal turns
SUSPECT and is retried, an acquire attempt is retried or abandoned, a release retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import inspect
import os
import traceback
from collections.abc import Awaitable, Iterator, Mapping
from typing import Any, Final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError

from ._valkey import as_redis_error, valkey_errors

__all__ = [
    "as_connection_error",
    "as_max_connections_error",
    "connection_errors",
    "exhausted",
    "fit_settings",
    "get_connection",
]

# -- pools -----------------------------------------------------------------------------


def get_connection(pool: Any) -> Awaitable[Any]:
    """``pool.get_connection()``, with the command name that redis-py before 5.3 requires
    (only for a pool class whose method requires one: later ones warn about it)."""
    if _requires_first_argument(type(pool).get_connection):
        return pool.get_connection("EVALSHA")  # type: ignore[no-any-return]
    return pool.get_connection()  # type: ignore[no-any-return]


@functools.cache  # (worked out once per pool class's method)
def _requires_first_argument(method: Any) -> bool:
    try:
        parameters = list(inspect.signature(method).parameters.values())[1:]  # (self)
    except (TypeError, ValueError):  # (not introspectable: the current API, no argument)
        return False
    if not parameters:
        return False
    first = parameters[0]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return first.kind in positional and first.default is inspect.Parameter.empty


_TOO_MANY: Final = "Too many connections"


def exhausted(error: BaseException) -> bool:
    """Whether ``error``, raised by a pool asked for a connection, says that the pool has
    none left (nothing was sent: another pool may do)."""
    if isinstance(error, MaxConnectionsError):
        return True
    return isinstance(error, RedisConnectionError) and str(error).startswith(_TOO_MANY)


def as_max_connections_error(error: BaseException) -> BaseException:
    """``error``, raised by a pool asked for a connection, as the ``MaxConnectionsError``
    redis-py 8 raises when the pool has none left (redis-py before 8 raises a plain
    ``ConnectionError`` then), the original chained; any other error as it is."""
    if isinstance(error, MaxConnectionsError) or not exhausted(error):
        return error
    translated = MaxConnectionsError(str(error))
    translated.__cause__ = error
    return translated


# -- connection settings ---------------------------------------------------------------

_CLIENT_INFO: Final = ("driver_info", "lib_name", "lib_version")


def fit_settings(connection_class: type[Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` for new connections of ``connection_class``: only what its
    ``__init__`` accepts, and with ``CLIENT SETINFO`` turned off (no handshake round trips
    beyond AUTH/SELECT) the way this redis-py understands."""
    accepted = _accepted_by(connection_class)  # type: ignore[arg-type]  # (a class is hashable)
    fitted = {
        key: value
        for key, value in settings.items()
        if key not in _CLIENT_INFO and (accepted is None or key in accepted)
    }
    # (a class whose settings cannot be known is taken for the current API)
    if accepted is None or "driver_info" in accepted:  # redis-py 7.2 and later
        fitted["driver_info"] = None
    else:  # (lib_name and lib_version: None sends no CLIENT SETINFO)
        fitted.update((key, None) for key in ("lib_name", "lib_version") if key in accepted)
    return fitted


@functools.cache
def _accepted_by(connection_class: type[Any]) -> frozenset[str] | None:
    """The keyword arguments that ``connection_class(...)`` accepts: the ``__init__``
    parameters along its MRO down to the first ``__init__`` without ``**kwargs``; None
    if that cannot be known (worked out once per class)."""
    names: set[str] = set()
    for cls in connection_class.__mro__[:-1]:  # (then object, whose __init__ takes nothing)
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None
        names.update(
            p.name
            for p in parameters
            if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        )
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            break
    return frozenset(names)


# -- dropped connections ---------------------------------------------------------------


def _library_code(*packages: str) -> tuple[str, ...]:
    """The connection and parser code of each of ``packages`` that is installed
    (redis-py, valkey-py: found, never imported)."""
    paths: list[str] = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        root = os.path.dirname(spec.origin)
        paths += [os.path.join(root, "asyncio", "connection.py"), os.path.join(root, "_parsers")]
    return tuple(path if path.endswith(".py") else path + os.sep for path in paths)


_CONNECTION_CODE: Final = (
    os.path.dirname(asyncio.__file__) + os.sep,  # transports and streams
    *_library_code("redis", "valkey"),
)


def as_connection_error(error: BaseException) -> BaseException:
    """``error`` as the connection error it is when it is what the interpreter raises for
    a dropped connection (see the design note): a ``redis.exceptions.ConnectionError``
    with ``error`` as its cause. Any other error is returned as it is."""
    if not _dropped(error):
        return error
    translated = RedisConnectionError(f"Connection lost while writing or reading ({error!r})")
    translated.__cause__ = error
    return translated


def _dropped(error: BaseException) -> bool:
    # (set by the interpreter's own attribute lookup: its object, and the name looked up)
    if not isinstance(error, AttributeError) or error.obj is not None or error.name is None:
        return False
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    return bool(frames) and frames[-1].f_code.co_filename.startswith(_CONNECTION_CODE)


@contextlib.contextmanager
def connection_errors() -> Iterator[None]:
    """Raise what the interpreter raises for a dropped connection in the block as the
    connection error it is (see :func:`as_connection_error`), and a valkey-py error as
    one that is redis-py's class as well (``_valkey.as_redis_error``): the block talks
    to a connection directly, not through the lane, which does that for its own."""
    try:
        yield
    except AttributeError as error:
        raise as_connection_error(error)  # noqa: B904 (its cause is set: the error)
    except valkey_errors() as error:  # (evaluated only when an error is matched)
        raise as_redis_error(error) from error.__cause__
