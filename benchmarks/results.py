"""What a benchmark run found, and the medians and in-run ratios read from it."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .stats import median

__all__ = ["PeerEntry", "Record", "Results"]


@dataclass
class Record:
    """One scenario, for one peer, in one run."""

    scenario: str
    peer: str
    run: int
    metrics: dict[str, float] = field(default_factory=dict)
    note: str = ""
    error: str = ""
    seconds: float = 0.0


@dataclass
class PeerEntry:
    key: str
    label: str
    version: str
    config: str
    skipped: str = ""  # why the peer could not be used at all
    unsupported: dict[str, str] = field(default_factory=dict)  # family -> reason


@dataclass
class Results:
    mode: str
    profile: dict[str, Any]
    environment: dict[str, str]
    pinning: str
    scenarios: list[str]
    titles: dict[str, str]
    families: dict[str, str]
    peers: list[PeerEntry]
    records: list[Record] = field(default_factory=list)
    started: str = ""
    duration_s: float = 0.0
    interrupted: bool = False
    server_us: dict[str, float] = field(default_factory=dict)
    """Server µs per uncontended cycle of each kind of lock and recipe (``server.py``),
    measured on the run's server after the scenarios (empty in older results)."""
    server_commands: dict[str, float] = field(default_factory=dict)
    """Commands the server runs per uncontended cycle of each of them (``server.py``;
    empty in older results)."""
    server_thread: dict[str, float] = field(default_factory=dict)
    """µs of the server's main thread per uncontended cycle of each of them, I/O
    included (``server.py``; empty in older results)."""
    server_rounds: dict[str, list[float]] = field(default_factory=dict)
    """Server µs per cycle of each of them block by block, one block per round of their
    turns (``server.py``: the ratios are in-round; empty in older results)."""

    # -- persistence ----------------------------------------------------------------------

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Results:
        data = json.loads(path.read_text())
        data["peers"] = [PeerEntry(**p) for p in data["peers"]]
        data["records"] = [Record(**r) for r in data["records"]]
        return cls(**data)

    # -- reading ------------------------------------------------------------------------

    def peer(self, key: str) -> PeerEntry | None:
        return next((p for p in self.peers if p.key == key), None)

    def label(self, key: str) -> str:
        entry = self.peer(key)
        return entry.label if entry else key

    def records_of(self, scenario: str, peer: str) -> list[Record]:
        return [r for r in self.records if r.scenario == scenario and r.peer == peer]

    def measured(self, scenario: str) -> list[str]:
        """Peers with at least one successful run of ``scenario``, in table order."""
        keys = {r.peer for r in self.records if r.scenario == scenario and not r.error}
        return [p.key for p in self.peers if p.key in keys]

    def values(self, scenario: str, peer: str, metric: str) -> list[float]:
        return [
            r.metrics[metric]
            for r in self.records_of(scenario, peer)
            if not r.error and metric in r.metrics
        ]

    def median(self, scenario: str, peer: str, metric: str) -> float:
        return median(self.values(scenario, peer, metric))

    def spread(self, scenario: str, peer: str, metric: str) -> tuple[float, float]:
        values = [v for v in self.values(scenario, peer, metric) if not math.isnan(v)]
        return (min(values), max(values)) if values else (math.nan, math.nan)

    def ratio(self, scenario: str, peer: str, other: str, metric: str) -> float:
        """Median over runs of ``peer``'s figure divided by ``other``'s in the same run."""
        mine = {
            r.run: r.metrics.get(metric) for r in self.records_of(scenario, peer) if not r.error
        }
        ratios = []
        for record in self.records_of(scenario, other):
            theirs = record.metrics.get(metric)
            ours = mine.get(record.run)
            if record.error or ours is None or theirs is None or theirs == 0:
                continue
            ratios.append(ours / theirs)
        return median(ratios)

    def errors(self) -> list[Record]:
        return [r for r in self.records if r.error]
