"""``@exclusive``: one call at a time per key, across every process.

Design note. The decorator is ``lease()`` around each call: the key is made from the
call's arguments (a template, see ``_template``), the client found for the call, and the
body awaited inside ``async with lease(...)``, so it is cancelled on a loss and
``LockLost`` raised as for any lease. Every option is checked when decorating, before any
I/O, by building (not entering) a ``lease()`` against the client, or a placeholder client
when it is found only at each call. ``LeaseKeywords`` spells ``lease()``'s keyword
arguments once for the type checker; ``tests/test_exclusive.py`` holds it to ``lease()``'s
signature.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, Unpack, overload

from .._base._exceptions import LockBusy
from .._base._options import Client
from .._lifecycle._context import HoldKeywords, lease
from ._current import running_under
from ._template import ClientSource, checked_source, key_maker, resolver

__all__ = ["Busy", "LeaseKeywords", "exclusive"]

P = ParamSpec("P")
T = TypeVar("T")

Busy = Literal["wait", "skip", "raise"]
"""What a call does when another holds its key: wait for it (``blocking_timeout``
applies), skip (return ``None`` without running), raise ``LockBusy``."""

_BUSY: tuple[Busy, ...] = ("wait", "skip", "raise")


LeaseKeywords = HoldKeywords
"""``lease()``'s keyword arguments but ``blocking`` (``busy`` says it)."""


@overload
def exclusive(
    redis: ClientSource | Sequence[Client],
    key: str | Callable[..., str],
    *,
    busy: Literal["wait", "raise"] = ...,
    **options: Unpack[LeaseKeywords],
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]: ...
@overload
def exclusive(
    redis: ClientSource | Sequence[Client],
    key: str | Callable[..., str],
    *,
    busy: Literal["skip"],
    **options: Unpack[LeaseKeywords],
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T | None]]]: ...


def exclusive(
    redis: ClientSource | Sequence[Client],
    key: str | Callable[..., str],
    *,
    busy: Busy = "wait",
    **options: Unpack[LeaseKeywords],
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T | None]]]:
    """Decorate a coroutine function so that one call at a time runs per key, across
    every process: each call holds the lease of its key while it runs.

    ::

        @asynclock.exclusive(redis, "sync:{user_id}", ttl=20)
        async def sync_user(user_id: int) -> None:
            ...  # cancelled, and LockLost raised, if the lease is lost

    Args:
        redis: a client (as :func:`asynclock.lease` takes, a list of them for a Redlock
            too); or a zero-argument callable returning one, called at each call (a
            client made in FastAPI's ``lifespan``: ``lambda: app.state.redis``); or
            :func:`asynclock.client_from` to take it from the call's arguments (arq's
            ``client_from("ctx[redis]")``).
        key: a ``str.format`` template whose fields name the function's parameters,
            filled from each call's arguments bound to its signature (defaults applied;
            ``{order.id}`` and ``{ctx[job]}`` reach attributes and items); or a callable
            of the function's arguments returning the key.
        busy: when another holds the key: ``"wait"`` for it (``blocking_timeout``
            applies, then ``AcquireTimeout``), ``"skip"`` the call (it returns ``None``
            and the function is not run), ``"raise"`` ``LockBusy``.
        options: :func:`asynclock.lease`'s keyword arguments (``ttl`` in seconds,
            ``blocking_timeout``, ``max_hold``, ``limit``, ``fair``, ``shared``, ...),
            but ``blocking``: ``busy`` says it.

    Raises (when decorating, before any I/O):
        TypeError, ValueError: a bad option (named), a template field or
            ``client_from`` field that names no parameter of the function, or a
            function that is not callable.

    Raises (from a call): what ``async with lease(...)`` raises (``LockBusy`` with
    ``busy="raise"``, ``AcquireTimeout``, ``LockLost`` when the lease was lost while the
    function ran, which was cancelled), whatever the function raised, ``TypeError`` for
    arguments that do not fit its signature, and ``ValueError`` for a template that
    could not be filled.
    """
    if busy not in _BUSY:
        raise ValueError(f"busy must be one of 'wait', 'skip', 'raise', got {busy!r}")
    if "blocking" in options:
        raise TypeError("blocking is not an option of exclusive(): busy='wait' or 'raise' says it")
    lease_options: dict[str, Any] = {**options, "blocking": busy == "wait"}
    lease(checked_source(redis), "exclusive", **lease_options)  # (checks them: no I/O)

    def decorate(
        func: Callable[P, Awaitable[T]],
    ) -> Callable[P, Coroutine[Any, Any, T | None]]:
        if not callable(func):
            raise TypeError(f"exclusive() decorates a coroutine function, not {func!r}")
        make_key = key_maker(key, func)
        client_of = resolver(redis, func)

        @functools.wraps(func)
        async def run(*args: P.args, **kwargs: P.kwargs) -> T | None:
            context = lease(client_of(args, kwargs), make_key(args, kwargs), **lease_options)
            entered = False
            try:
                async with context as held:
                    entered = True
                    with running_under(held):
                        return await func(*args, **kwargs)
            except LockBusy:
                if busy == "skip" and not entered:  # (not one the function raised)
                    return None
                raise

        return run

    return decorate
