"""The cluster mode: a Redis Cluster of three primaries with a replica each, slots that
migrate under held leases, and primaries that die.

Design note. :class:`ChaosCluster` starts six ``RedisServer(cluster=True)`` nodes
without persistence (three primaries owning a third of the slots each, each with a
replica) and drives them with raw commands (``RedisServer.command``: synchronous, so the
nemesis runs them in threads). Workers reach the cluster directly, through a
``RedisCluster`` client of their own that knows every node's address (no proxy: a
cluster client learns the nodes' addresses from the cluster itself). A node keeps its
port for the whole run, so those addresses stay valid when a node is restarted.

:class:`ClusterNemesis` is the ordinary nemesis (``holder_stop`` is its) with two faults
of its own, drawn from the bag ``CLUSTER_KINDS`` by :func:`make_cluster_schedule`:

* ``migrate``: waits (up to 1.5 TTLs) for a grant, then moves that lock's slot to
  another primary (chosen by ``pick``) as ``redis-cli --cluster reshard`` does:
  ``SETSLOT IMPORTING`` on the target, ``SETSLOT MIGRATING`` on the owner, ``MIGRATE``
  of the slot's keys, ``SETSLOT NODE`` on every primary (the target first). Variant
  ``quick``: all in one go; ``halfway``: the slot stays ``MIGRATING`` with its keys
  already moved (the owner answers ``ASK``) for ``duration``; ``slow``: the slot is
  ``MIGRATING`` with its keys still on the owner (new keys go to the target, scripts over
  keys on both sides are told ``TRYAGAIN``) for ``duration`` before they move. The
  holder keeps its lease, and waiters wait, across it all.
* ``failover``: waits (up to 1.5 TTLs) for a grant, then ``amount`` seconds, then
  ``SIGKILL`` of the primary that owns that lock's slot; its replica is promoted with
  ``CLUSTER FAILOVER TAKEOVER`` (variant ``takeover``) or by the cluster itself once the
  node timeout (2 s) has passed (``automatic``). Then the killed node is started again,
  empty and with no cluster state (its ``nodes.conf`` deleted, and the ``dump.rdb`` a
  node keeps from its days as a replica, whose sync wrote one), on its port; every node
  forgets its old identity, and it joins as the replica of the promoted one (``CLUSTER
  MEET``, ``CLUSTER REPLICATE``, synced). The :class:`~chaos._nemesis.Injection` records
  ``killed`` and ``promoted`` as the failover mode's do, so the summary counts double
  grants across a failover the same way.

The schedule leaves room after each fault for carrying it out and healing (a few
seconds for a failover, whatever the TTL: ``_HEAL``), so faults stay apart.

The mode's own check, :func:`migration_losses`: a lease that was held across a migration
and lost, with no failover, stop of its holder or other fault to explain it, was **lost
to a migration** (must be 0). A lease doubled by a migration is an overlap like any other
(``overlap, not paused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from asynclock.testing import History, RedisServer, keys_left

from ._nemesis import (
    Fault,
    FaultKind,
    Holders,
    Injection,
    Nemesis,
    NextGrant,
    Target,
    _bulk_text,
    _draw,
    make_schedule,
)

if TYPE_CHECKING:  # (_summary runs this mode's check: no import at run time)
    from ._summary import RoundReport

__all__ = [
    "CLUSTER_KINDS",
    "ChaosCluster",
    "ClusterNemesis",
    "across_migrations",
    "cluster_checks",
    "cluster_client",
    "cluster_line",
    "make_cluster_schedule",
    "migration_losses",
]

CLUSTER_KINDS: Final = (FaultKind.MIGRATE, FaultKind.FAILOVER, FaultKind.HOLDER_STOP)
"""The kinds of the cluster mode, in the order its schedule's bag is filled."""

PRIMARIES: Final = 3
SLOTS: Final = 16384
_NODE_TIMEOUT: Final = 2.0  # seconds: RedisServer(cluster=True)'s cluster-node-timeout
_SETTLE: Final = 20.0  # seconds the cluster may take to agree on a change
_GRANT_WAIT: Final = 1.5  # TTLs a fault waits for a grant before it acts all the same
_AFTER_GRANT: Final = (0.0, 0.05)  # TTLs from the grant seen to the primary's SIGKILL
_HELD: Final = (1.0, 2.0)  # TTLs a halfway or slow migration stays in between
_AUTOMATIC: Final = 1 / 3  # share of failovers left to the cluster (no TAKEOVER)
_HEAL: Final = {  # seconds a fault's schedule reserves past its end, to carry it out and heal
    FaultKind.MIGRATE: {"quick": 0.5, "halfway": 0.5, "slow": 0.5},
    FaultKind.FAILOVER: {"takeover": 4.0, "automatic": 8.0},
}
_POLL: Final = 0.02  # seconds between two looks at the cluster's state


# --------------------------------------------------------------------------------------
# The schedule
# --------------------------------------------------------------------------------------


def _draw_cluster(rng: random.Random, index: int, at: float, kind: FaultKind, ttl: float) -> Fault:
    """Draw one fault of ``kind`` starting ``at`` seconds in (see the module doc)."""
    if kind is FaultKind.MIGRATE:
        variant = rng.choice(("quick", "halfway", "slow"))
        held = 0.0 if variant == "quick" else rng.uniform(*_HELD) * ttl
        wait = _GRANT_WAIT * ttl
        return Fault(index, at, kind, variant, wait + held, held, rng.random())
    if kind is FaultKind.FAILOVER:
        variant = "automatic" if rng.random() < _AUTOMATIC else "takeover"
        amount = rng.uniform(*_AFTER_GRANT) * ttl
        duration = _GRANT_WAIT * ttl + amount
        return Fault(index, at, kind, variant, duration, amount, rng.random(), "primary")
    return _draw(rng, index, at, kind, ttl)


def make_cluster_schedule(seed: int, seconds: float, ttl: float) -> tuple[Fault, ...]:
    """The faults of a cluster-mode run of ``seconds`` with leases of ``ttl`` seconds:
    :func:`make_schedule`'s, drawn from a bag of ``CLUSTER_KINDS``, each keeping the
    seconds ``_HEAL`` gives its kind and variant past its end.

    Raises:
        ValueError: ``seconds`` or ``ttl`` is not a positive finite number.
    """
    return make_schedule(seed, seconds, ttl, CLUSTER_KINDS, draw=_draw_cluster, reserve=_healing)


def _healing(fault: Fault) -> float:
    return _HEAL.get(fault.kind, {}).get(fault.variant, 0.0)


# --------------------------------------------------------------------------------------
# The cluster
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class NodeView:
    """One line of ``CLUSTER NODES``: a node's id, port, role and (a primary's) slots."""

    id: str
    port: int
    primary: bool
    primary_id: str
    """Of a replica: the id of its primary (``-`` for a primary)."""
    failed: bool
    connected: bool
    slots: tuple[tuple[int, int], ...]
    """Ranges of slots owned, ends included."""

    @classmethod
    def parse(cls, line: str) -> NodeView:
        fields = line.split()
        flags = fields[2].split(",")
        address = fields[1].split("@")[0]
        slots = []
        for item in fields[8:]:
            if item.startswith("["):  # (a slot being migrated or imported)
                continue
            low, _, high = item.partition("-")
            slots.append((int(low), int(high or low)))
        return cls(
            id=fields[0],
            port=int(address.rpartition(":")[2] or 0),
            primary="master" in flags,
            primary_id=fields[3],
            failed="fail" in flags or "fail?" in flags,
            connected=fields[7] == "connected",
            slots=tuple(slots),
        )

    def owns(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


def _lines(reply: bytes) -> list[str]:
    return [line for line in _bulk_text(reply).splitlines() if line.strip()]


def _ok(reply: bytes, what: str) -> None:
    if not reply.startswith(b"+OK"):
        raise RuntimeError(f"{what} answered {reply[:200]!r}")


def _wait(check: Callable[[], bool], what: str, timeout: float = _SETTLE) -> None:
    """Poll ``check`` (the state of other processes) until true; RuntimeError naming
    ``what`` after ``timeout`` seconds (errors of a node still starting count as false)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            if check():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout:g} s")
        time.sleep(_POLL)


class ChaosCluster:
    """Three primaries with a replica each, on loopback, without persistence.

    Synchronous (raw commands over fresh sockets); the nemesis calls it in threads. Use
    as an async context manager (started and stopped in threads) or call :meth:`start` and
    :meth:`stop`.
    """

    def __init__(self, engine: str | None = None) -> None:
        self.nodes = [RedisServer(engine, cluster=True) for _ in range(2 * PRIMARIES)]
        """Every node, started in this order; a node keeps its port across restarts."""
        self.replicas_started = 0
        """Replicas joined: one per primary at the start, then one per failover healed."""

    async def __aenter__(self) -> ChaosCluster:
        try:
            await asyncio.to_thread(self.start)
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def urls(self) -> tuple[str, ...]:
        """Every node's URL (a worker's cluster client starts from any that answers)."""
        return tuple(node.url for node in self.nodes)

    @property
    def engine(self) -> str:
        return self.nodes[0].engine

    @property
    def version(self) -> str:
        return self.nodes[0].version

    def start(self) -> None:
        """Start the six nodes, give each primary a third of the slots and a replica,
        and wait until every node sees the cluster ok and every replica synced."""
        for node in self.nodes:
            node.start()
        primaries, replicas = self.nodes[:PRIMARIES], self.nodes[PRIMARIES:]
        for index, node in enumerate(primaries):
            low, high = SLOTS * index // PRIMARIES, SLOTS * (index + 1) // PRIMARIES - 1
            _ok(node.command("CLUSTER", "ADDSLOTSRANGE", low, high), "CLUSTER ADDSLOTSRANGE")
        for node in self.nodes[1:]:
            _ok(self.nodes[0].command("CLUSTER", "MEET", node.host, node.port), "CLUSTER MEET")
        for primary, replica in zip(primaries, replicas, strict=True):
            self._join_as_replica(replica, primary)
        self.replicas_started = PRIMARIES
        self.wait_healthy()

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                if node.is_paused:
                    node.resume()
            node.stop()

    # -- looking ----------------------------------------------------------------------

    def view(self, node: RedisServer | None = None) -> list[NodeView]:
        """``CLUSTER NODES`` as ``node`` (default: the first running one) sees it."""
        asked = node if node is not None else next(n for n in self.nodes if n.is_running)
        return [NodeView.parse(line) for line in _lines(asked.command("CLUSTER", "NODES"))]

    def node_id(self, node: RedisServer) -> str:
        return _bulk_text(node.command("CLUSTER", "MYID")).strip()

    def by_port(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def primaries(self) -> list[RedisServer]:
        """The running primaries that own slots, by the first running node's view."""
        return [self.by_port(v.port) for v in self.view() if v.primary and v.slots and not v.failed]

    def owner(self, slot: int) -> RedisServer:
        for view in self.view():
            if view.primary and not view.failed and view.owns(slot):
                return self.by_port(view.port)
        raise RuntimeError(f"no primary owns slot {slot}")

    def replica_of(self, primary: RedisServer) -> RedisServer | None:
        primary_id = self.node_id(primary)
        for view in self.view(primary):
            if not view.primary and view.primary_id == primary_id and not view.failed:
                return self.by_port(view.port)
        return None

    def slot(self, key: str) -> int:
        reply = self.primaries()[0].command("CLUSTER", "KEYSLOT", key)
        return int(reply.strip()[1:])

    def _healthy(self) -> bool:
        running = [n for n in self.nodes if n.is_running]
        for node in running:
            if b"cluster_state:ok" not in node.command("CLUSTER", "INFO"):
                return False
            views = self.view(node)
            if len(views) != len(self.nodes) or any(v.failed or not v.connected for v in views):
                return False
            if sum(1 for v in views if v.primary and v.slots) != PRIMARIES:
                return False
        return True

    def wait_healthy(self) -> None:
        """Wait until every node runs, sees the cluster ok, and knows every other node
        (the six, none failing) with three primaries owning slots."""
        _wait(self._healthy, "the cluster did not become healthy")

    # -- migrating --------------------------------------------------------------------

    def begin_migration(self, slot: int, target: RedisServer) -> RedisServer:
        """``SETSLOT IMPORTING`` on ``target``, ``MIGRATING`` on the owner; returns it."""
        source = self.owner(slot)
        if source is target:
            raise ValueError("the target already owns the slot")
        source_id, target_id = self.node_id(source), self.node_id(target)
        _ok(target.command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id), "IMPORTING")
        _ok(source.command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id), "MIGRATING")
        return source

    def move_keys(self, slot: int, source: RedisServer, target: RedisServer) -> int:
        """``MIGRATE`` every key of ``slot`` from ``source`` to ``target``; returns how
        many moved."""
        moved = 0
        while True:
            reply = source.command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            names = [x for x in reply.split(b"\r\n")[1:] if x and not x.startswith(b"$")]
            if not names:
                return moved
            command: list[str | bytes | int] = ["MIGRATE", target.host, target.port, ""]
            answer = source.command(*command, 0, 5000, "KEYS", *names, timeout=10.0)
            if not answer.startswith((b"+OK", b"+NOKEY")):
                raise RuntimeError(f"MIGRATE answered {answer[:200]!r}")
            moved += len(names)

    def end_migration(self, slot: int, target: RedisServer) -> None:
        """``SETSLOT NODE`` on every primary (the target first): the target owns it."""
        target_id = self.node_id(target)
        primaries = sorted(self.primaries(), key=lambda n: n is not target)
        if target not in primaries:
            primaries.insert(0, target)
        for node in primaries:
            _ok(node.command("CLUSTER", "SETSLOT", slot, "NODE", target_id), "SETSLOT NODE")

    # -- failing over -----------------------------------------------------------------

    def promote(self, replica: RedisServer, takeover: bool) -> None:
        """Make ``replica`` (of a dead primary) the primary: ``CLUSTER FAILOVER
        TAKEOVER``, or wait for the cluster's own failover (after its node timeout)."""
        if takeover:
            _ok(replica.command("CLUSTER", "FAILOVER", "TAKEOVER"), "CLUSTER FAILOVER")
        _wait(
            lambda: b"role:master" in replica.command("INFO", "replication"),
            "the replica was not promoted",
            timeout=_SETTLE + (0.0 if takeover else 5 * _NODE_TIMEOUT),
        )

    def rejoin_as_replica(self, node: RedisServer, primary: RedisServer) -> None:
        """Start the killed ``node`` again, empty and with no cluster state, on its port,
        every other node forgetting its old identity, as a replica of ``primary``."""
        directory = node.directory
        assert directory is not None
        # (a node that was once a replica keeps the RDB file of its sync: not empty then)
        for leftover in ("nodes.conf", "dump.rdb"):
            (directory / leftover).unlink(missing_ok=True)
        old = next((v.id for v in self.view(primary) if v.port == node.port), None)
        node.restart()
        if old is not None:
            for other in self.nodes:
                if other is not node and other.is_running:
                    other.command("CLUSTER", "FORGET", old)  # (refused by its replicas)
        _ok(primary.command("CLUSTER", "MEET", node.host, node.port), "CLUSTER MEET")
        self._join_as_replica(node, primary)
        self.replicas_started += 1
        self.wait_healthy()

    def _join_as_replica(self, node: RedisServer, primary: RedisServer) -> None:
        primary_id = self.node_id(primary)
        _wait(
            lambda: any(v.id == primary_id for v in self.view(node)),
            f"node {node.port} did not meet its primary",
        )
        _ok(node.command("CLUSTER", "REPLICATE", primary_id), "CLUSTER REPLICATE")
        _wait(
            lambda: b"master_link_status:up" in node.command("INFO", "replication"),
            f"node {node.port} did not sync with its primary",
        )

    def heal(self) -> None:
        """Every node running and not stopped, then the cluster healthy. A node found
        dead (a failover cut short) has its replica taken over if it was a primary, and
        rejoins as the replica of the primary left without one."""
        for node in self.nodes:
            if node.is_paused:
                node.resume()
        for node in self.nodes:
            if node.is_running:
                continue
            views = self.view()
            dead = next((v for v in views if v.port == node.port), None)
            if dead is not None and dead.primary and dead.slots:
                heir = next(v for v in views if not v.primary and v.primary_id == dead.id)
                self.promote(self.by_port(heir.port), takeover=True)
            lonely = next(p for p in self.primaries() if self.replica_of(p) is None)
            self.rejoin_as_replica(node, lonely)
        self.wait_healthy()

    async def keys_left(self, prefix: str = "asynclock:") -> list[str]:
        """The lease keys left on the primaries (``keys_left`` on each)."""
        found: list[str] = []
        for node in await asyncio.to_thread(self.primaries):
            client = Redis.from_url(node.url, socket_timeout=5.0, socket_connect_timeout=5.0)
            try:
                found += [f"{node.port}:{key}" for key in await keys_left(client, prefix)]
            finally:
                await client.aclose()
        return found


def cluster_client(urls: Sequence[str], ttl: float) -> RedisCluster:
    """A worker's cluster client: it may start from any node of ``urls``; timeouts as
    the ordinary worker's client (``socket_timeout`` 2 TTLs, at least 1 s)."""
    nodes = []
    for url in urls:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"a node's URL without host or port: {url!r}")
        nodes.append(ClusterNode(parts.hostname, parts.port))
    return RedisCluster(
        startup_nodes=nodes, socket_timeout=max(1.0, 2 * ttl), socket_connect_timeout=1.0
    )


# --------------------------------------------------------------------------------------
# The nemesis
# --------------------------------------------------------------------------------------


class ClusterNemesis(Nemesis):
    """The nemesis of the cluster mode: ``migrate`` and ``failover`` of its own (see
    the module doc), ``holder_stop`` as the ordinary one's. With ``lose_keys`` (the
    negative control), each migration deletes the lock's lease key on its owner before
    moving the slot's keys, as a resharding that lost a key would: the lease is then
    lost to the migration, which the run must report."""

    def __init__(
        self,
        cluster: ChaosCluster,
        history: History,
        holders: Holders,
        workers: Sequence[Target],
        ttl: float,
        *,
        locks: Sequence[str],
        held_locks: Callable[[], Sequence[str]],
        next_grant: NextGrant,
        prefix: str = "asynclock:",
        lose_keys: bool = False,
    ) -> None:
        super().__init__(
            cluster.nodes[0], (), history, holders, workers, ttl, next_grant=next_grant
        )
        self._cluster = cluster
        self._locks = tuple(locks)
        self._held_locks = held_locks
        self._prefix = prefix
        self._lose_keys = lose_keys

    async def _inject(self, fault: Fault, injection: Injection) -> None:
        if fault.kind is FaultKind.MIGRATE:
            await self._migrate(fault, injection)
        elif fault.kind is FaultKind.FAILOVER:
            await self._kill_primary(fault, injection)
        else:
            await super()._inject(fault, injection)

    async def _granted_key(self, fault: Fault, injection: Injection) -> tuple[str, int]:
        """The lease key and slot of the lock a worker was granted next (within 1.5
        TTLs), else of a lock chosen by ``pick`` among those held (or, if none is, all);
        ``injection.target`` and ``after_grant`` say which."""
        grant = await self._grant_within(_GRANT_WAIT * self._ttl)
        injection.after_grant = grant is not None
        if grant is None:
            held = self._held_locks()
            among = held or self._locks
            lock = among[min(int(fault.pick * len(among)), len(among) - 1)]
            injection.target = f"{lock} ({'held' if held else 'free'}, no grant seen)"
        else:
            holder, lock = grant
            injection.target = f"{lock} granted to {holder}"
        key = f"{self._prefix}{{{lock.partition('#')[0]}}}"  # (a permit's slot: its lock)
        return key, await asyncio.to_thread(self._cluster.slot, key)

    async def _migrate(self, fault: Fault, injection: Injection) -> None:
        cluster = self._cluster
        key, slot = await self._granted_key(fault, injection)
        # (the fault starts now: its wait for a grant changed nothing)
        injection.start, injection.start_wall = time.monotonic(), time.time()
        owner = await asyncio.to_thread(cluster.owner, slot)
        others = [n for n in await asyncio.to_thread(cluster.primaries) if n is not owner]
        target = others[min(int(fault.pick * len(others)), len(others) - 1)]
        injection.target += f", slot {slot} from {owner.port} to {target.port}"
        source = await asyncio.to_thread(cluster.begin_migration, slot, target)
        try:
            if self._lose_keys:  # (the negative control: a migration that loses the lease)
                await asyncio.to_thread(source.command, "DEL", key)
            if fault.variant == "slow":
                await asyncio.sleep(fault.amount)
            moved = await asyncio.to_thread(cluster.move_keys, slot, source, target)
            injection.target += f" ({moved} keys)"
            if fault.variant == "halfway":
                await asyncio.sleep(fault.amount)
        finally:
            await asyncio.to_thread(cluster.move_keys, slot, source, target)
            await asyncio.to_thread(cluster.end_migration, slot, target)

    async def _kill_primary(self, fault: Fault, injection: Injection) -> None:
        cluster = self._cluster
        _, slot = await self._granted_key(fault, injection)
        primary = await asyncio.to_thread(cluster.owner, slot)
        replica = await asyncio.to_thread(cluster.replica_of, primary)
        if replica is None:
            raise RuntimeError(f"primary {primary.port} has no replica to promote")
        injection.target += f", primary {primary.port} killed, {replica.port} promoted"
        if injection.after_grant:
            await asyncio.sleep(fault.amount)
        injection.killed, injection.killed_wall = time.monotonic(), time.time()
        await asyncio.to_thread(primary.kill)
        await asyncio.to_thread(cluster.promote, replica, fault.variant == "takeover")
        injection.promoted, injection.promoted_wall = time.monotonic(), time.time()
        await asyncio.to_thread(cluster.rejoin_as_replica, primary, replica)

    async def heal_all(self) -> None:
        """Every worker running (``SIGCONT``), every node running, the cluster healthy."""
        for pid in list(self._stopped_pids):
            self._continue(pid)
        await asyncio.to_thread(self._cluster.heal)


# --------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class MigrationLoss:
    """A lease held across a migration and lost with nothing else to explain it."""

    round: RoundReport
    migration: Injection

    def __str__(self) -> str:
        r = self.round
        return (
            f"{r.who} on {r.lock!r} (fence {r.fence}) lost ({r.reason}) at "
            f"t={_lost_at(r):.6f}, held across {self.migration.fault.describe()} "
            f"({self.migration.target}, t={self.migration.start:.6f}-{self.migration.end:.6f})"
        )


def _held_from(r: RoundReport) -> float:
    assert r.body_start is not None
    return r.lease_from if r.lease_from is not None else r.body_start


def _lost_at(r: RoundReport) -> float:
    for moment in (r.lost_at, r.body_end, r.waited_until):
        if moment is not None:
            return moment
    return math.inf


def _meets(injection: Injection, start: float, end: float) -> bool:
    return injection.done and injection.start <= end and injection.end >= start


def across_migrations(
    rounds: Iterable[RoundReport], injections: Sequence[Injection]
) -> dict[str, int]:
    """How many rounds a migration met: ``held`` (a lease's body ran during it),
    ``waited`` (an acquire waited during it) and ``waited_then_granted`` (of those, how
    many got the lock)."""
    migrations = [i for i in injections if i.fault.kind is FaultKind.MIGRATE]

    def met(start: float | None, end: float | None) -> bool:
        if start is None or end is None:
            return False
        return any(_meets(m, start, end) for m in migrations)

    held = waited = granted = 0
    for r in rounds:
        held += met(r.body_start, r.body_end)
        if met(r.asked_at, r.waited_until):
            waited += 1
            granted += r.body_start is not None
    return {"held": held, "waited": waited, "waited_then_granted": granted}


def migration_losses(
    rounds: Iterable[RoundReport], injections: Sequence[Injection], ttl: float
) -> list[MigrationLoss]:
    """Leases lost that a migration met (from the grant to the loss) and no other fault
    did (from a TTL before the grant: an acquire in flight): **must be 0**."""
    migrations = [i for i in injections if i.fault.kind is FaultKind.MIGRATE]
    others = [i for i in injections if i.fault.kind is not FaultKind.MIGRATE]
    found = []
    for r in rounds:
        if r.body_start is None or r.reason is None:
            continue
        start, lost = _held_from(r), _lost_at(r)
        if any(_meets(o, start - ttl, lost) for o in others):
            continue
        migration = next((m for m in migrations if _meets(m, start, lost)), None)
        if migration is not None:
            found.append(MigrationLoss(r, migration))
    return found


_SHOWN: Final = 5  # losses shown in full in a failing run's details


def cluster_checks(
    rounds: Sequence[RoundReport],
    injections: Sequence[Injection],
    ttl: float,
    failures: list[str],
    details: list[str],
) -> dict[str, int]:
    """The cluster mode's figures (JSON-able); a lease lost to a migration is added to
    ``failures`` (and shown in ``details``)."""
    lost = migration_losses(rounds, injections, ttl)
    if lost:
        failures.append(f"{len(lost)} lease(s) lost to a slot migration")
        details.extend(str(loss) for loss in lost[:_SHOWN])
    across = across_migrations(rounds, injections)
    return {
        "held_across_migration": across["held"],
        "waited_across_migration": across["waited"],
        "waited_then_granted": across["waited_then_granted"],
        "lost_to_migration": len(lost),
    }


def cluster_line(figures: Mapping[str, int], must: Callable[[int], str]) -> str:
    """The summary's line of the cluster mode (``must`` marks a must-be-0 figure)."""
    return (
        f"  slot migrations      {figures['held_across_migration']} leases held and "
        f"{figures['waited_across_migration']} acquires waiting across one "
        f"({figures['waited_then_granted']} then granted); lost to a migration: "
        f"{figures['lost_to_migration']}" + must(figures["lost_to_migration"])
    )
