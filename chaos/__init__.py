"""The chaos run: worker processes contend for leases while a seeded nemesis injects faults.

``python -m chaos --workers 4 --seconds 20 --seed 7`` starts a private server
behind a fault proxy and worker processes that take a few locks in turn, doing fenced
writes under them, while faults are injected at random from the seed (proxy delay,
blackhole and reset; server stall, ``CLIENT KILL``, ``FLUSHALL``, restart without
persistence; ``SIGSTOP`` of a holder). It then heals everything, stops the workers, runs
every checker (no overlap among holders that were not paused, no stale fenced write
accepted, exact counters, no key left behind) and prints one summary; a failing seed is
printed with the command that replays its schedule. ``python -m chaos --failover
[--min-replicas N]`` is the failover mode: a primary and a replica, and the only fault
kills the primary right after a grant and promotes the replica; with ``min_replicas=1``
no lock may be granted twice across a failover. ``--shared F``, ``--fair``, ``--redlock
3``, ``--jobs`` and ``--cluster`` are the modes of shared leases, fair locks, Redlock,
``once()`` and Redis Cluster, each with checks of its own (``_modes``, ``_cluster``),
and ``--soak MINUTES`` rotates every mode and prints one table (``_soak``). See ``docs/chaos.md``.

Not needed at run time by asynclock itself. Python API: :func:`run_chaos` (async),
:class:`ChaosConfig`, and :func:`make_schedule`/:class:`Fault` for the seed's schedule.
"""

from __future__ import annotations

from ._nemesis import Fault as Fault
from ._nemesis import FaultKind as FaultKind
from ._nemesis import make_schedule as make_schedule
from ._run import ChaosConfig as ChaosConfig
from ._run import run_chaos as run_chaos
from ._summary import Summary as Summary

__all__ = ["ChaosConfig", "Fault", "FaultKind", "Summary", "make_schedule", "run_chaos"]
