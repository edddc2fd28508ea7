"""A FastAPI dependency that holds a lease for the request (``pip install fastapi``).

::

    from asynclock.fastapi import held_lease

    sync_lease = held_lease(lambda: app.state.redis, "sync:{account_id}", ttl=20)

    @app.post("/accounts/{account_id}/sync")
    async def sync(
        account_id: int, lease: Annotated[Lease, Depends(sync_lease, scope="function")]
    ) -> None:
        ...  # cancelled if the lease is lost: the request ends with 503

The key is a ``str.format`` template filled from the request's path parameters. A busy
key answers 409 (``busy="raise"``, the default, with ``Retry-After`` when the holder's
time left is known) or waits (``busy="wait"``; ``blocking_timeout`` then answers 503). A
lease lost while the endpoint runs cancels the endpoint and answers 503.

The lease is given back when FastAPI ends the dependency: with ``scope="function"``
(FastAPI 0.121 and later) when the endpoint returns, before the response is sent; with
the default scope FastAPI ends it only after the response is sent, so the lease is held
until the client has had the response (a loss noticed then changes no answer). FastAPI is
imported only by this module, which nothing else of asynclock imports.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, Unpack

from fastapi import HTTPException, Request

from ._apps._exclusive import LeaseKeywords
from ._apps._template import ClientSource, checked_source, resolver
from ._base._exceptions import AcquireTimeout, LockBusy, LockLost
from ._lifecycle._context import lease
from ._lifecycle._lease import Lease

__all__ = ["held_lease"]


def held_lease(
    redis: ClientSource,
    key: str,
    *,
    busy: Literal["raise", "wait"] = "raise",
    **options: Unpack[LeaseKeywords],
) -> Callable[[Request], AsyncIterator[Lease]]:
    """A dependency (``Depends(held_lease(...), scope="function")``) that holds the lease
    ``key`` while the endpoint runs, and gives it back when FastAPI ends the dependency:
    before the response is sent with ``scope="function"``, after it without (see the
    module's docstring).

    Args:
        redis: a client, or a zero-argument callable returning one, called at each
            request (``lambda: app.state.redis`` for a client made in ``lifespan``).
        key: a ``str.format`` template filled from the request's path parameters
            (``"sync:{account_id}"``); a field that is not one answers 500.
        busy: ``"raise"``: a held key answers 409 at once (``Retry-After``: seconds
            until the holder's key expires unless renewed, rounded up, when known);
            ``"wait"``: wait for it (``blocking_timeout`` seconds at most, then 503).
        options: :func:`asynclock.lease`'s keyword arguments but ``blocking``.

    Raises (when made, before any I/O):
        TypeError, ValueError: a bad option, named.

    The endpoint sees: 409 (busy), 503 (waited too long, or the lease was lost while it
    ran: it was cancelled), and whatever it raises itself.
    """
    if busy not in ("raise", "wait"):
        raise ValueError(f"busy must be 'raise' or 'wait', got {busy!r}")
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty str template, not {key!r}")
    lease_options: dict[str, Any] = {**options, "blocking": busy == "wait"}
    lease(checked_source(redis), "held_lease", **lease_options)  # (checks them: no I/O)
    client_of = resolver(redis, _no_arguments)

    async def dependency(request: Request) -> AsyncIterator[Lease]:
        try:
            name = key.format_map(request.path_params)
        except (KeyError, AttributeError, IndexError, ValueError) as exc:
            raise HTTPException(500, f"lease key {key!r}: {exc!r}") from exc
        context = lease(client_of((), {}), name, **lease_options)
        try:
            async with context as held:
                yield held
        except LockBusy as busy_error:
            headers = None
            if busy_error.retry_after is not None:
                headers = {"Retry-After": str(max(1, math.ceil(busy_error.retry_after)))}
            raise HTTPException(409, f"{name!r} is busy", headers=headers) from busy_error
        except AcquireTimeout as timeout:
            raise HTTPException(503, f"{name!r} stayed busy") from timeout
        except LockLost as lost:
            raise HTTPException(503, f"the lease of {name!r} was lost") from lost

    return dependency


def _no_arguments() -> None:
    """Stands for a function without arguments (the client callable takes none)."""
