"""``current_lease()``: the lease a job runs under, for the code that is not handed it.

Design note. ``once()`` and ``idempotent()`` run their job, ``exclusive()`` its body and
``every()`` each run inside a lease that the function never sees; to fence its writes
(``asynclock.postgres.fence``, a ``WHERE fence <= $token`` clause) the job needs that
lease's fencing token. Each of them sets a context variable around the call, so the job
(and every task it starts, which copies the context) finds it with ``current_lease()``;
the variable is reset when the call ends, whatever its outcome.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from .._lifecycle._lease import Lease

__all__ = ["current_lease", "running_under"]

_CURRENT: ContextVar[Lease | None] = ContextVar("asynclock_current_lease", default=None)


def current_lease() -> Lease | None:
    """The lease under which the calling code runs as the job of :func:`once` or
    :func:`idempotent`, the body of an :func:`exclusive` call, or a run of :func:`every`
    (and in the tasks it starts); None anywhere else. Its ``fencing_token`` is what the
    job's writes should be fenced with: a write fenced with it is refused once a newer
    holder of the lock has written (see docs/jobs.md, fencing)."""
    return _CURRENT.get()


@contextlib.contextmanager
def running_under(lease: Lease) -> Iterator[None]:
    """``current_lease()`` is ``lease`` inside the block."""
    token = _CURRENT.set(lease)
    try:
        yield
    finally:
        _CURRENT.reset(token)
