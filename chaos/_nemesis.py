"""The nemesis: a seeded schedule of faults, and the code that injects and heals them.

Design note. The schedule is computed up front by :func:`make_schedule` from the seed, the
run's length and the TTL alone, with one ``random.Random(seed)``: the same arguments give
the same faults (kind, variant, offset, duration, parameters) on every machine, so a
failing seed replays the same *attack*. What the system under test does in between is not
replayed: the workers' own random choices are seeded too, but which worker holds which
lock at a given instant depends on the operating system's scheduling. Where a fault needs
a target that only exists at run time (the holder to ``SIGSTOP``, the connections to
kill), the schedule holds a number ``pick`` in [0, 1) and the target is chosen from the
candidates, sorted, by that number.

Every worker connects through a proxy of its own, so a network fault can hit one
worker alone: its ``scope`` is ``all`` (every proxy) or ``holder`` (the proxy of one
worker that holds a lock, chosen by ``pick``; any worker when none does). A holder cut
off alone is the case a lease exists for: the others still reach the server, and must
not get the lock before the holder's guarded work has stopped.

Kinds are drawn from a bag holding each kind once (shuffled, refilled when empty), so
every run of a few bags' length sees every kind. Faults never overlap: each one is healed
before a gap of 1 to 2 TTLs, then the next starts; the first waits for a warm-up of 2
TTLs and the last ends 1.5 TTLs before the run does, so the system is calm at the end.
Durations and amounts are in multiples of the TTL, so the schedule scales with it:

* ``delay``: the proxies in scope delay every chunk both ways, ``within`` the renewal budget
  (0.03-0.1 TTL each way, so a round trip stays far below the TTL/3 renewal period) or
  ``beyond`` it (0.4-0.9 TTL each way: a round trip eats more than the two thirds of the
  TTL a renewal has to be confirmed in), for 2-4 TTLs.
* ``blackhole``: the proxies in scope drop everything (``both`` ways, or only ``upstream`` or only
  ``downstream``) for 1.2-2.5 TTLs; healing resets every proxied connection, since those
  that lost bytes are out of step.
* ``reset``: every connection through the proxies in scope is reset (RST); in the
  ``refuse`` variant new connections are also refused for 0.1-0.6 TTL.
* ``stall``: the server stops answering for 1.2-2.5 TTLs, by ``SIGSTOP`` or by
  ``DEBUG SLEEP``.
* ``client_kill``: ``CLIENT KILL`` on the server of ``all`` client connections (the
  proxy's upstream ones) or of ``some`` (30-70 %, chosen by ``pick``).
* ``flush``: ``FLUSHALL``: every lease key (and fencing counter) is lost.
* ``restart``: ``SIGKILL`` of the server and a restart on the same port without
  persistence, after 0-0.75 TTL down: everything is lost.
* ``holder_stop``: a worker process that holds a lock (as its last report says) is
  stopped with ``SIGSTOP`` for 2.5 TTLs; a :class:`~asynclock.testing.Pause` is recorded
  in the shared history for every contender (holder id) of the process, since all of them
  are stopped.

The fair mode (``make_schedule(..., kinds=FAIR_KINDS)``) draws from its own bag: the
faults that leave a live waiter's place in the queue alone or take the queue away as a
whole (``reset``, ``client_kill``, ``flush``, ``restart``, ``holder_stop``), and one of its
own:

* ``waiter_stop``: a worker process of which a contender waits for a lock and none holds
  one is stopped with ``SIGSTOP`` for 1.5 x ``FAIR_PATIENCE`` (3 s; at least 2.5 TTLs): its
  waiters' places in the queue are those of dead waiters (no attempt for longer than the
  patience), which the queue must get past within its documented bound. A
  :class:`~asynclock.testing.Pause` is recorded for each of its contenders.

The Redlock mode (``make_schedule(..., kinds=REDLOCK_KINDS)``) runs three independent
servers, each worker reaching each through a proxy of its own, and hits one server at a
time (``pick`` chooses which), so that a majority is always healthy:

* ``server_stop``: ``SIGSTOP`` of one server for 1.2-2.5 TTLs (paused);
* ``server_cut``: every proxy in front of one server drops everything for 1.2-2.5 TTLs
  (a partition), healed with a reset of those connections;
* ``server_restart``: ``SIGKILL`` of one server and a restart on the same port without
  persistence after 0-0.75 TTL: that server loses its keys (a data-loss fault, excused as
  ``restart`` is);
* ``holder_stop``, as in the ordinary run.

The failover mode (:func:`make_failover_schedule`) schedules one kind alone, a fixed
number of times at seeded moments, each one healed (a new replica synced) before the next:

* ``failover``: the primary dies (``SIGKILL``) right after a grant, its replica is
  promoted (``REPLICAOF NO ONE``) and the workers' proxies are repointed at it, so their
  URL stays the same; then a fresh replica of the new primary is started and synced. The
  nemesis waits (up to 1.5 TTLs) for a worker to report a grant, then 0-0.05 TTL more,
  then kills. ``synced``: replication runs as usual until the kill. ``lagging``: the
  replication link is held from the start of the fault (see ``_replication``), so a grant
  answered in the meantime never reaches the replica, as after a moment of replication
  lag: without ``min_replicas`` the promoted replica grants that lock again; with it, no
  acquisition is confirmed while the link is held (each is given back and
  ``ReplicationTimeout`` raised), so the wait for a grant runs out and the kill follows
  an acquisition attempt instead. Scope ``holder`` (two thirds of them): the worker that was
  seen granted is cut off (its proxy drops everything) from the kill until 1.5 TTLs
  later, as a client on the old primary's side of a partition, so it cannot learn that
  its lease is gone before its own deadline; scope ``all``: every worker reaches the new
  primary at once, and a holder's next renewal there finds out (within a third of a TTL).

``flush`` and ``restart`` are *data-loss* faults: the lease of a holder can be gone
before the holder can know it, so its guarded work may overlap the next holder's until
its next renewal; the checks excuse exactly that (see ``_summary``).

All times are seconds; offsets are from the start of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import math
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

from asynclock._kinds._fair import FAIR_PATIENCE
from asynclock.testing import Direction, FaultProxy, History, ProxyMode, RedisServer

from ._replication import Replication

__all__ = [
    "DATA_LOSS",
    "FAIR_KINDS",
    "JOB_KINDS",
    "NETWORK",
    "ORDINARY",
    "REDLOCK_KINDS",
    "Fault",
    "FaultKind",
    "Injection",
    "Nemesis",
    "Target",
    "make_failover_schedule",
    "make_schedule",
]


class FaultKind(enum.StrEnum):
    """The kinds of fault the nemesis injects."""

    DELAY = "delay"
    BLACKHOLE = "blackhole"
    RESET = "reset"
    STALL = "stall"
    CLIENT_KILL = "client_kill"
    FLUSH = "flush"
    RESTART = "restart"
    HOLDER_STOP = "holder_stop"
    FAILOVER = "failover"
    WAITER_STOP = "waiter_stop"
    SERVER_STOP = "server_stop"
    SERVER_CUT = "server_cut"
    SERVER_RESTART = "server_restart"
    MIGRATE = "migrate"
    RUNNER_KILL = "runner_kill"
    RUNNER_STOP = "runner_stop"
    SUPERVISOR_STOP = "supervisor_stop"
    SUPERVISOR_KILL = "supervisor_kill"

    def __str__(self) -> str:
        return self.value


ORDINARY: Final = (
    FaultKind.DELAY,
    FaultKind.BLACKHOLE,
    FaultKind.RESET,
    FaultKind.STALL,
    FaultKind.CLIENT_KILL,
    FaultKind.FLUSH,
    FaultKind.RESTART,
    FaultKind.HOLDER_STOP,
)
"""The kinds of the ordinary run, in the order its schedule's bag is filled (so adding
the kinds only the failover, fair and Redlock modes schedule left every seed's schedule
as it was)."""

FAIR_KINDS: Final = (
    FaultKind.RESET,
    FaultKind.CLIENT_KILL,
    FaultKind.FLUSH,
    FaultKind.RESTART,
    FaultKind.HOLDER_STOP,
    FaultKind.WAITER_STOP,
)
"""The kinds of the fair mode: none that stops a live waiter's attempts from reaching the
server (a delay, black hole or stall makes it a dead waiter to the queue), and
``waiter_stop``, which makes dead waiters on purpose."""

REDLOCK_KINDS: Final = (
    FaultKind.SERVER_STOP,
    FaultKind.SERVER_CUT,
    FaultKind.SERVER_RESTART,
    FaultKind.HOLDER_STOP,
)
"""The kinds of the Redlock mode: one of its servers at a time, or a holder."""

JOB_KINDS: Final[dict[str, tuple[FaultKind, ...]]] = {
    "fenced": (
        FaultKind.RUNNER_KILL,
        FaultKind.RUNNER_STOP,
        FaultKind.BLACKHOLE,
        FaultKind.DELAY,
        FaultKind.RESET,
        FaultKind.FLUSH,
        FaultKind.RESTART,
        FaultKind.RUNNER_KILL,
    ),
    "every": (
        FaultKind.RUNNER_STOP,
        FaultKind.BLACKHOLE,
        FaultKind.DELAY,
        FaultKind.RESET,
        FaultKind.STALL,
        FaultKind.FLUSH,
        FaultKind.RESTART,
    ),
    "run": (
        FaultKind.RUNNER_STOP,
        FaultKind.BLACKHOLE,
        FaultKind.DELAY,
        FaultKind.RESTART,
        FaultKind.RUNNER_STOP,
        FaultKind.SUPERVISOR_STOP,
        FaultKind.SUPERVISOR_KILL,
        FaultKind.SUPERVISOR_STOP,
    ),
}
"""The kinds of the job sub-modes (``chaos._jobs``), whose processes the nemesis also
kills (``runner_kill``: ``SIGKILL`` of a process running a job, restarted at once) and
stops (``runner_stop``: ``SIGSTOP`` of its process group, the command of ``asynclock
run`` with it, for 2.5-6 TTLs: sometimes past a period of ``--jobs every``); in ``run``,
also the ``asynclock run`` process alone, its command running on (``supervisor_stop``:
``SIGSTOP`` for 2.5-6 TTLs, then ``SIGCONT``; ``supervisor_kill``: ``SIGKILL``); a kind
listed twice comes twice as often."""

SERVER_FAULTS: Final = frozenset(
    {FaultKind.SERVER_STOP, FaultKind.SERVER_CUT, FaultKind.SERVER_RESTART}
)
"""Faults of one server of several (the Redlock mode), chosen by ``pick``."""

WAITER_STOP_SECONDS: Final = 1.5 * FAIR_PATIENCE
"""How long ``waiter_stop`` stops a waiter (at least 2.5 TTLs): past the patience, so its
place is a dead waiter's."""

DATA_LOSS: Final = frozenset({FaultKind.FLUSH, FaultKind.RESTART, FaultKind.SERVER_RESTART})
"""Faults after which the server no longer has the keys it had."""

NETWORK: Final = frozenset({FaultKind.DELAY, FaultKind.BLACKHOLE, FaultKind.RESET})
"""Faults of the proxies, which hit every worker or one holder (see ``Fault.scope``)."""

_PICKED: Final = frozenset(
    {
        FaultKind.HOLDER_STOP,
        FaultKind.WAITER_STOP,
        FaultKind.RUNNER_KILL,
        FaultKind.RUNNER_STOP,
        FaultKind.SUPERVISOR_STOP,
        FaultKind.SUPERVISOR_KILL,
    }
)  # (kinds aimed at a process chosen by ``pick``)
_WARMUP: Final = 2.0  # TTLs before the first fault
_COOLDOWN: Final = 1.5  # TTLs of calm after the last fault ends
_GAP: Final = (1.0, 2.0)  # TTLs between one fault's end and the next one's start
_HOLDER_STOP: Final = 2.5  # TTLs a holder stays stopped
_RUNNER_STOP: Final = (2.5, 6.0)  # TTLs a runner stays stopped (the job modes)
_HOLDER_WAIT: Final = 1.0  # TTLs to wait for some worker to hold a lock (then: skip/any)
_HOLDER_SCOPE: Final = 0.6  # share of network faults that hit one holder only
_GRANT_WAIT: Final = 1.5  # TTLs a failover waits for a grant before it kills all the same
_AFTER_GRANT: Final = (0.0, 0.05)  # TTLs from the grant seen to the primary's SIGKILL
_FAILOVER_CALM: Final = 3.0  # TTLs after a failover's kill: its heal, then calm
_LAGGING: Final = 2 / 3  # share of failovers whose replica lags (link held) before the kill
_CUT_OFF: Final = 1.5  # TTLs the grantee stays cut off after the kill (scope "holder")
_CUT_OFF_SHARE: Final = 2 / 3  # share of failovers that cut the grantee off


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault.

    Attributes:
        index: position in the schedule, from 0.
        at: seconds from the start of the run at which the fault starts.
        kind: what is done (see the module documentation).
        variant: how, e.g. ``"beyond"`` for a delay beyond the renewal budget.
        duration: seconds the fault lasts before it is healed (0 for instant faults).
        amount: a kind-specific figure in seconds or a fraction: the one-way delay
            (``delay``), the refusal window (``reset``), the fraction of connections
            killed (``client_kill``), the time the server stays down (``restart``), the
            seconds from the grant seen to the primary's ``SIGKILL`` (``failover``, whose
            ``duration`` is the most it waits before that ``SIGKILL``).
        pick: a number in [0, 1) choosing a target among the candidates found at run time.
        scope: for network faults (``delay``, ``blackhole``, ``reset``), ``"all"`` the
            proxies or the one of a ``"holder"``; for ``failover``, ``"holder"`` when the
            worker seen granted is cut off after the kill, else ``"all"``; empty for the
            other kinds.
    """

    index: int
    at: float
    kind: FaultKind
    variant: str
    duration: float
    amount: float
    pick: float
    scope: str = ""

    @property
    def end(self) -> float:
        """Seconds from the start of the run at which the fault is healed (as scheduled)."""
        return self.at + self.duration

    def describe(self) -> str:
        """One line for humans, e.g. ``"#3 at 5.21s delay/beyond 1.90s (0.500s each way)"``."""
        what = f"{self.kind}/{self.variant}" if self.variant else str(self.kind)
        text = f"#{self.index} at {self.at:.2f}s {what}"
        if self.scope:
            text += f" on {self.scope}"
        if self.duration:
            text += f" for {self.duration:.2f}s"
        if self.kind is FaultKind.DELAY:
            text += f" ({self.amount:.3f}s each way)"
        elif self.kind is FaultKind.RESET and self.amount:
            text += f" (refusing new connections for {self.amount:.2f}s)"
        elif self.kind is FaultKind.CLIENT_KILL and self.variant == "some":
            text += f" ({self.amount:.0%} of the connections, pick {self.pick:.3f})"
        elif self.kind in (FaultKind.RESTART, FaultKind.SERVER_RESTART):
            text += f" (down {self.amount:.2f}s)"
        elif self.kind is FaultKind.MIGRATE:
            text += f" (held in between {self.amount:.2f}s, pick {self.pick:.3f})"
        elif self.kind is FaultKind.FAILOVER:
            text = f"#{self.index} at {self.at:.2f}s {what} on {self.scope}"
            text += f" (SIGKILL {self.amount:.3f}s after a grant, waiting up to "
            text += f"{self.duration - self.amount:.2f}s for one)"
        if self.kind in SERVER_FAULTS:
            text += f" (pick {self.pick:.3f}: one server of several)"
        if self.kind in _PICKED or (self.scope == "holder" and self.kind is not FaultKind.FAILOVER):
            text += f" (pick {self.pick:.3f})"
        return text

    def to_json(self) -> dict[str, object]:
        """The fault as a JSON-able dict."""
        return {
            "index": self.index,
            "at": round(self.at, 6),
            "kind": str(self.kind),
            "variant": self.variant,
            "duration": round(self.duration, 6),
            "amount": round(self.amount, 6),
            "pick": round(self.pick, 6),
            "scope": self.scope,
        }


def _draw(rng: random.Random, index: int, at: float, kind: FaultKind, ttl: float) -> Fault:
    """Draw the variant and figures of one fault of ``kind`` starting ``at`` seconds in."""
    variant = ""
    duration = 0.0
    amount = 0.0
    pick = rng.random()
    if kind is FaultKind.DELAY:
        if rng.random() < 0.5:
            variant = "within"
            duration = rng.uniform(2.0, 4.0) * ttl
            amount = rng.uniform(0.03, 0.1) * ttl
        else:
            variant = "beyond"
            duration = rng.uniform(2.0, 3.5) * ttl
            amount = rng.uniform(0.4, 0.9) * ttl
    elif kind is FaultKind.BLACKHOLE:
        variant = rng.choices(("both", "upstream", "downstream"), weights=(3, 1, 1))[0]
        duration = rng.uniform(1.2, 2.5) * ttl
    elif kind is FaultKind.RESET:
        if rng.random() < 0.5:
            variant = "refuse"
            amount = rng.uniform(0.1, 0.6) * ttl
        else:
            variant = "plain"
    elif kind is FaultKind.STALL:
        variant = "sigstop" if rng.random() < 0.5 else "debug-sleep"
        duration = rng.uniform(1.2, 2.5) * ttl
    elif kind is FaultKind.CLIENT_KILL:
        if rng.random() < 0.5:
            variant = "all"
            amount = 1.0
        else:
            variant = "some"
            amount = rng.uniform(0.3, 0.7)
    elif kind is FaultKind.RESTART:
        amount = rng.uniform(0.0, 0.75) * ttl
    elif kind is FaultKind.HOLDER_STOP:
        duration = _HOLDER_STOP * ttl
    elif kind in (FaultKind.RUNNER_STOP, FaultKind.SUPERVISOR_STOP):
        duration = rng.uniform(*_RUNNER_STOP) * ttl
    elif kind is FaultKind.WAITER_STOP:
        duration = max(_HOLDER_STOP * ttl, WAITER_STOP_SECONDS)
    elif kind in (FaultKind.SERVER_STOP, FaultKind.SERVER_CUT):
        duration = rng.uniform(1.2, 2.5) * ttl
    elif kind is FaultKind.SERVER_RESTART:
        amount = rng.uniform(0.0, 0.75) * ttl
    scope = ""
    if kind in NETWORK:
        scope = "holder" if rng.random() < _HOLDER_SCOPE else "all"
    return Fault(index, at, kind, variant, duration, amount, pick, scope)


Draw = Callable[[random.Random, int, float, FaultKind, float], Fault]
"""Draws one fault: (the schedule's generator, its index, its start in seconds, its kind,
the TTL in seconds) -> the fault."""


def make_schedule(
    seed: int,
    seconds: float,
    ttl: float,
    kinds: Sequence[FaultKind] = ORDINARY,
    *,
    draw: Draw | None = None,
    reserve: Callable[[Fault], float] | None = None,
) -> tuple[Fault, ...]:
    """The faults of a run of ``seconds`` with leases of ``ttl`` seconds, from ``seed``.

    Deterministic: equal arguments give equal schedules (``random.Random(seed)`` and
    nothing else). ``kinds`` fill the bag (default: the ordinary run's eight), each
    drawn by ``draw`` (default: the ordinary run's faults). Faults are in order, never
    overlap (nor the seconds ``reserve`` keeps past a fault's end to carry it out and
    heal), start after a warm-up of 2 TTLs and end at least 1.5 TTLs before
    ``seconds``; a run too short for that gets none.

    Raises:
        ValueError: ``seconds`` or ``ttl`` is not a positive finite number.
    """
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"seconds and ttl must be positive, got {seconds!r} and {ttl!r}")
    rng = random.Random(seed)
    end = seconds - _COOLDOWN * ttl
    at = _WARMUP * ttl
    faults: list[Fault] = []
    bag: list[FaultKind] = []
    while True:
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        fault = (draw or _draw)(rng, len(faults), at, bag.pop(), ttl)
        healed = fault.end + (reserve(fault) if reserve else 0.0)
        if healed > end:
            return tuple(faults)
        faults.append(fault)
        at = healed + rng.uniform(*_GAP) * ttl


def make_failover_schedule(seed: int, seconds: float, ttl: float, count: int) -> tuple[Fault, ...]:
    """The failovers of a failover-mode run of ``seconds`` with leases of ``ttl`` seconds.

    Deterministic in its arguments (``random.Random(seed)``). The time between the
    warm-up (2 TTLs) and the calm at the end (1.5 TTLs) is cut into ``count`` equal slots
    (fewer when a slot would be shorter than a failover needs: its wait for a grant, plus
    3 TTLs to heal and calm down), and each slot gets one failover at a seeded moment, so
    that it has ended, as scheduled, 3 TTLs before the next slot begins.

    Raises:
        ValueError: ``seconds`` or ``ttl`` is not a positive finite number, or ``count``
            is below 1.
    """
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"seconds and ttl must be positive, got {seconds!r} and {ttl!r}")
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count!r}")
    rng = random.Random(seed)
    start = _WARMUP * ttl
    span = seconds - _COOLDOWN * ttl - start
    need = (_GRANT_WAIT + _AFTER_GRANT[1] + _FAILOVER_CALM) * ttl
    fits = math.floor(span / need) if span > 0 else 0
    slots = min(count, fits)
    faults: list[Fault] = []
    for index in range(slots):
        slot = span / slots
        variant = "lagging" if rng.random() < _LAGGING else "synced"
        amount = rng.uniform(*_AFTER_GRANT) * ttl
        duration = _GRANT_WAIT * ttl + amount
        at = start + index * slot + rng.uniform(0.0, slot - need)
        scope = "holder" if rng.random() < _CUT_OFF_SHARE else "all"
        pick = rng.random()
        faults.append(Fault(index, at, FaultKind.FAILOVER, variant, duration, amount, pick, scope))
    return tuple(faults)


# --------------------------------------------------------------------------------------
# Injecting
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Injection:
    """What happened when one scheduled fault was injected.

    ``start``/``end`` are ``time.monotonic()`` seconds (comparable with the history's
    intervals); ``start_wall``/``end_wall`` are ``time.time()`` seconds (comparable with
    fencing tokens, which are the server's clock in microseconds). For a data-loss fault
    the keys were lost somewhere in ``[start, end]`` and the server answered again, without
    them, at ``end``. ``outcome`` is ``"done"``, ``"skipped: <why>"`` or ``"error: <what>"``.
    """

    fault: Fault
    start: float = 0.0
    end: float = 0.0
    start_wall: float = 0.0
    end_wall: float = 0.0
    target: str = ""
    outcome: str = "done"
    resumed: float | None = None
    """For ``holder_stop`` and ``waiter_stop``: ``time.monotonic()`` just before the
    ``SIGCONT`` was sent."""
    killed: float | None = None
    """For ``failover``: ``time.monotonic()`` just before the primary's ``SIGKILL``."""
    killed_wall: float | None = None
    promoted: float | None = None
    """For ``failover``: ``time.monotonic()`` once the workers' proxies led to the
    promoted replica (the first moment a worker could reach the new primary)."""
    promoted_wall: float | None = None
    after_grant: bool = False
    """For ``failover``: the kill followed a grant seen during the fault (else its wait
    for one ran out)."""

    @property
    def done(self) -> bool:
        return self.outcome == "done"

    @property
    def data_loss(self) -> bool:
        """True for a ``flush`` or ``restart`` that was carried out."""
        return self.done and self.fault.kind in DATA_LOSS

    def to_json(self) -> dict[str, object]:
        return {
            **self.fault.to_json(),
            "start": round(self.start, 6),
            "end": round(self.end, 6),
            "target": self.target,
            "outcome": self.outcome,
            "resumed": self.resumed,
            "killed": self.killed,
            "promoted": self.promoted,
            "after_grant": self.after_grant,
        }


_DIRECTIONS: Final[dict[str, Direction]] = {
    "both": "both",
    "upstream": "upstream",
    "downstream": "downstream",
}


class Target(NamedTuple):
    """A worker the nemesis can aim at: its name, process id and the index of its proxy,
    and the holder ids its contenders record their intervals under (empty: its name)."""

    name: str
    pid: int
    slot: int
    holders: tuple[str, ...] = ()


Holders = Callable[[], Sequence[Target]]
"""Returns the workers that hold a lock now (by their last report), sorted by name."""

NextGrant = Callable[[], "asyncio.Future[tuple[str, str]]"]
"""Returns a future set to ``(holder, lock)`` by the next grant a worker reports."""


def _bulk_text(reply: bytes) -> str:
    """The text of a raw RESP bulk-string reply (``$<n>\\r\\n<data>\\r\\n``)."""
    if not reply.startswith(b"$"):
        raise ValueError(f"expected a bulk string, got {reply[:80]!r}")
    header, _, rest = reply.partition(b"\r\n")
    size = int(header[1:])
    return rest[: max(size, 0)].decode("utf-8", "replace")


def _client_ids(client_list: str) -> list[int]:
    """The ids of the normal and pub/sub client connections in a ``CLIENT LIST`` text."""
    ids = []
    for line in client_list.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if "id" in fields and fields.get("cmd") != "client|list":
            ids.append(int(fields["id"]))
    return sorted(ids)


class Nemesis:
    """Injects a schedule's faults into a server, the workers' proxies, and the workers.

    Args:
        server: the private server (restarted without persistence by ``restart``).
        proxies: one proxy per worker, in the order of :attr:`Target.slot`.
        history: the shared history, where ``holder_stop`` records its pauses.
        holders: who holds a lock right now, for ``holder_stop`` and ``holder`` scopes.
        workers: every worker, for a ``holder`` scope when nobody holds a lock.
        ttl: the leases' TTL in seconds (to size waits).
        replication: the failover mode's primary and replica (``server`` is then the
            first primary; the nemesis aims at whichever is the primary now).
        next_grant: for ``failover``, to wait for a grant before killing the primary.
        waiters: for ``waiter_stop``, the workers of which a contender waits for a lock
            and none holds one now, sorted by name.
        servers: the Redlock mode's servers, each with the proxies in front of it (one
            per worker), for the faults of one server (``SERVER_FAULTS``); healed too.
        majority: a negative control of the Redlock mode: each fault of one server hits
            a majority of them at once (``pick`` chooses the first, the next ones follow).

    Every fault is healed before :meth:`inject` returns, also when it fails or is
    cancelled. :attr:`injections` lists what was done, in order.
    """

    def __init__(
        self,
        server: RedisServer,
        proxies: Sequence[FaultProxy],
        history: History,
        holders: Holders,
        workers: Sequence[Target],
        ttl: float,
        *,
        replication: Replication | None = None,
        next_grant: NextGrant | None = None,
        waiters: Holders | None = None,
        servers: Sequence[tuple[RedisServer, Sequence[FaultProxy]]] = (),
        majority: bool = False,
    ) -> None:
        self._majority = majority
        self._first_server = server
        self._servers = tuple((srv, tuple(front)) for srv, front in servers)
        self._replication = replication
        self._next_grant = next_grant
        self._proxies = tuple(proxies)
        self._history = history
        self._holders = holders
        self._waiters = waiters
        self._workers = tuple(workers)
        self._ttl = ttl
        self._stopped_pids: set[int] = set()
        self.injections: list[Injection] = []
        self._stop = asyncio.Event()

    @property
    def _server(self) -> RedisServer:
        """The server the workers reach now (the primary, in the failover mode)."""
        if self._replication is not None:
            return self._replication.primary
        return self._first_server

    def stop(self) -> None:
        """Make :meth:`run` return after the fault in progress (if any) is healed."""
        self._stop.set()

    async def run(self, schedule: Sequence[Fault], t0: float, until: float) -> None:
        """Inject every fault of ``schedule`` at ``t0 + fault.at`` (monotonic seconds).

        Stops before a fault that would start at or after ``until``, or once :meth:`stop`
        was called. A fault that comes due late (the previous one took longer than
        scheduled) starts at once.
        """
        for fault in schedule:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, t0 + fault.at - time.monotonic())):
                    await self._stop.wait()
            if self._stop.is_set() or time.monotonic() >= until:
                return
            await self.inject(fault)

    async def inject(self, fault: Fault) -> Injection:
        """Inject ``fault``, wait its duration, heal it; record and return what happened."""
        injection = Injection(fault)
        self.injections.append(injection)
        injection.start, injection.start_wall = time.monotonic(), time.time()
        try:
            await self._inject(fault, injection)
        except asyncio.CancelledError:
            injection.outcome = "error: cancelled"
            raise
        except Exception as exc:
            injection.outcome = f"error: {exc!r}"
        finally:
            injection.end, injection.end_wall = time.monotonic(), time.time()
        return injection

    async def _inject(self, fault: Fault, injection: Injection) -> None:
        kind = fault.kind
        if kind in NETWORK:
            proxies = await self._in_scope(fault, injection)
            if kind is FaultKind.DELAY:
                await self._delay(fault, proxies)
            elif kind is FaultKind.BLACKHOLE:
                await self._blackhole(fault, proxies)
            else:
                await self._reset(fault, proxies)
        elif kind is FaultKind.STALL:
            await self._stall(fault)
        elif kind is FaultKind.CLIENT_KILL:
            injection.target = await self._client_kill(fault)
        elif kind is FaultKind.FLUSH:
            reply = await asyncio.to_thread(self._server.command, "FLUSHALL")
            if reply != b"+OK\r\n":
                raise RuntimeError(f"FLUSHALL answered {reply!r}")
        elif kind is FaultKind.RESTART:
            await self._restart(fault)
        elif kind is FaultKind.HOLDER_STOP:
            await self._holder_stop(fault, injection)
        elif kind is FaultKind.WAITER_STOP:
            await self._waiter_stop(fault, injection)
        elif kind in SERVER_FAULTS:
            await self._one_server(fault, injection)
        elif kind is FaultKind.FAILOVER:
            await self._failover(fault, injection)
        else:  # pragma: no cover - every kind is handled above
            raise AssertionError(kind)

    async def _some_holder(self, pick: float, among: Holders | None = None) -> Target | None:
        """A worker holding a lock (or one of ``among``), chosen by ``pick``; waits up to
        a TTL for one."""
        among = self._holders if among is None else among
        deadline = time.monotonic() + _HOLDER_WAIT * self._ttl
        holders = list(among())
        while not holders and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            holders = list(among())
        if not holders:
            return None
        return holders[min(int(pick * len(holders)), len(holders) - 1)]

    async def _in_scope(self, fault: Fault, injection: Injection) -> tuple[FaultProxy, ...]:
        if fault.scope != "holder":
            injection.target = "all"
            return self._proxies
        target = await self._some_holder(fault.pick)
        if target is None:  # nobody holds a lock: aim at a worker all the same
            workers = self._workers
            target = workers[min(int(fault.pick * len(workers)), len(workers) - 1)]
            injection.target = f"{target.name} (holding nothing)"
        else:
            injection.target = target.name
        return (self._proxies[target.slot],)

    async def _delay(self, fault: Fault, proxies: Sequence[FaultProxy]) -> None:
        jitter = fault.amount * (0.3 if fault.variant == "within" else 0.1)
        try:
            for proxy in proxies:
                proxy.set_mode(ProxyMode.DELAY, delay=fault.amount, jitter=jitter)
            await asyncio.sleep(fault.duration)
        finally:
            for proxy in proxies:
                proxy.set_mode(ProxyMode.PASS)

    async def _blackhole(self, fault: Fault, proxies: Sequence[FaultProxy]) -> None:
        try:
            for proxy in proxies:
                proxy.set_mode(ProxyMode.BLACKHOLE, direction=_DIRECTIONS[fault.variant])
            await asyncio.sleep(fault.duration)
        finally:
            for proxy in proxies:
                proxy.set_mode(ProxyMode.PASS)
            await asyncio.gather(*(proxy.reset_all() for proxy in proxies))

    async def _reset(self, fault: Fault, proxies: Sequence[FaultProxy]) -> None:
        try:
            for proxy in proxies:
                proxy.refuse_new = bool(fault.amount)
            await asyncio.gather(*(proxy.reset_all() for proxy in proxies))
            await asyncio.sleep(fault.amount)
        finally:
            for proxy in proxies:
                proxy.refuse_new = False

    async def _stall(self, fault: Fault) -> None:
        if fault.variant == "sigstop":
            self._server.pause()
            try:
                await asyncio.sleep(fault.duration)
            finally:
                self._server.resume()
            return
        seconds = f"{fault.duration:.3f}"
        reply = await asyncio.to_thread(
            self._server.command, "DEBUG", "SLEEP", seconds, timeout=fault.duration + 5.0
        )
        if reply != b"+OK\r\n":
            raise RuntimeError(f"DEBUG SLEEP answered {reply!r}")

    async def _client_kill(self, fault: Fault) -> str:
        listing = await asyncio.to_thread(self._server.command, "CLIENT", "LIST")
        ids = _client_ids(_bulk_text(listing))
        if fault.variant == "all":
            chosen = ids
        else:
            count = max(1, round(fault.amount * len(ids))) if ids else 0
            chosen = sorted(random.Random(int(fault.pick * 2**32)).sample(ids, count))
        killed = 0
        for client_id in chosen:
            reply = await asyncio.to_thread(self._server.command, "CLIENT", "KILL", "ID", client_id)
            killed += reply == b":1\r\n"
        return f"{killed} of {len(ids)} connections"

    async def _restart(self, fault: Fault) -> None:
        await asyncio.to_thread(self._server.kill)
        try:
            await asyncio.sleep(fault.amount)
        finally:
            await asyncio.to_thread(self._server.restart)

    async def _holder_stop(self, fault: Fault, injection: Injection) -> None:
        target = await self._some_holder(fault.pick)
        if target is None:
            injection.outcome = "skipped: no worker held a lock"
            return
        await self._stop_for(target, fault.duration, injection)

    async def _one_server(self, fault: Fault, injection: Injection) -> None:
        if not self._servers:
            raise RuntimeError(f"{fault.kind} needs several servers (the Redlock mode)")
        count = len(self._servers)
        index = min(int(fault.pick * count), count - 1)
        hit = [(index + k) % count for k in range(count // 2 + 1 if self._majority else 1)]
        injection.target = ", ".join(f"server-{k}" for k in hit)
        await asyncio.gather(*(self._server_fault(fault, *self._servers[k]) for k in hit))

    async def _server_fault(
        self, fault: Fault, server: RedisServer, front: Sequence[FaultProxy]
    ) -> None:
        if fault.kind is FaultKind.SERVER_STOP:
            server.pause()
            try:
                await asyncio.sleep(fault.duration)
            finally:
                server.resume()
        elif fault.kind is FaultKind.SERVER_CUT:
            await self._blackhole(dataclasses.replace(fault, variant="both"), front)
        else:
            await asyncio.to_thread(server.kill)
            try:
                await asyncio.sleep(fault.amount)
            finally:
                await asyncio.to_thread(server.restart)

    async def _waiter_stop(self, fault: Fault, injection: Injection) -> None:
        if self._waiters is None:
            raise RuntimeError("waiter_stop needs to know who waits (the fair mode)")
        target = await self._some_holder(fault.pick, among=self._waiters)
        if target is None:
            injection.outcome = "skipped: no worker only waited"
            return
        await self._stop_for(target, fault.duration, injection)

    async def _stop_for(self, target: Target, seconds: float, injection: Injection) -> None:
        """``SIGSTOP`` of ``target`` for ``seconds``, a pause recorded for its holders."""
        injection.target = target.name
        with self._history.paused(*(target.holders or (target.name,))):
            os.kill(target.pid, signal.SIGSTOP)
            self._stopped_pids.add(target.pid)
            try:
                await asyncio.sleep(seconds)
            finally:
                injection.resumed = time.monotonic()
                self._continue(target.pid)

    async def _failover(self, fault: Fault, injection: Injection) -> None:
        replication = self._replication
        if replication is None:
            raise RuntimeError("a failover needs a primary with a replica (the failover mode)")
        if replication.replica is None:  # (a previous heal failed)
            await replication.add_replica()
        if fault.variant == "lagging":
            replication.hold_link()
        grant = await self._grant_within(fault.duration - fault.amount)
        injection.after_grant = grant is not None
        cut_off: FaultProxy | None = None
        if grant is None:
            injection.target = "no grant seen"
        else:
            holder, lock = grant
            injection.target = f"{holder} on {lock}"
            worker = next((w for w in self._workers if holder in w.holders), None)
            if fault.scope == "holder" and worker is not None:
                cut_off = self._proxies[worker.slot]
                injection.target += f", {worker.name} cut off"
            await asyncio.sleep(fault.amount)
        injection.killed, injection.killed_wall = time.monotonic(), time.time()
        try:
            if cut_off is not None:
                cut_off.set_mode(ProxyMode.BLACKHOLE)
            await replication.kill_primary()
            await self._promote(replication, keep=cut_off)
            injection.promoted, injection.promoted_wall = time.monotonic(), time.time()
            await replication.add_replica()
            if cut_off is not None:
                await asyncio.sleep(
                    max(0.0, injection.killed + _CUT_OFF * self._ttl - time.monotonic())
                )
        finally:
            if cut_off is not None:
                cut_off.set_mode(ProxyMode.PASS)
                await cut_off.reset_all()

    async def _grant_within(self, seconds: float) -> tuple[str, str] | None:
        """The next grant a worker reports within ``seconds``: (holder, lock), or None."""
        if self._next_grant is None:
            return None
        future = self._next_grant()
        try:
            async with asyncio.timeout(seconds):
                return await future
        except TimeoutError:
            return None
        finally:
            future.cancel()

    async def _promote(self, replication: Replication, keep: FaultProxy | None = None) -> None:
        """Promote the replica if the primary is dead, and lead every proxy to the
        primary; connections to the old one are reset, but for those of ``keep`` (a
        proxy dropping everything: its worker learns nothing until it is healed)."""
        primary = await replication.promote()
        for proxy in self._proxies:
            proxy.target_host, proxy.target_port = primary.host, primary.port
        await asyncio.gather(*(p.reset_all() for p in self._proxies if p is not keep))

    def _continue(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self._stopped_pids.discard(pid)

    async def heal_all(self) -> None:
        """Undo every fault that may still be in force: every proxy passes everything and
        accepts new connections, the server runs and is not stopped, no worker is stopped."""
        for proxy in self._proxies:
            proxy.set_mode(ProxyMode.PASS)
            proxy.refuse_new = False
        for pid in list(self._stopped_pids):
            self._continue(pid)
        for server, front in self._servers:
            for proxy in front:
                proxy.set_mode(ProxyMode.PASS)
            if server.is_paused:
                server.resume()
            if not server.is_running:
                await asyncio.to_thread(server.start)
        if self._replication is not None:
            self._replication.link.set_mode(ProxyMode.PASS)
            if not self._replication.primary.is_running:  # a failover cut short
                await self._replication.link.reset_all()
                await self._promote(self._replication)
            return
        if self._server.is_paused:
            self._server.resume()
        if not self._server.is_running:
            await asyncio.to_thread(self._server.start)
