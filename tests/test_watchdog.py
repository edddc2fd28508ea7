"""The watchdog's timeline, step by step with a clock of the test's own.

The lease-level tests (``test_lease``, ``test_faults``) run the watchdog against real
servers; here ``Watchdog._fire`` is called directly with chosen times, on stand-ins that
carry only what the timeline reads, so every branch is taken on purpose: batches split at
the batch limit, stale and ended entries skipped, a deadline declared, a deadline check
that comes up within the coalescing window put back until its time.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

import asynclock._session._watchdog as watchdog_module
from asynclock._session._watchdog import _NONE_ASKED, Watchdog

REAL_RENEW = Watchdog._renew  # (the fixture below replaces it)


class Standin:
    """What the timeline reads of a lease, and a record of what it did to it."""

    def __init__(self, name: str, safe_until: float, ttl: float = 3.0) -> None:
        self.name = name
        self.ttl = ttl
        self.deadline = safe_until
        self.due: float | None = None
        self.active = True
        self.backoff: float | None = None
        self.min_replicas = 0  # (its options: renewals confirmed by no replica)
        self.wait_aof = False
        self.confirmation_steps = 1
        self.deadlines = 0
        self.failed: list[BaseException] = []
        self.broken = False  # its handling raises, as a raising log handler would

    def watch(self, due: float | None) -> None:
        self.due = due

    def note_backoff(self, backoff: float) -> None:
        self.backoff = backoff

    def on_deadline(self, cause: BaseException | None = None) -> None:
        if self.broken:
            raise RuntimeError("a log handler raised")
        self.deadlines += 1

    def confirm(self, t_send: float, safe_until: float | None = None) -> bool:
        if self.broken:
            raise RuntimeError("a log handler raised")
        return True

    @property
    def options(self) -> Any:
        return self

    def safe_until(self, t_send: float) -> float:
        return t_send + self.ttl

    def fail(self, cause: BaseException) -> None:
        self.failed.append(cause)
        self.active = False


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The batches the watchdog sends, by name (nothing goes to Redis)."""
    sent: list[list[str]] = []

    async def record(self: Watchdog, batch: list[Any]) -> None:
        sent.append([lease.name for lease in batch])

    monkeypatch.setattr(Watchdog, "_renew", record)
    monkeypatch.setattr(watchdog_module, "_BATCH", 4)
    return sent


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_group_is_split_at_the_batch_limit_and_each_lease_sent_once(
    batches: list[list[str]],
):
    loop = asyncio.get_running_loop()
    dog = Watchdog(loop, lambda: cast(Any, None))
    base = loop.time() + 1000  # the timeline's own timer never fires during the test
    try:
        live = [Standin(f"live-{i}", base + 2) for i in range(10)]
        stale = Standin("stale", base + 2)
        ended = Standin("ended", base + 2)
        group = [*live[:5], stale, ended, *live[5:]]
        dog._schedule_group(cast(Any, group), base)
        stale.due = base + 0.5  # rescheduled since: its entry in the group is stale
        ended.active = False
        for _ in range(3):
            dog._fire(base)
            await settle()
        assert [len(batch) for batch in batches] == [4, 4, 2]
        sent = [name for batch in batches for name in batch]
        assert sorted(sent) == sorted(lease.name for lease in live)  # each once
        assert all(lease.due is None for lease in live)  # in flight, off the timeline
        assert stale.due == base + 0.5
        assert ended.deadlines == 0
        assert dog._timeline == []
    finally:
        dog._cancel_timeline()


async def test_deadlines_are_declared_at_their_time_never_before(batches: list[list[str]]):
    loop = asyncio.get_running_loop()
    dog = Watchdog(loop, lambda: cast(Any, None))
    base = loop.time() + 1000
    try:
        past = Standin("past", safe_until=base - 0.001)  # its renewal came up too late
        soon = Standin("soon", safe_until=base + 0.02)  # within the 50 ms window
        due = Standin("due", safe_until=base + 2)
        dog.schedule(cast(Any, past), base - 0.5)
        dog.schedule(cast(Any, soon), soon.deadline)  # a deadline check (no retry fits)
        dog.schedule(cast(Any, due), base + 0.01)
        dog._fire(base)
        await settle()
        assert past.deadlines == 1
        assert batches == [["due"]]  # renewed early, within the window
        assert soon.deadlines == 0  # its deadline has not come: put back, not renewed
        assert soon.due is soon.deadline
        assert [entry[0] for entry in dog._timeline] == [soon.deadline]
        dog._fire(base + 0.019)
        await settle()
        assert soon.deadlines == 0
        assert batches == [["due"]]
        dog._fire(soon.deadline)
        await settle()
        assert soon.deadlines == 1
        assert batches == [["due"]]
        assert dog._timeline == []
    finally:
        dog._cancel_timeline()


async def test_a_lease_whose_handling_raises_is_failed_and_the_others_go_on(
    batches: list[list[str]], monkeypatch: pytest.MonkeyPatch
):
    """The watchdog dying of a bug (here: its handling of one lease raises) makes that
    lease lost (``watchdog_failed``), never unwatched, and the rest of its group is
    handled as usual, when it comes up and when its renewal is confirmed."""
    loop = asyncio.get_running_loop()
    dog = Watchdog(loop, lambda: cast(Any, None))
    base = loop.time() + 1000
    try:
        first, broken, last = (Standin(n, base - 0.001) for n in ("first", "broken", "last"))
        broken.broken = True
        dog._schedule_group(cast(Any, [first, broken, last]), base - 0.5)
        dog._fire(base)  # all three past their deadline
        await settle()
        assert (first.deadlines, last.deadlines) == (1, 1)
        assert len(broken.failed) == 1

        renewed = [Standin(f"r{i}", base + 2) for i in range(3)]
        renewed[1].broken = True

        async def answered(self: Watchdog, batch: list[Any]) -> tuple[float, list[object], Any]:
            return base, [1] * len(batch), _NONE_ASKED  # (t_send, replies, no replicas)

        monkeypatch.setattr(Watchdog, "_send", answered)
        await REAL_RENEW(dog, cast(Any, renewed))
        assert len(renewed[1].failed) == 1
        assert renewed[0].due == renewed[2].due == base + 1.0  # due again at ttl/3
        assert [entry[2] for entry in dog._timeline] == [[renewed[0], renewed[2]]]
    finally:
        dog._cancel_timeline()


async def test_leases_due_within_the_window_share_the_entry_scheduled_last(
    batches: list[list[str]],
):
    """A burst of leases costs the timeline one entry per window, not one each; a
    retry, a deadline check or a lease due past the window gets an entry of its own."""
    loop = asyncio.get_running_loop()
    dog = Watchdog(loop, lambda: cast(Any, None))
    base = loop.time() + 1000
    try:
        first, second, later = (Standin(n, base + 2) for n in ("first", "second", "later"))
        retry, check = Standin("retry", base + 2), Standin("check", base + 0.03)
        retry.backoff = 0.05
        dog.schedule(cast(Any, first), base)
        dog.schedule(cast(Any, second), base + 0.01)  # joins first's entry
        dog.schedule(cast(Any, retry), base + 0.02)  # a retry: alone
        dog.schedule(cast(Any, check), check.deadline)  # a deadline check: alone
        dog.schedule(cast(Any, later), base + 0.2)  # past the window: alone
        assert second.due is first.due
        assert [len(entry[2]) for entry in sorted(dog._timeline)] == [2, 1, 1, 1]
        dog._fire(base)
        await settle()
        assert batches == [["first", "second", "retry"]]
        assert check.due is check.deadline  # (put back until its time)
        assert later.due == base + 0.2
    finally:
        dog._cancel_timeline()
