"""Errors built on ``TimeoutError`` (an ``OSError``) keep their message across pickling.

``OSError.__new__`` leaves ``args`` empty for a subclass with an ``__init__`` of its own
(it leaves them to ``__init__``, which unpickling does not call): the reconstructor must
set them itself, or the copy in the parent of a worker pool says nothing.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

import asynclock


async def test_acquire_timeout_from_a_real_wait_pickles_with_its_message(
    client: Any, prefix: str
) -> None:
    async def contender() -> None:  # (another task: leases are not re-entrant)
        async with asynclock.lease(client, "pickled", ttl=5, prefix=prefix, blocking_timeout=0.05):
            pass  # pragma: no cover

    async with asynclock.lease(client, "pickled", ttl=5, prefix=prefix):
        with pytest.raises(asynclock.AcquireTimeout) as caught:
            await asyncio.create_task(contender())
    error = caught.value
    copy = pickle.loads(pickle.dumps(error))
    assert str(error)  # (it says which lock, and why)
    assert (type(copy), copy.args, str(copy)) == (type(error), error.args, str(error))
    assert copy.timeout == error.timeout


def test_replication_timeout_pickles_with_its_message() -> None:
    error = asynclock.ReplicationTimeout("orders", 2, 1, 0.5)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.args, str(copy)) == (error.args, str(error))
    assert (copy.name, copy.wanted, copy.confirmed) == ("orders", 2, 1)
